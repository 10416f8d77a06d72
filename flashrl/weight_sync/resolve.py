"""Which transport new weights take to the vLLM workers, per platform (an engine option, resolved once).

The names are the registry's (``flashrl.weight_sync.registry.TRANSPORTS``); each transport is one
file of this package:

| route | where | how |
| --- | --- | --- |
| ``shm`` | CPU; the fallback everywhere | the engine's process gets bounded buckets (a Ray object ref at a time) and writes each into a shared-memory file its workers load from (``flashrl.weight_sync.shm``) |
| ``nccl`` | GPU (``auto``) | vLLM's ``NCCLWeightTransferEngine``: learner rank 0 broadcasts to every worker of every engine (across nodes and tensor-parallel ranks) in one NCCL group, packed into bounded buffers |
| ``ipc`` | GPU, learner and engine on one device | vLLM's ``IPCWeightTransferEngine``: the workers map the learner's CUDA tensors |
| ``lora`` | a LoRA learner (the run plan picks it) | the adapter's tensors only, as ``shm`` buckets (``flashrl.weight_sync.lora``) |

``nccl`` and ``ipc`` are *push* routes: the learner side drives them (``flashrl.weight_sync.push``;
a run keeps its transfer group in ``PushRoute``). An engine started with them still takes the
``shm`` pull route through ``update_weights``, so a runner restarted outside the NCCL group, or a
learner that does not push, still gets its weights.
"""

from __future__ import annotations

from typing import Literal

from flashrl.weight_sync.registry import TRANSPORTS, transport

__all__ = [
    "PUSH_ROUTES",
    "ROUTE_NAMES",
    "WEIGHT_SYNC_OPTIONS",
    "RouteName",
    "resolve_weight_sync",
    "route_environment",
    "vllm_transfer_args",
]

RouteName = Literal["shm", "nccl", "ipc", "lora"]
"""For type checkers: the registered transports' names (``ROUTE_NAMES`` is the truth)."""
ROUTE_NAMES: tuple[RouteName, ...] = tuple(TRANSPORTS)  # type: ignore[assignment]
"""What an engine's ``weight_sync`` option resolves to (its ``facts["weight_sync"]``)."""
WEIGHT_SYNC_OPTIONS = ("auto", *ROUTE_NAMES)
"""The values of the engine option ``weight_sync``."""
PUSH_ROUTES: tuple[RouteName, ...] = tuple(n for n, entry in TRANSPORTS.items() if entry.vllm_backend)  # type: ignore[assignment]
"""Routes whose data plane is one of vLLM's weight-transfer engines."""


def resolve_weight_sync(option: str, *, on_cpu: bool) -> RouteName:
    """The route of an engine option: ``auto`` is ``shm`` on CPU and ``nccl`` on GPU.

    This is what an engine started on its own does; it cannot see where the learners are. A run
    resolves ``auto`` before its engines start, from the resource layout
    (``flashrl.weight_sync.layout.plan_route``: ``ipc`` when learner and engine share a GPU), and
    checks the route against the GPUs Ray assigned (``check_route``). vLLM's weight-transfer
    engines live in its GPU worker, so ``nccl`` / ``ipc`` on CPU are a ``ValueError``.
    """
    if option not in WEIGHT_SYNC_OPTIONS:
        raise ValueError(f"weight_sync must be one of {WEIGHT_SYNC_OPTIONS}; got {option!r}.")
    if option == "auto":
        return "shm" if on_cpu else "nccl"
    if on_cpu and option in PUSH_ROUTES:
        raise ValueError(
            f"weight_sync={option!r} needs a CUDA GPU: vLLM's weight-transfer engines live in its GPU "
            "worker. Fix: weight_sync='auto' or 'shm' on CPU."
        )
    return option  # type: ignore[return-value]


def route_environment(route: str) -> dict[str, str]:
    """Environment the engine's process needs for ``route``, set before vLLM starts (``Transport.engine_environment``;
    ``ipc``: ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, ``flashrl.weight_sync.ipc``)."""
    return transport(route).engine_environment()


def vllm_transfer_args(route: RouteName) -> dict[str, object]:
    """The ``vllm.AsyncEngineArgs`` fields a route needs (``Transport.engine_args``: ``weight_transfer_config`` for push routes)."""
    return transport(route).engine_args()
