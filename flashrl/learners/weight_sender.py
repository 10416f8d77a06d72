"""A learner rank's side of weight sync: its weights out to the env runners, on every route.

``WeightSender`` is the one object a ``Learner`` holds for weight sync; the ``Learner`` methods
``weight_buckets``, ``start_weight_push``, ``push_weights`` and ``stop_weight_push`` hand over to it.

- ``shm`` (pulled): ``buckets`` gathers the policy bucket by bucket into the object store
  (``flashrl.learners.weight_gather.put_weight_buckets``); the runners fetch the refs.
- ``nccl`` / ``ipc`` (pushed): ``start_push`` forms the transfer group (``start_push_transfer``:
  vLLM's trainer engine over a source that gathers bucket by bucket, after every engine checked the
  plan), ``push`` sends the current version within a deadline, ``stop_push`` tears the group down.
  A send that fails or runs out of time tears it down on both sides (the learner's communicator,
  every runner's engine) and raises; the next ``start_push`` forms it again.

The gathering (FSDP, transformers' checkpoint names) is the learners' own
(``flashrl.learners.weight_gather``); the protocol it speaks (``EnvRunnerSyncClient``, deadlines,
vLLM's init info) and the wire types are ``flashrl.weight_sync``'s. The route is chosen by the
driver (``flashrl.weight_sync.route.route_for``), never here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from flashrl.learners.weight_gather import iter_weight_buckets, put_weight_buckets, weight_manifest
from flashrl.weight_sync.vllm_push import (
    EnvRunnerSyncClient,
    ipc_buffer_bytes,
    plan_of,
    push_init_info,
    send_with_deadline,
)
from flashrl.weight_sync.wire import DEFAULT_BUCKET_BYTES, TRANSFER_DEADLINE_S, WeightBuckets, WeightManifest

__all__ = ["WeightSender", "bucket_weight_source", "start_push_transfer"]

logger = logging.getLogger(__name__)


class WeightSender:
    """One learner rank's weights, sent: as object-store buckets, or through a push route's group.

    Args:
        model: the module whose weights the engines receive, asked for at each send (the policy's
            ``sync_model``: float32 masters of a bfloat16 learner syncing at float32).
        rank: this learner's rank; rank 0 puts the buckets and drives the runners.
        dtype: the dtype the engines receive (``LearnerSpec.sync_torch_dtype``).
        device: where a push gathers each tensor (the learner's device).
        version: the learner's current version (stamped on every pushed transfer).
    """

    def __init__(
        self,
        model: Callable[[], nn.Module],
        *,
        rank: int,
        dtype: torch.dtype | None,
        device: torch.device | str,
        version: Callable[[], int],
    ) -> None:
        self._model = model
        self.rank = rank
        self.dtype = dtype
        self.device = device
        self.version = version
        self._push: Any = None
        """vLLM's trainer weight-transfer engine while a push route is set up (``start_push``)."""
        self._client: EnvRunnerSyncClient | None = None
        """The runners' side of that transfer group."""
        self._deadline_s = TRANSFER_DEADLINE_S

    def buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, names: str = "model") -> WeightBuckets | None:
        """The weights as object refs, one ``ray.put`` per bucket (rank 0; None on other ranks).

        At most one bucket is held beyond the model; sharded, every rank calls this (the gathers are
        collectives). ``names``: ``model`` or ``checkpoint`` (``flashrl.learners.weight_gather``).
        """
        return put_weight_buckets(
            self._model(),
            bucket_bytes=bucket_bytes,
            dtype=self.dtype,
            is_sender=self.rank == 0,
            names=names,  # type: ignore[arg-type]
        )

    def start_push(
        self,
        route: str,
        runners: Sequence[Any],
        workers_per_runner: Sequence[int],
        *,
        master_address: str | None = None,
        master_port: int | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        deadline_s: float = TRANSFER_DEADLINE_S,
    ) -> None:
        """Form the transfer group with the runners' engines (every rank; replaces an earlier group).

        Rank 0 is the sender: it has every engine check the names and shapes it will send, then
        drives the runners through ``EnvRunnerSyncClient`` and, for ``nccl``, opens the NCCL group
        (learner rank 0 + every worker of every engine) at ``master_address``:``master_port``. The
        other ranks only join the FSDP gathers of each ``push``. ``deadline_s`` bounds every
        transfer (``flashrl.weight_sync.vllm_push``); a group that fails to form is torn down on
        both sides.
        """
        self.stop_push()
        client = EnvRunnerSyncClient(runners, workers_per_runner, version=self.version, timeout_s=deadline_s)
        self._client, self._deadline_s = client, float(deadline_s)
        try:
            self._push = start_push_transfer(
                route,
                self._model(),
                client,
                rank=self.rank,
                bucket_bytes=bucket_bytes,
                dtype=self.dtype,
                device=self.device,
                master_address=master_address,
                master_port=master_port,
            )
        except BaseException as err:
            self._abort(f"forming the transfer group failed ({err!r})")
            raise

    def push(self) -> int:
        """Send the current weights through the push route (every rank); returns the version sent.

        The send has a deadline; a send that fails or runs out of time tears the group down on both
        sides (the learner's communicator, every runner's engine) and raises: the next
        ``start_push`` forms it again.
        """
        if self._push is None:
            raise RuntimeError("push_weights() before start_weight_push(): no transfer group is formed.")
        reason = "a pushed transfer ran out of time"
        try:
            send_with_deadline(self._push, self._deadline_s, on_timeout=lambda: self._abort(reason))
        except BaseException as err:
            self._abort(f"a pushed transfer failed ({err!r})")
            raise
        return self.version()

    def stop_push(self) -> None:
        """Tear the transfer group down on both sides: the learner's, then every runner's (idempotent)."""
        push, self._push = self._push, None
        client, self._client = self._client, None
        if push is not None:
            push.shutdown()
        if client is not None and self.rank == 0:
            client.shutdown()

    def _abort(self, reason: str) -> None:
        """After a failed transfer: the learner's side shut down, every runner's aborted (idempotent)."""
        push, self._push = self._push, None
        client, self._client = self._client, None
        if push is not None:
            try:
                push.shutdown()  # vLLM's NCCL shutdown aborts the communicator: a hung broadcast returns
            except Exception:
                logger.warning("shutting down the learner's side of a failed transfer failed", exc_info=True)
        if client is not None and self.rank == 0:
            client.abort(reason)


def start_push_transfer(
    route: str,
    model: nn.Module,
    client: EnvRunnerSyncClient,
    *,
    rank: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cuda",
    master_address: str | None = None,
    master_port: int | None = None,
) -> Any:
    """Rendezvous a vLLM trainer weight-transfer engine (``nccl`` or ``ipc``); call on every learner rank.

    Returns the engine; each update is then ``engine.send_weights()`` on every rank (rank 0 drives
    the runners' begin / receive / end through ``client``; ``send_with_deadline`` bounds it).
    ``nccl`` needs ``master_address`` and a free ``master_port`` on learner rank 0's node. Rank 0
    first has every engine check the plan (``client.check_plan``), before any rendezvous; a refusal
    raises here, with the engine's list of missing, unknown and mis-shaped names.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    manifest = weight_manifest(model, bucket_bytes=bucket_bytes, dtype=dtype, names="checkpoint")
    if rank == 0:
        client.check_plan(plan_of(manifest))
    source = bucket_weight_source(model, manifest, dtype=dtype, device=device)
    info = push_init_info(route, rank=rank, world_size=client.world_size, master_address=master_address,
                          master_port=master_port, ipc_buffer=ipc_buffer_bytes(manifest))  # fmt: skip
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def bucket_weight_source(
    model: nn.Module, manifest: WeightManifest, *, dtype: torch.dtype | None, device: torch.device | str
) -> Any:
    """A vLLM ``WeightSource`` over ``manifest``: ``metadata()`` from it, iteration bucket by bucket.

    ``manifest`` is in checkpoint names (``weight_manifest(..., names="checkpoint")``): vLLM's
    loaders take the checkpoint's names, not a transformers model's fused ones.

    vLLM's NCCL trainer engine sizes the workers' receive buffers from ``metadata()`` and checks
    every yielded tensor against it; its packed producer moves them in bounded buffers
    (``packed_buffer_size_bytes`` x ``packed_num_buffers``), so the learner holds one bucket plus
    those buffers beyond the model.
    """
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class _BucketSource(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(m.name, getattr(torch, m.dtype), tuple(m.shape)) for b in manifest for m in b]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in iter_weight_buckets(model, manifest, dtype=dtype, device=device, names="checkpoint"):
                yield from bucket.items()

    return _BucketSource()
