"""The ``shm`` transport: buckets through the object store, pulled by every runner (CPU; the fallback everywhere).

- The learner half (``ShmSender``, ``PutBuckets``): every rank gathers the policy bucket by bucket
  (``put_buckets`` over the learner's ``WeightExtractor``) and rank 0 puts each bucket into the
  object store as soon as it is complete, so the learner holds at most one bucket beyond its model.
- The runner half (``StreamReceiver``, ``LoadWeights``): the engine resolves the refs one at a time
  while it loads. Calls coalesce: while one version loads, only the newest of those that arrive is
  loaded next, and a version not newer than the served one is ignored.
- The driver's side (``ShmRoute``): each new version is streamed to every runner.
- Inside a vLLM engine, the bucket files below.

Shared-memory files carry one weight bucket from an engine's process to its vLLM workers.
Tensors sent through vLLM's ``collective_rpc`` are serialised element by element, so each bucket
is copied into one flat file (in ``/dev/shm``: RAM) and only its layout travels by RPC; the worker
maps the file and hands zero-copy views to the model's loader. One file exists at a time (written,
loaded, unlinked), so the folder needs room for the largest bucket, not for the model. That room is
checked before an update starts (``check_transfer_space``): Docker's default ``/dev/shm`` is 64 MB.
"""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from flashrl.weight_sync.messages import LoadWeights, PutBuckets
from flashrl.weight_sync.receiver import ReceiverSlot, WeightReceiver
from flashrl.weight_sync.sender import WeightExtractor, WeightSender
from flashrl.weight_sync.transport import Learners, Runners, Transport, WeightSyncRoute
from flashrl.weight_sync.wire import DEFAULT_BUCKET_BYTES, TensorMeta, WeightBuckets, WeightEntry, WeightNames

__all__ = [
    "ALIGN",
    "ShmRoute",
    "ShmSender",
    "ShmTransport",
    "StreamReceiver",
    "TransferSpaceError",
    "bucket_file_bytes",
    "check_transfer_space",
    "default_transfer_dir",
    "put_buckets",
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


# -- the transport ----------------------------------------------------------------------------------
def put_buckets(
    weights: WeightExtractor,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    names: WeightNames = "model",
    is_sender: bool = True,
    put: Callable[[Any], Any] | None = None,
) -> WeightBuckets | None:
    """The weights as a ``WeightBuckets`` of Ray object refs, one ``put`` per bucket.

    Each bucket is put as soon as it is complete and then dropped: the learner holds at most one
    bucket beyond its model. On a sharded model every rank calls this (the gathers are collectives);
    ranks with ``is_sender=False`` put nothing and get None. ``put`` defaults to ``ray.put``.
    """
    if put is None:
        import ray

        put = ray.put
    manifest = weights.manifest(bucket_bytes, names)
    refs = []
    for bucket in weights.buckets(manifest, names, "cpu"):
        if is_sender:
            refs.append(put(bucket))
        del bucket
    return WeightBuckets(manifest, refs) if is_sender else None


class ShmSender(WeightSender):
    """A learner rank's buckets into the object store (``PutBuckets``; rank 0 puts, every rank gathers)."""

    messages = (PutBuckets,)

    def handle(self, message: PutBuckets) -> WeightBuckets | None:  # type: ignore[override]
        return put_buckets(self.weights, bucket_bytes=message.bucket_bytes, names=message.names,
                           is_sender=self.rank == 0)  # fmt: skip


class StreamReceiver(WeightReceiver):
    """A runner's streamed updates (``LoadWeights``), loaded while sampling goes on."""

    messages = (LoadWeights,)

    def __init__(self, slot: ReceiverSlot) -> None:
        super().__init__(slot)
        self._pending: tuple[int, Any] | None = None

    async def handle(self, message: LoadWeights) -> int:  # type: ignore[override]
        """Load new weights; returns the version now served (-1 once closed).

        The engine resolves a stream's refs one at a time while it loads, so the runner holds one
        bucket beyond its model, and a version that is superseded before it loads is never fetched.
        """
        slot = self.slot
        # An object ref of a full state dict is resolved first, as Ray resolves one passed as a
        # top-level argument (a nested one would reach the engine unresolved).
        weights = await message.weights if inspect.isawaitable(message.weights) else message.weights
        if slot.closed:
            return -1
        await slot.ready()
        self._pending = (int(message.version), weights)
        async with slot.lock:
            engine = slot.engine()
            if self._pending is not None and engine is not None:
                version, weights = self._pending
                self._pending = None
                if version > engine.version:
                    await engine.update_weights(weights, version)
        engine = slot.engine()
        return -1 if engine is None else int(engine.version)


class ShmRoute(WeightSyncRoute):
    """Buckets through the object store, pulled by every runner (``shm``).

    Args:
        wait_for_load: return only once every runner has loaded the weights (``sync_group``);
            False (async) returns at once and the runners load while they keep sampling.
        bucket_bytes: bucket size of the learner's ``PutBuckets``.
        weight_names: ``model`` or ``checkpoint``: the names the runners' engines load.
    """

    name = "shm"

    def __init__(
        self, *, wait_for_load: bool, bucket_bytes: int = DEFAULT_BUCKET_BYTES, weight_names: str = "model"
    ) -> None:
        super().__init__(bucket_bytes=bucket_bytes, weight_names=weight_names)
        self.wait_for_load = wait_for_load

    def push(self, learners: Learners, runners: Runners) -> float:
        """The runners' broadcast time (the learner's puts happen before it and are not counted)."""
        return runners.broadcast_weights(learners.version, self.stream(learners), wait=self.wait_for_load)


class ShmTransport(Transport):
    """``shm``: the only transport with CPU learners or CPU engines, and every engine's fallback."""

    name: ClassVar[str] = "shm"
    sender = ShmSender
    receiver = StreamReceiver

    def route(self, facts: Mapping[str, Any], *, wait_for_load: bool, bucket_bytes: int) -> ShmRoute:
        names = str(facts.get("weight_names", "model"))
        return ShmRoute(wait_for_load=wait_for_load, bucket_bytes=bucket_bytes, weight_names=names)
