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
    "default_backend",
    "find_free_port",
    "init_process_group",
    "is_distributed",
]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def default_backend(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


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
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    """Elementwise max over ranks (a copy; the input is left alone)."""
    out = values.clone()
    if is_distributed():
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out
