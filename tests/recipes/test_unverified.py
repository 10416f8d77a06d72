"""The dry-run names the parts of a GPU plan that flashrl has not yet run on a GPU, and nothing for a CPU run."""

from __future__ import annotations

import contextlib
import io

from flashrl.plan import plan_run
from flashrl.recipes.run import build_config
from flashrl.recipes.unverified import not_yet_run_on_gpu
from flashrl.reproduction.experiment_run import (
    add_experiment_arguments,
    config_factory,
    experiment_preset,
    run_experiment,
)


def _experiment(name: str, argv: list[str] | None = None):
    return build_config(experiment_preset(name), config_factory(name), argv or [],
                        add_arguments=lambda parser: add_experiment_arguments(parser, name))[0]


def test_the_moe_experiment_lists_its_tensor_parallel_engine_push_and_expert_updates():
    config = _experiment("qwen3_tool_ablation")
    parts = not_yet_run_on_gpu(config, plan_run(config, raise_problems=False))
    assert parts == [
        "vLLM's GPU build in an EnvRunner actor: engine start, sampling, recorded log-probs",
        "a multi-GPU engine (tensor/pipeline parallel) on vLLM's multiprocessing executor inside the EnvRunner actor",
        "the weight push over vLLM's nccl transfer engine",
        ("in-place weight updates of a mixture of experts in vLLM's GPU build (checked against a fresh engine on "
         "the CPU build only)"),
        "the learner as FSDP2 over NCCL across 8 ranks (one rank has run)",
        "a mixture-of-experts learner on CUDA (a dense model's learner has run)",
    ]


def test_a_colocated_layout_lists_sleep_mode_and_the_ipc_push():
    config = _experiment("qwen_math").env_runners(num_gpus_per_env_runner=0.5).learners(
        num_learners=1, num_gpus_per_learner=0.5)
    parts = not_yet_run_on_gpu(config, plan_run(config, raise_problems=False))
    assert "vLLM's sleep mode around the learner's update (colocated learner and engine)" in parts
    assert "the weight push over vLLM's ipc transfer engine" in parts
    # one learner on one GPU has run (benchmarks/results/gpu_check_h200.json): the push is the last part
    assert parts[-1] == "the weight push over vLLM's ipc transfer engine"


def test_a_cpu_run_has_nothing_unverified_and_no_section():
    from flashrl.algorithms import FlashReinforceConfig

    config = (FlashReinforceConfig().environment("flashrl/Math-v0").training(model="smollm2-135m-instruct")
              .env_runners(num_gpus_per_env_runner=0).learners(num_gpus_per_learner=0))
    assert not_yet_run_on_gpu(config, plan_run(config)) == []


def test_the_dry_run_prints_the_section():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_experiment("qwen3_tool_ablation", ["--dry-run"])
    text = out.getvalue()
    assert "-- not yet run on a GPU (tested on CPU only; this run would be the first) --" in text
    assert "  in-place weight updates of a mixture of experts" in text
