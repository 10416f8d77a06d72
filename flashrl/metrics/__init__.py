"""Metrics of a run: pure statistics helpers, TensorBoard output and the console line."""

from flashrl.metrics.console import progress_line
from flashrl.metrics.stats import LAG_BUCKETS, Window, lag_histogram, mean, policy_lags
from flashrl.metrics.tensorboard import TensorBoardLogger

__all__ = ["LAG_BUCKETS", "TensorBoardLogger", "Window", "lag_histogram", "mean", "policy_lags", "progress_line"]
