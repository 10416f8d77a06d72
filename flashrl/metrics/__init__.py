"""Metrics of a run: an iteration's metrics, statistics helpers, the console line.

Where they are written (TensorBoard, CSV, JSON lines, trackers) is `flashrl.loggers`; `TensorBoardLogger`
is re-exported here for the code that imports it from this package.
"""

from flashrl.loggers.tensorboard import TensorBoardLogger
from flashrl.metrics.console import progress_line
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
    "TOKEN_RATE_WINDOW",
    "IterationMetrics",
    "IterationTimes",
    "StreamCounts",
    "TensorBoardLogger",
    "Window",
    "iteration_histograms",
    "lag_histogram",
    "mean",
    "policy_lags",
    "progress_line",
]
