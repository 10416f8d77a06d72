"""An env runner's side of weight sync: what arrives is loaded into its engine, one update at a time.

``WeightReceiver`` is the one object an ``EnvRunner`` holds for weight sync; the runner's actor
methods (``set_weights`` and the push routes' ``init_weight_transfer`` ... ``end_weight_push``, which
learner rank 0 calls through ``flashrl.weight_sync.vllm_push.EnvRunnerSyncClient``) hand over to it.

- **Streamed** (``set_weights``, every route's fallback): a full state dict or a ``WeightBuckets``
  stream, loaded while sampling goes on. Calls coalesce: while one version loads, only the newest
  of those that arrive is loaded next, and a version not newer than the served one is ignored.
- **Pushed** (``nccl`` / ``ipc``): ``begin`` pauses the engine for the learner's broadcast,
  ``receive`` takes its chunks, ``end`` finishes the update; ``abort`` drops a failed transfer (the
  engine may hold a half-loaded mixture: the runner is made to fail and is restarted).
- **One at a time.** ``lock`` is held while a streamed update loads and from a pushed transfer's
  begin to its end or abort, so the two never interleave. A pushed transfer holds it under a lease:
  a learner that dies between begin and end cannot leave the runner paused for good.
- **Races with stop.** After ``close`` (the runner stops; its engine is released) a streamed update
  that arrives loads nothing and reports -1.

The engine is the runner's (asked for at each call: the runner starts it lazily and releases it on
stop); this module imports no engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from flashrl.weight_sync.buckets import Weights

__all__ = ["WeightReceiver"]


class WeightReceiver:
    """Loads new weights into a runner's engine, streamed or pushed; see the module docstring.

    Args:
        engine: the runner's engine now (None once released).
        ready: starts the engine if it is not started yet (the runner's ``setup``).
        on_abort: called with the reason when a pushed transfer is aborted; the runner records it
            as fatal, so that it is restarted with the current weights.
    """

    def __init__(
        self,
        engine: Callable[[], Any],
        *,
        ready: Callable[[], Awaitable[Any]],
        on_abort: Callable[[str], None],
    ) -> None:
        self._engine = engine
        self._ready = ready
        self._on_abort = on_abort
        self.lock = asyncio.Lock()
        """Held while an update loads (streamed) or a pushed transfer is open."""
        self.closed = False
        """Set by ``close()``: streamed updates that arrive later are ignored."""
        self._pending: tuple[int, Weights] | None = None
        self._transfer_open = False
        """Whether a pushed transfer is open (between ``begin`` and its end or abort)."""
        self._lease: asyncio.TimerHandle | None = None
        """That transfer's lease (``begin``)."""

    def close(self) -> None:
        """The runner stops: streamed updates from now on load nothing."""
        self.closed = True

    async def set_weights(self, version: int, weights: Weights) -> int:
        """Load new weights while sampling goes on; returns the version now served (-1 once closed).

        ``weights`` is a full ``{name: tensor}`` dict or a ``WeightBuckets`` stream (the learner's
        ``put_weight_buckets``: its manifest, then one object ref per bucket). The engine resolves the
        refs one at a time while it loads, so the runner holds one bucket beyond its model, and a
        version that is superseded before it loads is never fetched at all.
        """
        if self.closed:
            return -1
        await self._ready()
        self._pending = (int(version), weights)
        async with self.lock:
            engine = self._engine()
            if self._pending is not None and engine is not None:
                version, weights = self._pending
                self._pending = None
                if version > engine.version:
                    await engine.update_weights(weights, version)
        engine = self._engine()
        return -1 if engine is None else int(engine.version)

    # -- the push routes ---------------------------------------------------------------------------
    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        await self._ready()
        await self._engine().init_weight_transfer(init_info)

    async def check_plan(self, plan: list[tuple[str, str, list[int]]]) -> int:
        """The engine checks a push's names and shapes against its checkpoint (before any broadcast)."""
        await self._ready()
        return self._engine().check_weight_plan(plan)

    async def begin(self, lease_s: float | None = None) -> None:
        """Pause for a pushed transfer; ``lease_s``: abort it unless ``end`` comes in time.

        A learner that dies between the begin and the end would otherwise leave the runner paused,
        holding ``lock``, for good. When the lease runs out the transfer is aborted (``abort``).
        """
        await self._ready()
        await self.lock.acquire()  # no streamed update interleaves with a pushed one
        try:
            await self._engine().begin_weight_transfer()
        except BaseException:
            self.lock.release()
            raise
        self._transfer_open = True
        if lease_s is not None:
            reason = f"the learner did not end the transfer within its {lease_s:g} s lease"
            self._lease = asyncio.get_running_loop().call_later(
                float(lease_s), lambda: asyncio.ensure_future(self.abort(reason))
            )

    async def receive(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        await self._engine().receive_weight_transfer(update_info)

    async def end(self, version: int) -> int:
        if not self._close_transfer():
            raise RuntimeError(f"end_weight_transfer({version}): no transfer is open (it was aborted).")
        try:
            await self._engine().end_weight_transfer(int(version))
        finally:
            self.lock.release()
        return int(self._engine().version)

    async def abort(self, reason: str) -> None:
        """Drop the runner's side of a failed pushed transfer: its engine (possibly half-loaded) is
        broken, and ``on_abort`` makes the runner fail so that it is restarted."""
        in_transfer = self._close_transfer()
        engine = self._engine()
        if engine is not None and hasattr(engine, "abort_weight_transfer"):
            await engine.abort_weight_transfer(reason)
        if in_transfer:
            self.lock.release()
        self._on_abort(reason)

    async def release(self) -> None:
        """The learner tore the transfer group down: release the engine's side of it."""
        engine = self._engine()
        if engine is not None and hasattr(engine, "shutdown_weight_transfer"):
            await engine.shutdown_weight_transfer()

    def _close_transfer(self) -> bool:
        """Close the open pushed transfer and cancel its lease; False when none was open."""
        was_open, self._transfer_open = self._transfer_open, False
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.cancel()
        return was_open
