"""Pure helpers behind the algorithm's metrics: policy-lag histograms and smoothing windows."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

LAG_BUCKETS = 4
"""Policy-lag histogram buckets: 0, 1, 2, 3 and '4+' versions behind the learner."""


def policy_lags(learner_version: int, min_versions: Iterable[int | None]) -> list[int]:
    """Versions each episode's oldest segment is behind the learner (unknown versions count as 0)."""
    return [max(0, learner_version - v) if v is not None else 0 for v in min_versions]


def lag_histogram(lags: Sequence[int], buckets: int = LAG_BUCKETS) -> dict[str, float]:
    """Fraction of episodes per lag bucket: keys '0', '1', ..., f'{buckets}+' (all present)."""
    counts = [0] * (buckets + 1)
    for lag in lags:
        counts[min(lag, buckets)] += 1
    n = max(1, len(lags))
    keys = [str(i) for i in range(buckets)] + [f"{buckets}+"]
    return {k: c / n for k, c in zip(keys, counts)}


def mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


class Window:
    """The last `size` values of a stream, for smoothed means (RLlib's smoothing window)."""

    def __init__(self, size: int) -> None:
        self._values: deque[float] = deque(maxlen=size)

    def extend(self, values: Iterable[float]) -> None:
        self._values.extend(float(v) for v in values)

    def mean(self) -> float:
        return mean(list(self._values))

    def __len__(self) -> int:
        return len(self._values)
