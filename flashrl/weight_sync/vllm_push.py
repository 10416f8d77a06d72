"""The learner's side of the push routes: vLLM's trainer weight-transfer engines, fed from buckets.

``start_push_transfer`` rendezvous vLLM's ``nccl`` or ``ipc`` trainer engine on every learner rank,
over a ``WeightSource`` that gathers the policy bucket by bucket (``bucket_weight_source``: the
learner holds one bucket plus vLLM's packed buffers beyond its model). ``EnvRunnerSyncClient`` is
vLLM's client protocol over the EnvRunner actors: rank 0 drives their begin / receive / end calls.
``flashrl.weight_sync.route.PushRoute`` keeps a run's transfer group.

What can go wrong inside a collective is made to fail, and fail whole:

- **The plan first.** Before the rendezvous, learner rank 0 sends the manifest (every name, dtype
  and shape it will send) to every engine, which checks it against its checkpoint
  (``VLLMEngine.check_weight_plan``). An engine that would reject a name (its loader raises
  midway through the packed broadcast) or size a buffer differently otherwise leaves the learner
  waiting inside the NCCL broadcast forever: vLLM's sender checks only that its own iteration
  matches its own metadata.
- **A deadline on every transfer.** Every call to the runners waits at most ``deadline_s``, and a
  whole ``send_weights`` too (``send_with_deadline``; the broadcast itself has no timeout).
- **Both sides torn down.** A transfer that failed or ran out of time aborts the learner's side
  (vLLM's ``shutdown``: the NCCL communicator is aborted) and every runner's
  (``abort_weight_transfer``: the engine, which may hold a half-loaded mixture, is dropped and the
  runner restarted with the current weights). ``EnvRunnerSyncClient.shutdown`` releases the
  runners' side at a normal stop.
- **A lease.** ``begin_weight_transfer`` pauses a runner for at most ``LEASE_FACTOR x deadline_s``:
  a learner that dies between the begin and the end of a transfer cannot leave it paused for good.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from flashrl.weight_sync.buckets import DEFAULT_BUCKET_BYTES, WeightManifest
from flashrl.weight_sync.gather import iter_weight_buckets, weight_manifest

__all__ = [
    "LEASE_FACTOR",
    "TRANSFER_DEADLINE_S",
    "VLLM_PACKED_BUFFER_BYTES",
    "EnvRunnerSyncClient",
    "TransferTimeout",
    "bucket_weight_source",
    "ipc_buffer_bytes",
    "plan_of",
    "push_init_info",
    "send_with_deadline",
    "start_push_transfer",
]

logger = logging.getLogger("flashrl.weight_sync")

TRANSFER_DEADLINE_S = 600.0
"""Seconds one pushed transfer (and each call to the runners within it) may take; flashrl's choice:
a 30B model's 61 GB cross a 100 Gb/s link in about 5 s, so 600 s only ever ends a hung transfer."""
LEASE_FACTOR = 2.0
"""A runner's pause for a transfer lasts at most this many deadlines: a live learner always ends or
aborts it first, a dead one cannot keep it paused."""
VLLM_PACKED_BUFFER_BYTES = 1024**3
"""vLLM 0.32's packed buffer size (``DEFAULT_PACKED_BUFFER_SIZE_BYTES``,
``vllm/distributed/weight_transfer/packed_tensor.py``): 1 GiB."""


class TransferTimeout(TimeoutError):
    """A pushed weight transfer did not finish within its deadline (both sides were torn down)."""


def plan_of(manifest: WeightManifest) -> list[tuple[str, str, list[int]]]:
    """``(name, dtype, shape)`` of every tensor a push will send, in order: what the engines check."""
    return [(m.name, m.dtype, list(m.shape)) for bucket in manifest for m in bucket]


def ipc_buffer_bytes(manifest: WeightManifest) -> int:
    """The IPC packed buffer: vLLM's 1 GiB, or the largest tensor when that is larger.

    vLLM's ``packed_ipc_producer`` copies each tensor whole into one reusable CUDA buffer and raises
    for a tensor larger than it (``vllm/distributed/weight_transfer/packed_tensor.py``); Qwen2.5-7B's
    embedding alone is 152,064 x 3,584 x 2 bytes = 1.09 GB.
    """
    largest = max((m.nbytes for bucket in manifest for m in bucket), default=0)
    return max(VLLM_PACKED_BUFFER_BYTES, int(largest))


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


class EnvRunnerSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over the EnvRunner actors (one engine each).

    ``init_weight_transfer_engine`` gives runner ``i`` the NCCL ranks after those of runners
    ``0..i-1`` (``rank_offset = 1 + sum(workers before it)``; the learner is rank 0), so one NCCL
    group spans every worker of every engine. The other calls fan out to all runners and wait;
    ``update_weights`` must run concurrently with the learner's broadcast (vLLM's trainer engine
    calls it on a side thread).
    """

    def __init__(self, runners: Sequence[Any], workers_per_runner: Sequence[int], *, version: Callable[[], int],
                 timeout_s: float = TRANSFER_DEADLINE_S) -> None:  # fmt: skip
        if len(runners) != len(workers_per_runner):
            raise ValueError(
                f"one worker count per runner expected: {len(runners)} runners, {len(workers_per_runner)} counts."
            )
        self.runners = list(runners)
        self.workers = [int(w) for w in workers_per_runner]
        self.version = version
        self.timeout_s = timeout_s

    @property
    def world_size(self) -> int:
        """The NCCL group: the learner (rank 0) and every worker of every engine."""
        return 1 + sum(self.workers)

    def _all(self, method: str, per_runner: Sequence[Any] | None = None, *args: Any) -> None:
        import ray

        calls = [
            getattr(r, method).remote(*(((per_runner[i],) if per_runner is not None else ()) + args))
            for i, r in enumerate(self.runners)
        ]
        ray.get(calls, timeout=self.timeout_s)

    def _all_quietly(self, method: str, *args: Any) -> None:
        """``_all`` for teardown: every runner is asked, failures are logged, nothing raises."""
        try:
            self._all(method, None, *args)
        except Exception:  # a runner that died or hung is replaced anyway
            logger.warning("tearing down the runners' side of a weight transfer: %s failed", method, exc_info=True)

    def check_plan(self, plan: list[tuple[str, str, list[int]]]) -> None:
        """Every engine checks the names and shapes of ``plan`` against its checkpoint (raises if one refuses)."""
        self._all("check_weight_plan", None, plan)

    def abort(self, reason: str) -> None:
        """A transfer failed or ran out of time: every runner drops its engine's side (never raises)."""
        self._all_quietly("abort_weight_transfer", reason)

    def shutdown(self) -> None:
        """The transfer group is torn down: every runner releases its engine's side (never raises)."""
        self._all_quietly("end_weight_push")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        infos = []
        offset = int(init_info.get("rank_offset", 1))
        for workers in self.workers:
            infos.append({**init_info, "rank_offset": offset} if "rank_offset" in init_info else dict(init_info))
            offset += workers
        self._all("init_weight_transfer", infos)

    def start_weight_update(self) -> None:
        self._all("begin_weight_transfer", None, LEASE_FACTOR * self.timeout_s)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._all("receive_weight_transfer", None, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = int(weight_version) if weight_version is not None else int(self.version())
        self._all("end_weight_transfer", None, version)


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


def send_with_deadline(engine: Any, deadline_s: float, *, on_timeout: Callable[[], None]) -> None:
    """``engine.send_weights()``, raising ``TransferTimeout`` if it has not returned within ``deadline_s``.

    The send runs on a daemon thread (a hung NCCL broadcast cannot be interrupted from Python);
    ``on_timeout`` runs before the error is raised and must tear the transfer down (aborting the
    communicator is what lets the stuck thread return). Errors of the send are raised as they are.
    """
    outcome: list[BaseException | None] = []

    def send() -> None:
        try:
            engine.send_weights()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread, raised there
            outcome.append(err)
        else:
            outcome.append(None)

    thread = threading.Thread(target=send, name="flashrl-weight-push", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        on_timeout()
        raise TransferTimeout(
            f"a pushed weight transfer did not finish within {deadline_s:g} s (a runner that stopped "
            "receiving, or a collective that hung); the transfer group was torn down on both sides and "
            "the next push forms it again."
        )
    if outcome and outcome[0] is not None:
        raise outcome[0]


def push_init_info(
    route: str,
    *,
    rank: int,
    world_size: int,
    master_address: str | None,
    master_port: int | None,
    ipc_buffer: int = VLLM_PACKED_BUFFER_BYTES,
) -> Any:
    """vLLM's ``NCCLTrainerInitInfo`` / ``IPCTrainerInitInfo`` for ``route`` (packed transfers).

    ``ipc_buffer``: the IPC route's packed buffer (``ipc_buffer_bytes``: at least the largest tensor).
    The NCCL producer needs no such bound (a tensor larger than its buffer is sent as a chunk of its own).
    """
    if route == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        if not master_address or not master_port:
            raise ValueError(
                "weight_sync='nccl' needs master_address and master_port (a free port on learner rank 0's node)."
            )
        return NCCLTrainerInitInfo(master_address=master_address, master_port=int(master_port),
                                   world_size=int(world_size), packed=True, rank=int(rank))  # fmt: skip
    if route == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(packed=True, rank=int(rank), packed_buffer_size_bytes=int(ipc_buffer))
    raise ValueError(f"push routes are 'nccl' and 'ipc'; got {route!r} (the 'shm' route is put_weight_buckets).")
