"""The push routes' protocol: vLLM's client over the EnvRunners, the init info, the deadline.

``EnvRunnerSyncClient`` is vLLM's client protocol over the EnvRunner actors: learner rank 0 drives
their begin / receive / end calls (the runners' side is ``flashrl.weight_sync.receiver``).
``push_init_info`` builds vLLM's trainer init info and ``send_with_deadline`` bounds a send. The
learner's side, which gathers the policy into vLLM's trainer engine, is
``flashrl.learners.weight_sender`` (``start_push_transfer``, ``WeightSender``);
``flashrl.weight_sync.route.PushRoute`` keeps a run's transfer group.

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
  (``abort_weight_transfer``: the engine, which may hold a half-loaded mixture, is dropped and the
  runner restarted with the current weights). ``EnvRunnerSyncClient.shutdown`` releases the
  runners' side at a normal stop.
- **A lease.** ``begin_weight_transfer`` pauses a runner for at most ``LEASE_FACTOR x deadline_s``:
  a learner that dies between the begin and the end of a transfer cannot leave it paused for good.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from flashrl.weight_sync.wire import (
    LEASE_FACTOR,
    TRANSFER_DEADLINE_S,
    VLLM_PACKED_BUFFER_BYTES,
    WeightManifest,
)

__all__ = [
    "EnvRunnerSyncClient",
    "TransferTimeout",
    "ipc_buffer_bytes",
    "plan_of",
    "push_init_info",
    "send_with_deadline",
]

logger = logging.getLogger("flashrl.weight_sync")


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
