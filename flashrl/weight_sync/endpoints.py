"""The one door on each side: ``WeightOutbox`` for a learner rank, ``WeightInbox`` for an env runner.

Each holds one sender (receiver) per registered sender (receiver) class
(``flashrl.weight_sync.registry``; ``nccl`` and ``ipc`` share theirs) and hands a typed message to the
one that declared its type. ``Learner.sync_weights`` and ``EnvRunner.weight_sync`` are these
``handle`` methods, so a new transport adds no method to the learners or the runners.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from flashrl.weight_sync.receiver import ReceiverSlot, RunnerMessage, WeightReceiver
from flashrl.weight_sync.registry import transports
from flashrl.weight_sync.sender import LearnerMessage, WeightExtractor, WeightSender

__all__ = ["WeightInbox", "WeightOutbox"]


def _unknown(side: str, known: dict[type, Any], message: object) -> TypeError:
    return TypeError(
        f"weight sync: expected a {side} message ({sorted(t.__name__ for t in known)}), got "
        f"{type(message).__name__}. Fix: send one of the registered transports' messages "
        "(flashrl.weight_sync.registry)."
    )


class WeightOutbox:
    """One learner rank's senders; ``handle`` routes a message by its type (``Learner.sync_weights``)."""

    def __init__(self, weights: WeightExtractor, *, rank: int, version: Callable[[], int]) -> None:
        self._by_type: dict[type, WeightSender] = {}
        for kind in dict.fromkeys(t.sender for t in transports()):
            sender = kind(weights, rank=rank, version=version)
            self._by_type.update(dict.fromkeys(kind.messages, sender))

    def handle(self, message: LearnerMessage) -> Any:
        sender = self._by_type.get(type(message))
        if sender is None:
            raise _unknown("learner", self._by_type, message)
        return sender.handle(message)


class WeightInbox:
    """One runner's receivers; ``handle`` routes a message by its type (``EnvRunner.weight_sync``).

    Args: as ``ReceiverSlot``'s (the runner's engine, its ``setup``, its abort hook).
    """

    def __init__(
        self, engine: Callable[[], Any], *, ready: Callable[[], Awaitable[Any]], on_abort: Callable[[str], None]
    ) -> None:
        self.slot = ReceiverSlot(engine, ready=ready, on_abort=on_abort)
        self._by_type: dict[type, WeightReceiver] = {}
        for kind in dict.fromkeys(t.receiver for t in transports()):
            receiver = kind(self.slot)
            self._by_type.update(dict.fromkeys(kind.messages, receiver))

    @property
    def lock(self) -> asyncio.Lock:
        """Held while an update loads or a pushed transfer is open (``ReceiverSlot.lock``)."""
        return self.slot.lock

    def close(self) -> None:
        """The runner stops: streamed updates from now on load nothing."""
        self.slot.closed = True

    async def handle(self, message: RunnerMessage) -> Any:
        receiver = self._by_type.get(type(message))
        if receiver is None:
            raise _unknown("runner", self._by_type, message)
        return await receiver.handle(message)
