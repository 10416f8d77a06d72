"""What a planned run would do that flashrl has not yet run on a GPU: the dry-run says so.

flashrl's tests and measured runs are on CPU (vLLM's CPU build, gloo, the shared-memory weight route).
A GPU plan goes through code that is written against vLLM's and torch's GPU paths and tested on CPU
with test doubles, but has not run there. The dry-run's "not yet run on a GPU" section names each such
part this config uses, so a first GPU run knows what it is the first to exercise (docs/training.md,
"Dry run"). Update the list when a part has run on a GPU and its record is committed.
"""

from __future__ import annotations

from typing import Any

from flashrl.plan import RunPlan

__all__ = ["not_yet_run_on_gpu"]


def not_yet_run_on_gpu(config: Any, run_plan: RunPlan) -> list[str]:
    """The parts of this config's run (planned as ``run_plan``) that have not run on a GPU yet; [] for a CPU run.

    A sleep mode or route the plan refuses counts as off and ``shm`` (the plan reports the error itself).
    """
    runner_gpus, learner_gpus = config.num_gpus_per_env_runner, config.num_gpus_per_learner
    arch = run_plan.architecture
    if runner_gpus <= 0 and learner_gpus <= 0:
        return []
    parts = []
    if config.engine == "vllm" and runner_gpus > 0:
        parts.append("vLLM's GPU build in an EnvRunner actor: engine start, sampling, recorded log-probs")
        args = dict(config.engine_options.get("engine_args", {}))
        if int(args.get("tensor_parallel_size") or 1) * int(args.get("pipeline_parallel_size") or 1) > 1:
            parts.append("a multi-GPU engine (tensor/pipeline parallel) on vLLM's multiprocessing executor "
                         "inside the EnvRunner actor")
        if run_plan.sleep_mode:
            parts.append("vLLM's sleep mode around the learner's update (colocated learner and engine)")
    if run_plan.weight_sync in ("nccl", "ipc"):
        parts.append(f"the weight push over vLLM's {run_plan.weight_sync} transfer engine")
    if arch is not None and arch.num_experts > 0 and config.engine == "vllm" and runner_gpus > 0:
        parts.append("in-place weight updates of a mixture of experts in vLLM's GPU build (checked against a "
                     "fresh engine on the CPU build only)")
    if config.routing_replay:
        parts.append("routing replay: vLLM's routed experts returned on a GPU")
    if learner_gpus > 0:
        # One learner on one GPU has run: scripts/gpu_check.py's learner and fsdp phases on an H200 (a
        # dense Qwen2.5-1.5B shape in bfloat16, FSDP2 on a one-rank NCCL group;
        # benchmarks/results/gpu_check_h200.json). Several ranks and a mixture of experts have not.
        if config.num_learners >= 2:
            parts.append(f"the learner as FSDP2 over NCCL across {config.num_learners} ranks (one rank has run)")
        if arch is not None and arch.num_experts > 0:
            parts.append("a mixture-of-experts learner on CUDA (a dense model's learner has run)")
        if config.optimizer_offload:
            parts.append("optimizer offload (FSDP2's CPUOffloadPolicy) with the gloo side of the process group")
    return parts
