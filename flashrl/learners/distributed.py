"""Data-parallel plumbing for learners: process-group setup and the small collectives an update needs.

Gradients are not reduced here: sharded learners reduce-scatter them inside FSDP2's backward
(``flashrl.learners.policies.ShardedPolicy``).

Every helper is a no-op (or the identity) when ``torch.distributed`` is not initialised, so a single
learner runs the same code path as rank 0 of many.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_max",
    "all_reduce_sum",
    "backend_devices",
    "check_collective_device",
    "default_backend",
    "find_free_port",
    "init_process_group",
    "is_distributed",
]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def default_backend(device: torch.device) -> str:
    """The process group's backends: on CUDA, NCCL for CUDA tensors AND gloo for CPU tensors.

    A CUDA learner still issues collectives on host tensors: with ``optimizer_offload`` FSDP2's
    ``CPUOffloadPolicy`` keeps the gradient shards on the host, so the clip's global norm is
    all-reduced as a CPU tensor, which an NCCL-only group refuses ("No backend type associated with
    device type cpu", pytorch/pytorch#148532). ``"cuda:nccl,cpu:gloo"`` is what Lightning and Molt
    use when offloading; flashrl always sets it on CUDA (the gloo side costs nothing unless used).
    """
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def backend_devices(backend_config: str) -> set[str]:
    """Device types a process group serves, from its backend config (``dist.get_backend_config()``):
    ``"cuda:nccl,cpu:gloo"`` -> {"cuda", "cpu"}; a bare name is the backend's own devices."""
    bare = {"gloo": {"cpu", "cuda"}, "nccl": {"cuda"}, "mpi": {"cpu", "cuda"}}
    devices: set[str] = set()
    for part in backend_config.replace(" ", "").lower().split(","):
        if ":" in part:
            devices.add(part.split(":", 1)[0])
        elif part:
            devices |= bare.get(part, set())
    return devices


def check_collective_device(tensor: torch.Tensor, backend_config: str | None = None) -> None:
    """Raise a clear error when the default group has no backend for ``tensor``'s device type.

    Every collective flashrl issues goes through this check, so a group built without a backend for
    the tensor's device fails with the fix instead of torch's bare "No backend type associated".
    """
    config = backend_config if backend_config is not None else str(dist.get_backend_config())
    if tensor.device.type not in backend_devices(config):
        raise RuntimeError(
            f"a collective on a {tensor.device.type} tensor, but the process group's backends are {config!r}. "
            f"Fix: initialise it with flashrl.learners.distributed.default_backend(device) "
            f"('cuda:nccl,cpu:gloo' on GPUs), or move the tensor to a device the group serves."
        )


def find_free_port() -> int:
    """A TCP port that was free a moment ago on this node (for the rank-0 rendezvous store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return int(sock.getsockname()[1])


def init_process_group(
    *, master_addr: str, master_port: int, rank: int, world_size: int, backend: str, timeout_s: float
) -> None:
    """Join the default process group by TCP rendezvous at ``master_addr:master_port`` (rank 0's node)."""
    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}; expected rank {rank} of {world_size}."
            )
        return
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Elementwise sum over ranks (a copy; the input is left alone)."""
    out = values.clone()
    if is_distributed():
        check_collective_device(out)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    """Elementwise max over ranks (a copy; the input is left alone)."""
    out = values.clone()
    if is_distributed():
        check_collective_device(out)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out
