"""Derived seeds: one 32-bit seed per (base seed, keys), the same in every process and on every run."""

from __future__ import annotations

import numpy as np

__all__ = ["stream_seed"]


def stream_seed(base_seed: int, *keys: int) -> int:
    """A 32-bit seed that depends only on ``base_seed`` and ``keys`` (order matters).

    Episode ``i`` of the training stream resets its env with ``stream_seed(seed, TRAIN_STREAM, i)`` and
    samples turn ``t`` of replica ``r`` with ``stream_seed(seed, TRAIN_STREAM, i, r, t)``, so an episode is
    a function of its index and the weights, whichever runner plays it and whenever. Call ``k`` of an
    agent session seeded ``s`` samples with ``stream_seed(s, k)`` (``flashrl.agents``).
    """
    return int(np.random.SeedSequence([int(base_seed), *(int(k) for k in keys)]).generate_state(1)[0])
