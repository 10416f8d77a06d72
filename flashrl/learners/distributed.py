"""Data-parallel plumbing for learners: process-group setup and the collectives an update needs.

Every helper is a no-op (or the identity) when ``torch.distributed`` is not initialised, so a single
learner runs the same code path as rank 0 of many.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_gradients",
    "all_reduce_max",
    "all_reduce_sum",
    "broadcast_parameters",
    "default_backend",
    "find_free_port",
    "init_process_group",
    "is_distributed",
]

GRADIENT_BUCKET_BYTES = 64 * 2**20
"""Gradients are flattened into buckets of about this size for all-reduce (fewer, larger messages)."""


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


def broadcast_parameters(module: torch.nn.Module) -> None:
    """Make every rank's parameters and buffers bitwise equal to rank 0's."""
    if not is_distributed():
        return
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=0)


def all_reduce_gradients(params: Iterable[torch.nn.Parameter], *, bucket_bytes: int = GRADIENT_BUCKET_BYTES) -> None:
    """Sum every parameter's ``.grad`` over ranks, in place, in flattened buckets.

    The sum (not the mean) is what the learner needs: each rank's loss is already normalised by the
    GLOBAL batch size, so the per-rank gradients add up to the gradient of the global loss.
    A parameter without a gradient gets a zero one first, so every rank sends the same buckets.
    """
    if not is_distributed():
        return
    grads: list[torch.Tensor] = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        if bucket and (g.dtype != bucket[0].dtype or g.device != bucket[0].device or size >= bucket_bytes):
            _all_reduce_bucket(bucket)
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel() * g.element_size()
    if bucket:
        _all_reduce_bucket(bucket)


def _all_reduce_bucket(grads: list[torch.Tensor]) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])  # [sum numel]
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


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
