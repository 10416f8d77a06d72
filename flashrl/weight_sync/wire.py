"""What crosses between the learners and the engines, defined once: the manifest, the bucket stream,
a tensor's place in a bucket file, and the constants both sides agree on.

The ground floor of weight sync: this module imports nothing of flashrl and no torch at import time,
so every layer may import it (the engines' vLLM workers, the learners, the env runners, the memory
plan of ``flashrl.recipes``). What works on these types lives above it: ``buckets`` (cutting and
checking a stream), the interfaces (``transport``, ``sender``, ``receiver``) and one file per
transport (``shm``, ``nccl``, ``ipc``; ``push`` and ``vllm_push`` shared by the last two).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "LEASE_FACTOR",
    "TRANSFER_DEADLINE_S",
    "VLLM_PACKED_BUFFER_BYTES",
    "WEIGHT_NAMES",
    "TensorMeta",
    "WeightBuckets",
    "WeightEntry",
    "WeightManifest",
    "WeightNames",
]

DEFAULT_BUCKET_BYTES = 512 * 2**20
"""512 MiB: a few layers of a 7B model, one layer of a 30B MoE; small next to either."""
TRANSFER_DEADLINE_S = 600.0
"""Seconds one pushed transfer (and each call to the runners within it) may take; flashrl's choice:
a 30B model's 61 GB cross a 100 Gb/s link in about 5 s, so 600 s only ever ends a hung transfer."""
LEASE_FACTOR = 2.0
"""A runner's pause for a transfer lasts at most this many deadlines: a live learner always ends or
aborts it first, a dead one cannot keep it paused."""
VLLM_PACKED_BUFFER_BYTES = 1024**3
"""vLLM 0.32's packed buffer size (``DEFAULT_PACKED_BUFFER_SIZE_BYTES``,
``vllm/distributed/weight_transfer/packed_tensor.py``): 1 GiB."""

WeightNames = Literal["model", "checkpoint"]
WEIGHT_NAMES: tuple[WeightNames, ...] = ("model", "checkpoint")
"""How a stream names its tensors: the learner's state dict, or the model's checkpoint files."""


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype and shape of one tensor of the stream (known before any data moves)."""

    name: str
    dtype: str
    """``torch`` dtype name without the prefix (``float32``, ``bfloat16``)."""
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        import torch

        numel = 1
        for size in self.shape:
            numel *= int(size)
        return numel * getattr(torch, self.dtype).itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(name, str(tensor.dtype).removeprefix("torch."), tuple(int(s) for s in tensor.shape))


WeightManifest = tuple[tuple[TensorMeta, ...], ...]
"""What a weight stream will carry, declared before any data moves: entry ``k`` lists the tensors of
bucket ``k``, in order."""


@dataclass(frozen=True)
class WeightBuckets:
    """A full set of weights as a stream of buckets, with its manifest declared up front.

    ``manifest[k]`` lists the tensors of bucket ``k``; ``buckets`` yields bucket ``k`` as a
    ``{name: tensor}`` dict (or an awaitable of one, e.g. a Ray ``ObjectRef``: an EnvRunner
    resolves those one at a time). A consumer checks the manifest against its model before loading
    anything and each bucket against its manifest entry as it arrives.

    ``buckets`` may be a sequence (re-iterable: a list of object refs) or a one-shot iterator /
    async iterator (a generator gathering from the learner). A one-shot stream can be loaded once.
    """

    manifest: WeightManifest
    buckets: Iterable[Any] | AsyncIterable[Any]
    """Items are ``flashrl.weight_sync.buckets.BucketItem``: a bucket, or an awaitable of one."""

    @property
    def metas(self) -> list[TensorMeta]:
        return [m for bucket in self.manifest for m in bucket]

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.metas)


WeightEntry = tuple[str, str, list[int], int, int]
"""``(name, dtype name, shape, byte offset, byte count)`` of one tensor in a bucket file: what the
engine's process sends its vLLM workers (``flashrl.weight_sync.shm.write_bucket_file`` writes the
file, ``flashrl.engines.vllm_worker`` maps it)."""
