"""The run plan: every process's engine options, the route, the sleep mode, placement and memory, from one config."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.plan import RunPlan, plan_run, runner_engine_options
from flashrl.plan.architectures import architecture_for
from flashrl.plan.memory import env_runner_memory, learner_memory_for
from flashrl.weight_sync.layout import RouteError


def _cpu(**env_runners: Any) -> FlashReinforceConfig:
    return FlashReinforceConfig().environment("flashrl/Math-v0").training(model="smollm2-135m-instruct").env_runners(
        **env_runners
    )


def _colocated(**env_runners: Any) -> FlashReinforceConfig:
    return (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0")
        .training(model="Qwen/Qwen2.5-Math-1.5B", dtype="bfloat16", train_batch_size=8)
        .learners(num_learners=1, num_gpus_per_learner=0.5, max_tokens_per_micro_batch=1024)
        .env_runners(num_env_runners=1, num_gpus_per_env_runner=0.5, max_episode_tokens=1024, max_new_tokens=512,
                     **env_runners)
    )  # fmt: skip


def test_a_cpu_run_plans_shm_and_the_runs_context_and_sequences() -> None:
    plan = plan_run(_cpu())
    assert plan.engine_options == {"weight_sync": "shm", "log_level": "WARNING"}
    assert plan.runner_engine_options == {"weight_sync": "shm", "log_level": "WARNING", "max_model_len": 2048,
                                          "max_num_seqs": 16}  # fmt: skip
    assert (plan.weight_sync, plan.sleep_mode, plan.colocated, plan.wait_for_load) == ("shm", False, False, False)
    assert (plan.learners.num_learners, plan.learners.local, plan.learners.num_gpus) == (1, True, 0.0)
    assert (plan.runner_engine.dtype, plan.runner_engine.num_seqs, plan.runner_engine.context) == ("float32", 16, 2048)
    assert plan.runner_engine_options is not plan.engine_options
    assert plan_run(_cpu().training(rollout_mode="sync_group", group_size=4)).wait_for_load


def test_the_estimates_are_the_memory_formulas_on_the_planned_route() -> None:
    config = _colocated()
    plan = plan_run(config)
    arch = architecture_for(config.model, None)
    assert plan.architecture == arch
    assert plan.learner_memory == learner_memory_for(config, arch, weight_sync="ipc")
    assert plan.learner_memory != learner_memory_for(config, arch, weight_sync="shm")  # the push differs
    assert plan.runner_memory == env_runner_memory(arch, engine_dtype="bfloat16", episodes_in_flight=16,
                                                   max_episode_tokens=1024, cpu_vllm=False)  # fmt: skip
    assert plan_run(_cpu().training(model="no-such-org/no-such-model")).learner_memory is None


def test_a_colocated_run_plans_ipc_sleep_mode_and_the_learners_peak() -> None:
    # Qwen2.5-Math-1.5B, bfloat16, AdamW, one learner: peak 36,919,719,936 bytes (34.38 GiB), static
    # state 30,874,286,080 (28.75 GiB); the engine wakes next to what the learner holds: its peak counts
    plan = plan_run(_colocated())
    assert (plan.weight_sync, plan.sleep_mode, plan.colocated) == ("ipc", True, True)
    assert plan.runner_engine_options == {
        "weight_sync": "ipc", "log_level": "WARNING", "sleep_mode": True, "colocated_gpu_fraction": 0.5,
        "colocated_learner_bytes": 36919719936, "max_model_len": 1024, "max_num_seqs": 16,
    }  # fmt: skip
    assert plan.learner_memory.static == 30874286080
    awake = plan_run(_colocated(engine_sleep_mode=False))
    assert awake.runner_engine_options["colocated_learner_bytes"] == awake.learner_memory.total == 36919719936


def test_a_runner_gets_the_plans_options_back_and_a_bare_spec_the_same_derivation() -> None:
    config = _colocated()
    plan = plan_run(config)
    planned_spec = config.env_runner_spec(engine_options=dict(plan.runner_engine_options))
    assert runner_engine_options(planned_spec) == plan.runner_engine_options  # nothing derived twice
    bare = config.env_runner_spec()
    assert runner_engine_options(bare) == {**config.engine_options, "max_model_len": 1024, "max_num_seqs": 16}
    replay = _cpu(engine="torch").training(routing_replay=True)
    assert runner_engine_options(replay.env_runner_spec()) == {"max_model_len": 2048, "max_batch_size": 16,
                                                               "record_routed_experts": True}  # fmt: skip


def test_problems_raise_as_the_run_would_or_are_recorded_for_the_dry_run() -> None:
    nccl_on_cpu = _cpu(engine_options={"weight_sync": "nccl"})
    with pytest.raises(RouteError, match="expected 'auto' or 'shm'"):
        plan_run(nccl_on_cpu)
    recorded = plan_run(nccl_on_cpu, raise_problems=False)
    assert recorded.weight_sync == "shm" and "expected 'auto' or 'shm'" in recorded.route_error
    asleep_on_cpu = _cpu(engine_sleep_mode=True)
    with pytest.raises(ValueError, match="CPU build has no sleep mode"):
        plan_run(asleep_on_cpu)
    recorded = plan_run(asleep_on_cpu, raise_problems=False)
    assert recorded.sleep_mode is False and "CPU build has no sleep mode" in recorded.sleep_error
    unrouted = _cpu(engine_options={"record_routed_experts": False}).training(routing_replay=True)
    with pytest.raises(ValueError, match="routing_replay=True needs the engine's routing"):
        plan_run(unrouted)
    recorded = plan_run(unrouted, raise_problems=False)
    assert "routing_replay=True" in recorded.engine_options_error
    assert recorded.runner_engine_options["record_routed_experts"] is False
    clean = plan_run(_cpu(), raise_problems=False)
    assert (clean.route_error, clean.sleep_error, clean.engine_options_error, clean.runner_memory_error) == (
        None, None, None, None)  # fmt: skip


def test_an_impossible_kv_budget_is_recorded_not_raised() -> None:
    # the engine refuses it at start with the same message; the plan does not fail the run earlier
    plan = plan_run(_cpu(engine_options={"kv_cache_memory_bytes": 10}))
    assert plan.runner_memory is None
    assert plan.runner_memory_error.startswith("kv_cache_memory_bytes gives the KV cache 0.0 MiB (10 bytes)")


def test_vllm_s_legacy_cpu_kv_cache_variable_is_what_the_estimate_counts(monkeypatch) -> None:
    """VLLM_CPU_KVCACHE_SPACE (GiB) wins over the engine's KV budget in vLLM's CPU build, so in the plan too."""
    default = plan_run(_cpu(engine="vllm")).runner_memory
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    legacy = plan_run(_cpu(engine="vllm")).runner_memory
    assert default.kv_cache_reserved != 3 * 2**30 and legacy.kv_cache_reserved == 3 * 2**30
    assert legacy.total - default.total == 3 * 2**30 - default.kv_cache_reserved
    assert plan_run(_cpu(engine="torch")).runner_memory.kv_cache_reserved is None  # the torch engine ignores it
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")
    refused = plan_run(_cpu(engine="vllm"), raise_problems=False)
    assert refused.runner_memory is None and refused.runner_memory_error.startswith("VLLM_CPU_KVCACHE_SPACE=0 (GiB)")


def test_the_plan_is_read_only() -> None:
    plan = plan_run(_cpu())
    assert isinstance(plan, RunPlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.weight_sync = "nccl"  # type: ignore[misc]


def test_a_lora_run_plans_the_adapter_route_and_gives_the_engines_its_settings() -> None:
    lora = {"rank": 16, "alpha": 32.0, "target_modules": "all-linear", "dropout": 0.0}
    plan = plan_run(_cpu().learners(lora_rank=16))
    assert plan.weight_sync == "lora"
    assert plan.engine_options == {"weight_sync": "lora", "lora": lora, "log_level": "WARNING"}
    assert plan.runner_engine_options["lora"] == lora
    torch_plan = plan_run(_cpu(engine="torch").learners(lora_rank=8, lora_alpha=8.0))
    # the torch engine has no route option: it reports 'lora' itself when it has an adapter
    assert torch_plan.engine_options == {"lora": {**lora, "rank": 8, "alpha": 8.0}}
    assert torch_plan.weight_sync == "lora"
    assert plan.learner_memory.static < plan_run(_cpu()).learner_memory.static  # a frozen base, a small adapter
    with pytest.raises(RouteError, match="weight_sync: expected 'auto' or 'lora' with lora_rank=16.*Fix:"):
        plan_run(_cpu(engine_options={"weight_sync": "shm"}).learners(lora_rank=16))
    with pytest.raises(Exception, match=r"lora_rank: expected one of \(1, 8, 16.*with engine='vllm'.*got 4"):
        _cpu().learners(lora_rank=4).validate()
