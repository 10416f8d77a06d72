"""Which route new weights take to the vLLM workers, per platform (an engine option, resolved once).

| route | where | how |
| --- | --- | --- |
| ``shm`` | CPU; the fallback everywhere | the engine's process gets bounded buckets (a Ray object ref at a time) and writes each into a shared-memory file its workers load from (``flashrl.weight_sync.shm``) |
| ``nccl`` | GPU (``auto``) | vLLM's ``NCCLWeightTransferEngine``: learner rank 0 broadcasts to every worker of every engine (across nodes and tensor-parallel ranks) in one NCCL group, packed into bounded buffers |
| ``ipc`` | GPU, learner and engine on one device | vLLM's ``IPCWeightTransferEngine``: the workers map the learner's CUDA tensors |

``nccl`` and ``ipc`` are *push* routes: the learner side drives them
(``flashrl.learners.weight_sender.start_push_transfer``; a run keeps its transfer group in
``flashrl.weight_sync.route.PushRoute``). An engine started with them still takes the ``shm`` pull
route through ``update_weights``, so a runner restarted outside the NCCL group, or a learner that
does not push, still gets its weights.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "PUSH_ROUTES",
    "ROUTE_NAMES",
    "WEIGHT_SYNC_OPTIONS",
    "RouteName",
    "resolve_weight_sync",
    "route_environment",
    "vllm_transfer_args",
]

RouteName = Literal["shm", "nccl", "ipc"]
ROUTE_NAMES: tuple[RouteName, ...] = ("shm", "nccl", "ipc")
"""What an engine's ``weight_sync`` option resolves to (its ``facts["weight_sync"]``)."""
WEIGHT_SYNC_OPTIONS = ("auto", *ROUTE_NAMES)
"""The values of the engine option ``weight_sync``."""
PUSH_ROUTES: tuple[RouteName, ...] = ("nccl", "ipc")
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


INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"
"""vLLM's setting (``vllm/envs.py``) that lets its msgpack encoder fall back to pickle."""


def route_environment(route: str) -> dict[str, str]:
    """Environment the engine's process needs for ``route``, set before vLLM starts.

    ``ipc``: ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``. Each update carries CUDA IPC handles
    (``torch.multiprocessing.reductions.reduce_tensor``'s arguments: the tensor and storage
    classes, a ``torch.dtype``), which vLLM's msgpack encoder refuses without it
    (``vllm/v1/serial_utils.py``, ``MsgpackEncoder.enc_hook``): the first push would fail and leave
    the engine broken. With it they are pickled over the engine's local process sockets; vLLM's own
    example (``examples/rl/rlhf_ipc.py``) and Molt 0.2.1 (``molt/trainer/vllm/vllm_engine.py``,
    ``_configure_vllm_env``) set the same. ``nccl`` and ``shm`` send only names, dtype names and
    shapes, and need nothing.
    """
    return {INSECURE_SERIALIZATION: "1"} if route == "ipc" else {}


def vllm_transfer_args(route: RouteName) -> dict[str, object]:
    """The ``vllm.AsyncEngineArgs`` fields a route needs (``weight_transfer_config`` for push routes)."""
    if route in PUSH_ROUTES:
        return {"weight_transfer_config": {"backend": route}}
    return {}
