"""Shared-memory files that carry one weight bucket from an engine's process to its vLLM workers.

Tensors sent through vLLM's ``collective_rpc`` are serialised element by element, so each bucket
is copied into one flat file (in ``/dev/shm``: RAM) and only its layout travels by RPC; the worker
maps the file and hands zero-copy views to the model's loader. One file exists at a time (written,
loaded, unlinked), so the folder needs room for the largest bucket, not for the model. That room is
checked before an update starts (``check_transfer_space``): Docker's default ``/dev/shm`` is 64 MB.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from flashrl.weight_sync.wire import TensorMeta, WeightEntry

__all__ = [
    "ALIGN",
    "TransferSpaceError",
    "bucket_file_bytes",
    "check_transfer_space",
    "default_transfer_dir",
    "write_bucket_file",
]

ALIGN = 64
"""Byte alignment of each tensor in a bucket file (any dtype view of it stays legal)."""


class TransferSpaceError(RuntimeError):
    """The weight-transfer folder has no room for one bucket."""


def default_transfer_dir(option: str | None) -> str:
    """``option``, else ``/dev/shm`` (RAM) where it exists, else the system's temp folder."""
    if option:
        return option
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def bucket_file_bytes(declared: Sequence[TensorMeta]) -> int:
    """Size of the file that carries one bucket (every tensor starts on an ``ALIGN`` boundary)."""
    return max(sum(-(-m.nbytes // ALIGN) * ALIGN for m in declared), 1)


def check_transfer_space(
    folder: str,
    need_bytes: int,
    *,
    disk_usage: Callable[[str], Any] | None = None,
) -> None:
    """Raise ``TransferSpaceError`` unless ``folder`` has ``need_bytes`` free (before anything moves).

    ``disk_usage`` defaults to ``shutil.disk_usage`` (looked up at the call: tests replace it).
    """
    if not os.path.isdir(folder):
        raise TransferSpaceError(
            f"weight_transfer_dir {folder!r} does not exist. Fix: create it or pass another "
            "weight_transfer_dir (a RAM-backed folder such as /dev/shm is fastest)."
        )
    free = int((disk_usage or shutil.disk_usage)(folder).free)
    if free < need_bytes:
        raise TransferSpaceError(
            f"a weight update needs {need_bytes:,} bytes ({need_bytes / 2**20:.1f} MiB, the largest "
            f"weight bucket) free in {folder!r}, which has {free:,} bytes ({free / 2**20:.1f} MiB) "
            "available. Fix: a smaller weight bucket (the learner's bucket_bytes / the engine's "
            "weight_bucket_bytes), a bigger shared memory (Docker: --shm-size=8g; Ray: its object "
            "store shares /dev/shm), or weight_transfer_dir pointing at a folder with room."
        )


def write_bucket_file(
    folder: str, bucket: Mapping[str, torch.Tensor], declared: Sequence[TensorMeta]
) -> tuple[str, int, list[WeightEntry]]:
    """Copy a bucket's tensors into one new flat file in ``folder``; return its path, size, layout."""
    entries: list[WeightEntry] = []
    offset = 0
    for meta in declared:
        entries.append((meta.name, meta.dtype, list(meta.shape), offset, meta.nbytes))
        offset += -(-meta.nbytes // ALIGN) * ALIGN
    total = max(offset, 1)
    fd, path = tempfile.mkstemp(prefix="flashrl-weights-", suffix=".bin", dir=folder)
    try:
        os.ftruncate(fd, total)
    finally:
        os.close(fd)
    try:
        buffer = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)  # [total]
        with torch.no_grad():
            for name, _, shape, start, nbytes in entries:
                tensor = bucket[name]
                buffer[start : start + nbytes].view(tensor.dtype).view(shape).copy_(tensor.detach())
        del buffer
    except BaseException:
        os.unlink(path)
        raise
    return path, total, entries
