"""The protocol of the transports whose data plane is one of vLLM's weight-transfer engines (``nccl``, ``ipc``).

Its messages (learner rank: ``StartPush``, ``Push``, ``StopPush``; runner: ``InitTransfer`` ...
``ReleaseTransfer``), ``EnvRunnerSyncClient`` (vLLM's client protocol over the EnvRunners: learner
rank 0 drives their begin / receive / end through it) and ``send_with_deadline``. The two halves
and the driver's side that speak it are ``flashrl.weight_sync.push``; what differs between ``nccl``
and ``ipc`` (vLLM's trainer init info, the engine's settings) is their own file.

What can go wrong inside a collective is made to fail, and fail whole:

- **The plan first.** Before the rendezvous, learner rank 0 sends the manifest (every name, dtype
  and shape it will send) to every engine, which checks it against its checkpoint
  (``VLLMEngine.check_weight_plan``, asked through ``EnvRunnerSyncClient.check_plan``). An engine
  that would reject a name (its loader raises midway through the packed broadcast) or size a buffer
  differently otherwise leaves the learner waiting inside the NCCL broadcast forever: vLLM's sender
  checks only that its own iteration matches its own metadata.
- **A deadline on every transfer.** Every call to the runners waits at most ``deadline_s``, and a
  whole ``send_weights`` too (``send_with_deadline``; the broadcast itself has no timeout).
- **Both sides torn down.** A transfer that failed or ran out of time aborts the learner's side
  (vLLM's ``shutdown``: the NCCL communicator is aborted) and every runner's
  (``AbortTransfer``: the engine, which may hold a half-loaded mixture, is dropped and the
  runner restarted with the current weights). ``EnvRunnerSyncClient.shutdown`` releases the
  runners' side at a normal stop (``ReleaseTransfer``).
- **A lease.** ``BeginTransfer`` pauses a runner for at most ``LEASE_FACTOR x deadline_s``:
  a learner that dies between the begin and the end of a transfer cannot leave it paused for good.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from flashrl.weight_sync.receiver import RunnerMessage
from flashrl.weight_sync.sender import LearnerMessage
from flashrl.weight_sync.wire import DEFAULT_BUCKET_BYTES, LEASE_FACTOR, TRANSFER_DEADLINE_S, WeightManifest

__all__ = [
    "AbortTransfer",
    "BeginTransfer",
    "CheckPlan",
    "EndTransfer",
    "EnvRunnerSyncClient",
    "InitTransfer",
    "Plan",
    "Push",
    "ReceiveTransfer",
    "ReleaseTransfer",
    "StartPush",
    "StopPush",
    "TransferTimeout",
    "plan_of",
    "send_with_deadline",
]

Plan = list[tuple[str, str, list[int]]]
"""``(name, dtype, shape)`` of every tensor a push will send, in order."""


# -- to every learner rank ----------------------------------------------------------------------------
@dataclass(frozen=True)
class StartPush(LearnerMessage):
    """Form the transfer group with the runners' engines (every rank; replaces an earlier group).

    ``nccl`` rendezvous at ``master_address``:``master_port`` (a free port on learner rank 0's node;
    ``LearnerGroup.sync_weights`` fills them in). ``deadline_s`` bounds every transfer.
    """

    route: str
    """The transport: ``nccl`` or ``ipc``."""
    runners: tuple[Any, ...]
    """The EnvRunner actors."""
    workers_per_runner: tuple[int, ...]
    """Per runner, its engine's workers (their ranks in the group)."""
    master_address: str | None = None
    master_port: int | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    deadline_s: float = TRANSFER_DEADLINE_S


@dataclass(frozen=True)
class Push(LearnerMessage):
    """Send the current weights through the group ``StartPush`` formed (every rank). Answer: the version sent."""


@dataclass(frozen=True)
class StopPush(LearnerMessage):
    """Tear the transfer group down on both sides (every rank; idempotent)."""


# -- to every runner (learner rank 0 sends them through EnvRunnerSyncClient) --------------------------
@dataclass(frozen=True)
class InitTransfer(RunnerMessage):
    """Join vLLM's transfer group: ``init_info`` is the worker init payload (its ranks for ``nccl``)."""

    init_info: dict[str, Any]


@dataclass(frozen=True)
class CheckPlan(RunnerMessage):
    """Check a push's names and shapes against the engine's checkpoint (before any broadcast).

    Answer: the number of tensors checked; an engine that would refuse one raises.
    """

    plan: Plan


@dataclass(frozen=True)
class BeginTransfer(RunnerMessage):
    """Pause for a pushed transfer; aborted unless ``EndTransfer`` comes within ``lease_s`` (None: no lease)."""

    lease_s: float | None = None


@dataclass(frozen=True)
class ReceiveTransfer(RunnerMessage):
    """Take the learner's broadcast (vLLM's ``update_info``), concurrently with it."""

    update_info: dict[str, Any] | list[dict[str, Any]]


@dataclass(frozen=True)
class EndTransfer(RunnerMessage):
    """Finish the transfer: the engine serves ``version``. Answer: the version now served."""

    version: int


@dataclass(frozen=True)
class AbortTransfer(RunnerMessage):
    """Drop a failed transfer: the engine (possibly half-loaded) is broken and the runner restarted."""

    reason: str


@dataclass(frozen=True)
class ReleaseTransfer(RunnerMessage):
    """The learner tore the transfer group down: release the engine's side of it."""

logger = logging.getLogger("flashrl.weight_sync")


class TransferTimeout(TimeoutError):
    """A pushed weight transfer did not finish within its deadline (both sides were torn down)."""


def plan_of(manifest: WeightManifest) -> Plan:
    """``(name, dtype, shape)`` of every tensor a push will send, in order: what the engines check."""
    return [(m.name, m.dtype, list(m.shape)) for bucket in manifest for m in bucket]


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

    def _all(self, messages: Sequence[RunnerMessage]) -> None:
        """``messages[i]`` to runner ``i`` (``EnvRunner.weight_sync``), all at once; waits ``timeout_s``."""
        import ray

        calls = [runner.weight_sync.remote(message) for runner, message in zip(self.runners, messages, strict=True)]
        ray.get(calls, timeout=self.timeout_s)

    def _each(self, message: RunnerMessage) -> None:
        self._all([message] * len(self.runners))

    def _each_quietly(self, message: RunnerMessage) -> None:
        """``_each`` for teardown: every runner is asked, failures are logged, nothing raises."""
        try:
            self._each(message)
        except Exception:  # a runner that died or hung is replaced anyway
            logger.warning("tearing down the runners' side of a weight transfer: %s failed",
                           type(message).__name__, exc_info=True)  # fmt: skip

    def check_plan(self, plan: Plan) -> None:
        """Every engine checks the names and shapes of ``plan`` against its checkpoint (raises if one refuses)."""
        self._each(CheckPlan(plan))

    def abort(self, reason: str) -> None:
        """A transfer failed or ran out of time: every runner drops its engine's side (never raises)."""
        self._each_quietly(AbortTransfer(reason))

    def shutdown(self) -> None:
        """The transfer group is torn down: every runner releases its engine's side (never raises)."""
        self._each_quietly(ReleaseTransfer())

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        infos = []
        offset = int(init_info.get("rank_offset", 1))
        for workers in self.workers:
            infos.append({**init_info, "rank_offset": offset} if "rank_offset" in init_info else dict(init_info))
            offset += workers
        self._all([InitTransfer(info) for info in infos])

    def start_weight_update(self) -> None:
        self._each(BeginTransfer(LEASE_FACTOR * self.timeout_s))

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._each(ReceiveTransfer(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = int(weight_version) if weight_version is not None else int(self.version())
        self._each(EndTransfer(version))


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
