"""Which task of a finite list an environment plays when ``reset`` names none (its ``order``).

``shuffle`` walks a fresh permutation of the tasks each epoch, ``random`` draws with replacement,
``sequential`` walks ``0, 1, ..., n - 1`` and wraps. The draws use the env's ``np_random``, so a seed
makes them reproducible; a new seed restarts the epoch (:meth:`EpochCursor.restart`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

Order = Literal["shuffle", "random", "sequential"]


def check_order(order: object) -> None:
    """Raise ``ValueError`` unless ``order`` is one of :data:`Order`'s values."""
    if order not in ("shuffle", "random", "sequential"):
        raise ValueError(f"order must be 'shuffle', 'random' or 'sequential'; got {order!r}.")


class EpochCursor:
    """The position in the current epoch of a finite task list, and that epoch's permutation."""

    def __init__(self) -> None:
        self._permutation: np.ndarray | None = None
        self._cursor = 0

    def restart(self) -> None:
        """Start again at the first task of a new epoch (a new seed restarts the epoch order)."""
        self._permutation, self._cursor = None, 0

    def next_index(self, n: int, order: Order, rng: np.random.Generator) -> int:
        """The index in ``range(n)`` of the next task to play, drawn with ``rng`` as ``order`` says."""
        if order == "random":
            return int(rng.integers(n))
        if order == "sequential":
            index = self._cursor % n
        else:
            if self._permutation is None or self._cursor % n == 0:
                self._permutation = rng.permutation(n)
            index = int(self._permutation[self._cursor % n])
        self._cursor += 1
        return index
