"""A vLLM engine that shares its GPU with a learner (the colocated layout): its memory share and sleep mode.

Ray's GPU fractions (``num_gpus_per_learner=0.5``, ``num_gpus_per_env_runner=0.5``) only schedule:
nothing divides the device's memory. vLLM 0.32 reserves ``ceil(total_memory *
gpu_memory_utilization)`` bytes of the **whole device** and refuses to start when less is free
(``vllm/v1/worker/utils.py``, ``request_memory``, called by ``Worker.init_device`` in
``vllm/v1/worker/gpu_worker.py``: "Free memory on device ... is less than desired GPU memory
utilization"); ``Worker.determine_available_memory`` then gives the KV cache that reservation minus
the weights and the profiled activations. The learner on the same device gets what is left. So a
colocated engine's ``gpu_memory_utilization`` is derived from the learner's planned peak::

    share = (floor(100 x (device - learner) / device) - COLOCATED_MARGIN_PERCENT) / 100

where ``learner`` is the planner's estimate (``flashrl.plan.memory.learner_memory``) of the learner's
peak, ``total`` (the update, or the weight push after it, whichever holds more), with or without
sleep mode. Sleep mode does not lower it: the engine wakes while the learner pushes, and on waking
vLLM's sleep allocator (``vllm/device_allocator/cumem.py``) maps fresh physical memory for the KV
cache, next to whatever the learner's process then holds: its weights, master copy and optimizer,
the push's buffers (vLLM's IPC buffer of at least 1 GiB among them), and whatever its caching
allocator kept of the update. Before the push the driver has the learners free what they cached
for the update (``Learner.release_memory``: ``torch.cuda.empty_cache()``), so what stays is below
the peak; the peak is the bound that holds whatever the allocator could not give back. When the
model's architecture is unknown, the share is Ray's fraction ``num_gpus_per_env_runner``. A
whole-GPU engine keeps ``DEFAULT_GPU_MEMORY_UTILIZATION``.

Sleep mode (vLLM's ``enable_sleep_mode``; what verl's hybrid engine does): the runner pauses
generation and puts the engine to sleep at level 1 (weights copied to host memory, KV cache
discarded) while its learner updates, and wakes it for the new weights. vLLM 0.32's CPU build has no
sleep mode (``Platform.is_sleep_mode_available``: CUDA, ROCm and XPU; ``ModelConfig`` raises "Sleep
mode is not supported on current platform."), so it is refused on CPU here, before vLLM starts.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "COLOCATED_MARGIN_PERCENT",
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "SLEEP_ON_CPU_ERROR",
    "colocated_engine_options",
    "colocated_memory_utilization",
    "is_colocated",
    "resolve_sleep_mode",
]

DEFAULT_GPU_MEMORY_UTILIZATION = 0.85
"""vLLM's share of a GPU of its own."""
COLOCATED_MARGIN_PERCENT = 5
"""Percent of the device left to neither side on a shared GPU: a second process's CUDA context (about
0.5 GiB), the caching allocators' fragmentation, and what a sleeping engine keeps. A judgment, not
a measurement."""

SLEEP_ON_CPU_ERROR = (
    "engine_sleep_mode=True: vLLM 0.32's CPU build has no sleep mode (vllm.platforms: "
    "is_sleep_mode_available is CUDA, ROCm and XPU only). Fix: engine_sleep_mode=None or False on CPU."
)


def is_colocated(learner_gpus: float, runner_gpus: float) -> bool:
    """Whether a learner and an engine may share one GPU: both ask for fractions that fit on one together.

    The layout ``flashrl.weight_sync.layout.plan_route`` resolves ``weight_sync='auto'`` to ``ipc`` for.
    """
    return 0 < learner_gpus < 1 and 0 < runner_gpus < 1 and learner_gpus + runner_gpus <= 1 + 1e-9


def colocated_memory_utilization(device_bytes: int, *, learner_bytes: int | None, runner_gpus: float) -> float:
    """The ``gpu_memory_utilization`` of an engine next to a learner on a device of ``device_bytes``.

    Args:
        device_bytes: the GPU's total memory (vLLM's ``total_memory``).
        learner_bytes: the learner's peak on it (None: not known; then Ray's fraction ``runner_gpus``
            is the share).
        runner_gpus: ``num_gpus_per_env_runner``.

    Raises:
        ValueError: the learner leaves the engine no memory (under 1% of the device).
    """
    if learner_bytes is None:
        return min(float(runner_gpus), DEFAULT_GPU_MEMORY_UTILIZATION)
    percent = 100 * (int(device_bytes) - int(learner_bytes)) // int(device_bytes) - COLOCATED_MARGIN_PERCENT
    if percent < 1:
        raise ValueError(
            f"colocated layout: expected the learner to leave the engine part of the GPU, got a learner peak of "
            f"{learner_bytes / 2**30:.2f} GiB on a {device_bytes / 2**30:.2f} GiB device (and a "
            f"{COLOCATED_MARGIN_PERCENT}% margin). Fix: a smaller learner (max_tokens_per_micro_batch, "
            "gradient checkpointing), or the learner on a GPU of its own (num_gpus_per_learner=1, "
            "num_gpus_per_env_runner=1)."
        )
    return min(percent / 100, DEFAULT_GPU_MEMORY_UTILIZATION)


def resolve_sleep_mode(setting: bool | None, *, engine: str, learner_gpus: float, runner_gpus: float) -> bool:
    """``engine_sleep_mode``: None is on for a vLLM engine colocated with its learner on a GPU.

    Raises:
        ValueError: True for an engine on the CPU (vLLM's CPU build has no sleep mode) or a torch engine.
    """
    if setting is None:
        return engine == "vllm" and is_colocated(learner_gpus, runner_gpus)
    if setting and (engine != "vllm" or runner_gpus <= 0):
        raise ValueError(
            SLEEP_ON_CPU_ERROR if engine == "vllm" else
            f"engine_sleep_mode=True: only the vLLM engine sleeps, got engine={engine!r}. Fix: engine_sleep_mode=None."
        )
    return bool(setting)


def colocated_engine_options(
    engine_options: dict[str, Any],
    *,
    engine: str,
    learner_gpus: float,
    runner_gpus: float,
    sleep_mode: bool,
    learner_memory: Any = None,
) -> dict[str, Any]:
    """The engine options a runner starts with in a colocated layout (others: ``engine_options`` as given).

    Adds ``sleep_mode`` and, unless ``gpu_memory_utilization`` is set, what the engine derives its share
    from at start (it reads its device's memory then): ``colocated_learner_bytes`` (the learner's
    planned peak, ``learner_memory.total`` of a ``LearnerMemory``, with or without sleep mode: see the
    module docstring; absent when None) and ``colocated_gpu_fraction`` (Ray's fraction, the share
    without an estimate).
    """
    out = dict(engine_options)
    if engine != "vllm":
        return out
    if sleep_mode:
        out["sleep_mode"] = True
    if not is_colocated(learner_gpus, runner_gpus) or out.get("gpu_memory_utilization") is not None:
        return out
    out["colocated_gpu_fraction"] = float(runner_gpus)
    if learner_memory is not None:
        out["colocated_learner_bytes"] = int(learner_memory.total)
    return out
