"""The dry-run's engine budget is what vLLM reserves: a share of the whole device, not of Ray's fraction.

An 80 GiB GPU shared by one learner and one engine (0.5 + 0.5, the ``ipc`` route) with
Qwen2.5-Math-1.5B in bfloat16 under AdamW: the learner's planned peak is 34.38 GiB, its static state
(weights, gradients, float32 master, optimizer) 28.75 GiB (``flashrl.plan.memory``); the engine's
share is budgeted against the peak, sleep mode or not (``flashrl.engines.colocation``). vLLM reserves
``gpu_memory_utilization x 80 GiB`` at start whatever the fraction (0.85: 68 GiB, where the plan
used to budget 0.85 x 80 x 0.5 = 34 GiB).
"""

from __future__ import annotations

import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.recipes.plan import dry_run_report
from flashrl.recipes.preset import NodePlan, Preset

NODES = NodePlan(gpus_per_node=1, cpus_per_node=8, gpu_memory_gib=80.0, host_memory_gib=64.0)
PRESET = Preset(name="colocated", description="one shared GPU", success_metric="reward", success_threshold=1.0,
                stop_iters=1, node_plan=NODES)  # fmt: skip


def _report(monkeypatch: pytest.MonkeyPatch, nodes: NodePlan = NODES, *, learner_gpus: float = 0.5,
            runner_gpus: float = 0.5, micro_batch: int | None = 1024, **engine: object):  # fmt: skip
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the model check must not reach the network
    env_runners = {"max_episode_tokens": 1024, "max_new_tokens": 512, "engine_options": {}, **engine}
    config = (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0")
        .training(model="Qwen/Qwen2.5-Math-1.5B", dtype="bfloat16", train_batch_size=8)
        .learners(num_learners=1, num_gpus_per_learner=learner_gpus, max_tokens_per_micro_batch=micro_batch)
        .env_runners(num_env_runners=1, num_gpus_per_env_runner=runner_gpus, **env_runners)
    )
    config.validate()
    report = dry_run_report(PRESET, config, nodes)
    memory = dict(report.sections)["memory estimate"]
    return report, "\n".join(memory)


def test_the_engine_budget_is_a_share_of_the_whole_device(monkeypatch: pytest.MonkeyPatch) -> None:
    report, out = _report(monkeypatch, engine_options={"gpu_memory_utilization": 0.85})
    assert "total 34.38 GiB" in out  # the learner's planned peak
    assert "per GPU (split over 1): 3.31 GiB of 68.00 GiB" in out  # not 0.85 x 80 x 0.5 = 34 GiB
    assert "gpu_memory_utilization 0.85 (set) x the whole 80.00 GiB device = 68.00 GiB" in out
    # sleep mode (on by default here): the engine wakes next to what the learner holds, up to its peak
    assert "shared GPU: learner 34.38 GiB (its peak; the engine wakes from sleep mode next to" in out
    # 34.38 + 68 > 80: refused, naming the layout and the wake, with the share that fits:
    # floor(100 x (80 - 34.38) / 80) - 5 = 52 %
    assert report.exit_code() == 1
    (error,) = [e for e in report.errors if "colocated" in e]
    assert error.startswith("colocated layout num_gpus_per_learner=0.5 + num_gpus_per_env_runner=0.5 on one "
                            "80.00 GiB GPU: the engine's wake from sleep mode does not fit")  # fmt: skip
    assert "got 34.38 GiB + 68.00 GiB" in error
    assert "Fix: engine_options={'gpu_memory_utilization': 0.52}" in error
    assert "num_gpus_per_learner=1, num_gpus_per_env_runner=1" in error


def test_the_static_state_share_is_refused_sleep_mode_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    # 0.59 is what the learner's static state (28.75 GiB) used to leave with sleep mode: 34.38 + 47.2 > 80
    for sleep in (None, False):
        report, out = _report(monkeypatch, engine_options={"gpu_memory_utilization": 0.59}, engine_sleep_mode=sleep)
        (error,) = [e for e in report.errors if "colocated" in e]
        assert "got 34.38 GiB + 47.20 GiB" in error
        assert error.endswith(
            "Fix: engine_options={'gpu_memory_utilization': 0.52}; or the learner on a GPU of its own "
            "(num_gpus_per_learner=1, num_gpus_per_env_runner=1)"
        )
    assert "shared GPU: learner 34.38 GiB (its peak; sleep mode off) + engine 47.20 GiB of 80.00 GiB" in out
    assert "the engine's start does not fit" in error


def test_the_default_share_is_derived_and_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    for sleep in (None, False):  # the same share either way: the learner's peak
        report, out = _report(monkeypatch, engine_sleep_mode=sleep)
        assert "gpu_memory_utilization 0.52 (derived from the learner's estimate) x the whole 80.00 GiB device = " \
               "41.60 GiB" in out  # fmt: skip
        assert "+ engine 41.60 GiB of 80.00 GiB" in out
        assert not [e for e in report.errors if "colocated" in e]


def test_a_whole_gpu_engine_keeps_085(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = NodePlan(gpus_per_node=2, cpus_per_node=8, gpu_memory_gib=80.0, host_memory_gib=64.0)
    report, out = _report(monkeypatch, nodes, learner_gpus=1, runner_gpus=1)
    assert "gpu_memory_utilization 0.85 (default) x the whole 80.00 GiB device = 68.00 GiB" in out
    assert "shared GPU" not in out and not [e for e in report.errors if "colocated" in e]


def test_a_learner_whose_update_exceeds_the_device_gets_the_learners_fixes(monkeypatch: pytest.MonkeyPatch) -> None:
    report, _ = _report(monkeypatch, micro_batch=None, max_episode_tokens=8192, max_new_tokens=512)
    (error,) = [e for e in report.errors if "colocated" in e]
    assert error.startswith("colocated learner: its update's peak ")
    assert "exceeds the whole 80.00 GiB GPU even with the engine asleep. Fix: set max_tokens_per_micro_batch" in error
    assert "gpu_memory_utilization" not in error  # no share of the engine's makes room for it


def test_a_colocated_learner_is_measured_against_the_whole_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ray's 0.5 divides no memory: the learner's 34.38 GiB peak is not "above its 40 GiB share" nor
    # below it; the pair is checked against the 80 GiB device (the engine's lines)
    _, out = _report(monkeypatch)
    assert "learner on its GPU: 34.38 GiB of 80.00 GiB, shared with an engine (below)" in out


def test_engine_options_that_refuse_the_runs_routing_replay_are_an_error_of_the_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the runners would refuse to start their engines; the plan the dry-run renders says so first
    report, _ = _report(monkeypatch, learner_gpus=1, runner_gpus=1, engine_options={"record_routed_experts": False})
    assert not [e for e in report.errors if e.startswith("engine options:")]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = report.config.copy().training(routing_replay=True)
    errors = dry_run_report(PRESET, config, NODES).errors
    assert [e for e in errors if e.startswith("engine options: engine_options sets record_routed_experts=False")]
