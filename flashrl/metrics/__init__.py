"""Metrics of a run: an iteration's metrics, its episodes', statistics helpers, the console lines,
rollout dumps (`flashrl.metrics.rollouts`).

Where they are written (TensorBoard, CSV, JSON lines, trackers) is `flashrl.loggers`; `TensorBoardLogger`
is re-exported here for the code that imports it from this package.
"""

from flashrl.loggers.tensorboard import TensorBoardLogger
from flashrl.metrics.console import evaluation_line, progress_line
from flashrl.metrics.episodes import TERMINATION_REASONS, episode_metrics, termination_reason
from flashrl.metrics.iteration import (
    TOKEN_RATE_WINDOW,
    IterationMetrics,
    IterationTimes,
    StreamCounts,
    iteration_histograms,
)
from flashrl.metrics.stats import LAG_BUCKETS, Window, lag_histogram, mean, policy_lags

__all__ = [
    "LAG_BUCKETS",
    "TERMINATION_REASONS",
    "TOKEN_RATE_WINDOW",
    "IterationMetrics",
    "IterationTimes",
    "StreamCounts",
    "TensorBoardLogger",
    "Window",
    "episode_metrics",
    "evaluation_line",
    "iteration_histograms",
    "lag_histogram",
    "mean",
    "policy_lags",
    "progress_line",
    "termination_reason",
]
