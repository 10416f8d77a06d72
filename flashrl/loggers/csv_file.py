"""`CSVLogger`: ``progress.csv``, one row per iteration (always written)."""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from flashrl.loggers.base import ResultLogger, numeric_scalars
from flashrl.loggers.rewind import rewind_csv

__all__ = ["CSVLogger"]

FILE_NAME = "progress.csv"


class CSVLogger(ResultLogger):
    """Appends one row per iteration to ``<log_dir>/progress.csv``: ``training_iteration``, then the metrics.

    The columns are every key seen so far. A key that first appears later (an evaluation's metrics)
    widens the header: the file is rewritten once with the new column, empty in the earlier rows, so
    no value is dropped (Ray Tune's CSV logger keeps the first row's columns only). Non-finite values
    are written empty. An existing file (a resumed run writing to the same folder) is appended to, after
    `rewind` dropped its rows past the checkpoint.
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(os.fspath(log_dir), FILE_NAME)
        self._columns: list[str] = []
        if os.path.isfile(self.path) and os.path.getsize(self.path):
            with open(self.path, newline="", encoding="utf-8") as f:
                self._columns = next(csv.reader(f), [])

    def log(
        self, step: int, scalars: Mapping[str, Any], histograms: Mapping[str, Sequence[float]] | None = None
    ) -> None:
        row = {"training_iteration": float(step), **numeric_scalars(scalars)}
        new = [key for key in row if key not in self._columns]
        if new:
            self._widen(self._columns + new)
        with open(self.path, "a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, self._columns).writerow({k: _cell(v) for k, v in row.items()})

    def rewind(self, step: int) -> None:
        rewind_csv(self.path, step)

    def _widen(self, columns: list[str]) -> None:
        rows: list[dict[str, str]] = []
        if os.path.isfile(self.path) and self._columns:
            with open(self.path, newline="", encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)
        self._columns = columns


def _cell(value: float) -> str:
    return repr(value) if math.isfinite(value) else ""
