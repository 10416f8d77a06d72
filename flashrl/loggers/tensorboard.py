"""TensorBoard output: scalars every iteration, histograms of drift, lengths and policy lag."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flashrl.loggers.base import ResultLogger, finite_scalars

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger(ResultLogger):
    """Writes flat metric dicts as scalars (key = tag) and named value lists as histograms.

    A resumed run (`rewind`) reopens the writer with ``purge_step``: TensorBoard then hides the steps
    the killed run logged past the checkpoint, so each step shows once.
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.fspath(log_dir)
        os.makedirs(self.log_dir, exist_ok=True)
        self._writer = SummaryWriter(self.log_dir)

    def rewind(self, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer.close()
        self._writer = SummaryWriter(self.log_dir, purge_step=step + 1)  # steps >= step + 1 are purged

    def log(
        self, step: int, scalars: Mapping[str, Any], histograms: Mapping[str, Sequence[float]] | None = None
    ) -> None:
        for key, value in finite_scalars(scalars).items():
            self._writer.add_scalar(key, value, global_step=step)
        for key, values in (histograms or {}).items():
            array = np.asarray(list(values), dtype=np.float64)
            array = array[np.isfinite(array)]
            if array.size:
                self._writer.add_histogram(key, array, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
