"""The halves of the push transports (``nccl``, ``ipc``): the learners send straight into the runners' vLLM workers.

Both go through one of vLLM's weight-transfer engines and speak ``flashrl.weight_sync.vllm_push``'s
protocol; ``PushTransport`` is their base, and each fills in only vLLM's trainer init info and the
engine's settings (``flashrl.weight_sync.nccl``, ``flashrl.weight_sync.ipc``).

- The learner half (``PushSender``): ``StartPush`` forms the transfer group (``start_push_transfer``:
  vLLM's trainer engine over a source that gathers bucket by bucket, after every engine checked the
  plan), ``Push`` sends the current version within a deadline, ``StopPush`` tears the group down. A
  send that fails or runs out of time tears it down on both sides (the learner's communicator, every
  runner's engine) and raises; the next ``StartPush`` forms it again.
- The runner half (``PushReceiver``): ``BeginTransfer`` pauses the engine for the learner's
  broadcast under a lease, ``ReceiveTransfer`` takes its chunks, ``EndTransfer`` finishes the
  update; ``AbortTransfer`` drops a failed transfer (the engine may hold a half-loaded mixture: the
  runner is made to fail and is restarted). The runner's lock is held from begin to end or abort.
- The driver's side (``PushRoute``): the transfer group is formed at ``setup`` (a rendezvous failure
  surfaces there, not mid-run) and again whenever the runner set changed.

An engine started with a push transport still takes the streamed route (``LoadWeights``), so a
runner restarted outside the group, or a learner that does not push, still gets its weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from flashrl.weight_sync.receiver import ReceiverSlot, RunnerMessage, WeightReceiver
from flashrl.weight_sync.registry import TRANSPORTS, transport
from flashrl.weight_sync.sender import LearnerMessage, WeightExtractor, WeightSender
from flashrl.weight_sync.transport import Learners, Runners, Transport, WeightSyncRoute
from flashrl.weight_sync.vllm_push import (
    AbortTransfer,
    BeginTransfer,
    CheckPlan,
    EndTransfer,
    EnvRunnerSyncClient,
    InitTransfer,
    Push,
    ReceiveTransfer,
    ReleaseTransfer,
    StartPush,
    StopPush,
    plan_of,
    send_with_deadline,
)
from flashrl.weight_sync.wire import DEFAULT_BUCKET_BYTES, TRANSFER_DEADLINE_S, WeightBuckets, WeightManifest

if TYPE_CHECKING:
    import torch

__all__ = [
    "JoinInfo",
    "PushReceiver",
    "PushRoute",
    "PushSender",
    "PushTransport",
    "bucket_weight_source",
    "start_push_transfer",
]

logger = logging.getLogger("flashrl.weight_sync")


@dataclass(frozen=True)
class JoinInfo:
    """What a learner rank knows of the transfer group it joins: what vLLM's trainer init info is made of."""

    rank: int
    """Its rank in the group (learner rank 0 sends; every engine worker comes after it)."""
    world_size: int
    """The learner and every worker of every engine (``EnvRunnerSyncClient.world_size``)."""
    master_address: str | None
    """``nccl``'s rendezvous: learner rank 0's node."""
    master_port: int | None
    manifest: WeightManifest
    """What every push sends (checkpoint names)."""


# -- the learner half -------------------------------------------------------------------------------
class PushSender(WeightSender):
    """One learner rank's side of a push transport's transfer group (``StartPush``, ``Push``, ``StopPush``).

    Rank 0 is the sender: it has every engine check the names and shapes it will send, then drives
    the runners through ``EnvRunnerSyncClient``. The other ranks only join the gathers of each push.
    """

    messages = (StartPush, Push, StopPush)

    def __init__(self, weights: WeightExtractor, *, rank: int, version: Callable[[], int]) -> None:
        super().__init__(weights, rank=rank, version=version)
        self._push: Any = None
        """vLLM's trainer weight-transfer engine while a group is formed (``StartPush``)."""
        self._client: EnvRunnerSyncClient | None = None
        """The runners' side of that transfer group."""
        self._deadline_s = TRANSFER_DEADLINE_S

    def handle(self, message: LearnerMessage) -> Any:
        if isinstance(message, StartPush):
            return self._start(message)
        if isinstance(message, Push):
            return self._send()
        return self._stop()

    def _start(self, message: StartPush) -> None:
        """Form the transfer group (replaces an earlier one); one that fails to form is torn down on both sides."""
        self._stop()
        client = EnvRunnerSyncClient(message.runners, message.workers_per_runner, version=self.version,
                                     timeout_s=message.deadline_s)  # fmt: skip
        self._client, self._deadline_s = client, float(message.deadline_s)
        try:
            self._push = start_push_transfer(
                transport(message.route),  # type: ignore[arg-type]
                self.weights,
                client,
                rank=self.rank,
                bucket_bytes=message.bucket_bytes,
                master_address=message.master_address,
                master_port=message.master_port,
            )
        except BaseException as err:
            self._abort(f"forming the transfer group failed ({err!r})")
            raise

    def _send(self) -> int:
        """Send the current weights; a send that fails or runs out of time tears the group down and raises."""
        if self._push is None:
            raise RuntimeError("Push before StartPush: no transfer group is formed.")
        reason = "a pushed transfer ran out of time"
        try:
            send_with_deadline(self._push, self._deadline_s, on_timeout=lambda: self._abort(reason))
        except BaseException as err:
            self._abort(f"a pushed transfer failed ({err!r})")
            raise
        return self.version()

    def _stop(self) -> None:
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
    push: PushTransport,
    weights: WeightExtractor,
    client: EnvRunnerSyncClient,
    *,
    rank: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
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

    manifest = weights.manifest(bucket_bytes, "checkpoint")
    if rank == 0:
        client.check_plan(plan_of(manifest))
    source = bucket_weight_source(weights, manifest)
    info = push.init_info(JoinInfo(rank, client.world_size, master_address, master_port, manifest))
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def bucket_weight_source(weights: WeightExtractor, manifest: WeightManifest) -> Any:
    """A vLLM ``WeightSource`` over ``manifest``: ``metadata()`` from it, iteration bucket by bucket.

    ``manifest`` is in checkpoint names (``weights.manifest(..., "checkpoint")``): vLLM's loaders take
    the checkpoint's names, not a transformers model's fused ones; each tensor is gathered on the
    learner's device.

    vLLM's NCCL trainer engine sizes the workers' receive buffers from ``metadata()`` and checks
    every yielded tensor against it; its packed producer moves them in bounded buffers
    (``packed_buffer_size_bytes`` x ``packed_num_buffers``), so the learner holds one bucket plus
    those buffers beyond the model.
    """
    import torch
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class _BucketSource(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(m.name, getattr(torch, m.dtype), tuple(m.shape)) for b in manifest for m in b]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in weights.buckets(manifest, "checkpoint", weights.device):
                yield from bucket.items()

    return _BucketSource()


# -- the runner half --------------------------------------------------------------------------------
class PushReceiver(WeightReceiver):
    """A runner's side of a pushed transfer: begin (under a lease), receive, end, abort, release."""

    messages = (InitTransfer, CheckPlan, BeginTransfer, ReceiveTransfer, EndTransfer, AbortTransfer, ReleaseTransfer)

    def __init__(self, slot: ReceiverSlot) -> None:
        super().__init__(slot)
        self._transfer_open = False
        """Whether a pushed transfer is open (between ``BeginTransfer`` and its end or abort)."""
        self._lease: asyncio.TimerHandle | None = None
        """That transfer's lease (``begin``)."""

    async def handle(self, message: RunnerMessage) -> Any:
        match message:
            case InitTransfer(init_info):
                await self.slot.ready()
                await self.slot.engine().init_weight_transfer(init_info)
            case CheckPlan(plan):
                await self.slot.ready()
                return self.slot.engine().check_weight_plan(plan)
            case BeginTransfer(lease_s):
                await self.begin(lease_s)
            case ReceiveTransfer(update_info):
                await self.slot.engine().receive_weight_transfer(update_info)
            case EndTransfer(version):
                return await self.end(version)
            case AbortTransfer(reason):
                await self.abort(reason)
            case ReleaseTransfer():
                await self.release()
        return None

    async def begin(self, lease_s: float | None = None) -> None:
        """Pause for a pushed transfer; ``lease_s``: abort it unless ``end`` comes in time.

        A learner that dies between the begin and the end would otherwise leave the runner paused,
        holding the lock, for good. When the lease runs out the transfer is aborted (``abort``).
        """
        await self.slot.ready()
        await self.slot.lock.acquire()  # no streamed update interleaves with a pushed one
        try:
            await self.slot.engine().begin_weight_transfer()
        except BaseException:
            self.slot.lock.release()
            raise
        self._transfer_open = True
        if lease_s is not None:
            reason = f"the learner did not end the transfer within its {lease_s:g} s lease"
            self._lease = asyncio.get_running_loop().call_later(
                float(lease_s), lambda: asyncio.ensure_future(self.abort(reason))
            )

    async def end(self, version: int) -> int:
        if not self._close_transfer():
            raise RuntimeError(f"EndTransfer({version}): no transfer is open (it was aborted).")
        try:
            await self.slot.engine().end_weight_transfer(int(version))
        finally:
            self.slot.lock.release()
        return int(self.slot.engine().version)

    async def abort(self, reason: str) -> None:
        """Drop the runner's side of a failed pushed transfer: its engine (possibly half-loaded) is
        broken, and the slot's ``on_abort`` makes the runner fail so that it is restarted."""
        in_transfer = self._close_transfer()
        engine = self.slot.engine()
        if engine is not None and hasattr(engine, "abort_weight_transfer"):
            await engine.abort_weight_transfer(reason)
        if in_transfer:
            self.slot.lock.release()
        self.slot.on_abort(reason)

    async def release(self) -> None:
        """The learner tore the transfer group down: release the engine's side of it."""
        engine = self.slot.engine()
        if engine is not None and hasattr(engine, "shutdown_weight_transfer"):
            await engine.shutdown_weight_transfer()

    def _close_transfer(self) -> bool:
        """Close the open pushed transfer and cancel its lease; False when none was open."""
        was_open, self._transfer_open = self._transfer_open, False
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.cancel()
        return was_open


# -- the driver's side ------------------------------------------------------------------------------
class PushRoute(WeightSyncRoute):
    """Each new version goes from the learners straight into the runners' workers (``nccl`` / ``ipc``).

    ``push`` first pings the runners (``check_alive``: a dead member would leave the others waiting
    inside the collective), forms the transfer group again whenever the runner set changed (a
    restart, or a new runner group after a restore), then has every learner rank send (``Push``). A
    push is a collective: it returns once every runner has the weights. A replacement runner is
    outside the group until then, so it first loads the learners' current weights through the
    streamed route (the route sets the runners' weights source). A runner that dies *during* a
    transfer fails the learners' call (the collective cannot complete); restore from the last
    checkpoint.

    Args:
        route: ``nccl`` or ``ipc`` (what the runners' engines resolved ``weight_sync`` to).
        bucket_bytes: bucket size of the gathers feeding vLLM's packed producer, and of the
            stream a replacement runner loads.
    """

    def __init__(self, route: str, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        pushed = tuple(name for name, entry in TRANSPORTS.items() if entry.vllm_backend)
        if route not in pushed:
            raise ValueError(
                f"PushRoute: route must be one of {pushed}; got {route!r} (shm is pulled: use ShmRoute)."
            )
        super().__init__(bucket_bytes=bucket_bytes, weight_names="checkpoint")  # vLLM engines only
        self.name = route
        self._formations = 0
        self._formed: tuple[Runners, int] | None = None
        """The runner group and its generation the transfer group was formed with."""
        self._learners: Learners | None = None

    @property
    def num_formations(self) -> int:
        """1 + the re-formations after restarts and restores."""
        return self._formations

    def setup(self, learners: Learners, runners: Runners) -> None:
        """Form the transfer group now, so that a rendezvous failure surfaces at setup."""
        self.reform(learners, runners)

    def reform(self, learners: Learners, runners: Runners) -> bool:
        """Form the transfer group over ``runners`` unless formed with these very actors; True if formed.

        Either way ``runners`` get their weights source: a replacement runner, outside the group
        until the next push, loads the learners' current weights through the streamed route.
        """
        def current() -> tuple[int, WeightBuckets]:
            return learners.version, self.stream(learners)

        runners.set_weights_source(current)
        if self._formed is not None and self._formed[0] is runners and self._formed[1] == runners.generation:
            return False
        learners.sync_weights(StartPush(self.name, tuple(runners.actors), tuple(runners.transfer_workers),
                                        bucket_bytes=self.bucket_bytes))  # fmt: skip
        self._formed, self._learners = (runners, runners.generation), learners
        self._formations += 1
        return True

    def push(self, learners: Learners, runners: Runners) -> float:
        start = time.perf_counter()
        runners.check_alive()
        self.reform(learners, runners)
        learners.sync_weights(Push())
        return time.perf_counter() - start

    def stop(self) -> None:
        """Tear the transfer group down (idempotent)."""
        learners, self._learners = self._learners, None
        if self._formed is not None and learners is not None:
            self._formed = None
            learners.sync_weights(StopPush())


# -- the transports' base ---------------------------------------------------------------------------
class PushTransport(Transport):
    """A transport through one of vLLM's weight-transfer engines; a subclass gives vLLM's init info."""

    name: ClassVar[str]
    sender = PushSender
    receiver = PushReceiver

    @abstractmethod
    def init_info(self, join: JoinInfo) -> Any:
        """vLLM's trainer init info for the learner rank ``join`` describes (packed transfers)."""

    def route(self, facts: Mapping[str, Any], *, wait_for_load: bool, bucket_bytes: int) -> PushRoute:
        return PushRoute(self.name, bucket_bytes=bucket_bytes)

    def engine_args(self) -> dict[str, object]:
        return {"weight_transfer_config": {"backend": self.name}}
