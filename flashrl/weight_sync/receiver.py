"""An env runner's side of weight sync: the ``WeightReceiver`` interface and the ``ReceiverSlot`` its receivers share.

A transport's runner half is a ``WeightReceiver``: it takes the typed messages it declares
(``messages``) and loads what arrives into the runner's engine. Every receiver of a runner shares
one ``ReceiverSlot``:

- **One at a time.** ``lock`` is held while a streamed update loads and from a pushed transfer's
  begin to its end or abort, so two updates never interleave (the runner's sleep and wake take it
  too).
- **Races with stop.** After ``close`` (the runner stops; its engine is released) a streamed update
  that arrives loads nothing and reports -1.
- The engine is the runner's (asked for at each call: the runner starts it lazily and releases it
  on stop); this package imports no engine.

An ``EnvRunner`` holds one of each registered transport's receiver behind one
``flashrl.weight_sync.endpoints.WeightInbox``; its one actor method, ``weight_sync(message)``, hands
every message to it.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

__all__ = ["ReceiverSlot", "RunnerMessage", "WeightReceiver"]


class RunnerMessage:
    """Base of the typed messages an env runner takes (frozen dataclasses, one per request)."""


class ReceiverSlot:
    """What a runner's receivers share: its engine, its start, its failure, one lock, the stop.

    Args:
        engine: the runner's engine now (None once released).
        ready: starts the engine if it is not started yet (the runner's ``setup``).
        on_abort: called with the reason when a pushed transfer is aborted; the runner records it
            as fatal, so that it is restarted with the current weights.
    """

    def __init__(
        self, engine: Callable[[], Any], *, ready: Callable[[], Awaitable[Any]], on_abort: Callable[[str], None]
    ) -> None:
        self.engine = engine
        self.ready = ready
        self.on_abort = on_abort
        self.lock = asyncio.Lock()
        """Held while an update loads (streamed) or a pushed transfer is open."""
        self.closed = False
        """Set when the runner stops (``WeightInbox.close()``): streamed updates that arrive later are ignored."""


class WeightReceiver(ABC):
    """A transport's runner half, one per env runner (sharing the runner's ``ReceiverSlot``)."""

    messages: ClassVar[tuple[type[RunnerMessage], ...]]
    """The message types this receiver takes (no two registered receivers share one)."""

    def __init__(self, slot: ReceiverSlot) -> None:
        self.slot = slot

    @abstractmethod
    async def handle(self, message: RunnerMessage) -> Any:
        """Act on one of ``messages``; returns what the message asks for."""
