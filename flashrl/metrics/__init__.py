"""Metrics of a run: an iteration's metrics, statistics helpers, TensorBoard output, the console line."""

from flashrl.metrics.console import progress_line
from flashrl.metrics.iteration import (
    TOKEN_RATE_WINDOW,
    IterationMetrics,
    IterationTimes,
    StreamCounts,
    iteration_histograms,
)
from flashrl.metrics.stats import LAG_BUCKETS, Window, lag_histogram, mean, policy_lags
from flashrl.metrics.tensorboard import TensorBoardLogger

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
