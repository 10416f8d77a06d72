"""`JsonLinesLogger`: ``progress.jsonl``, one JSON object per iteration (always written)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from flashrl.loggers.base import ResultLogger, numeric_scalars
from flashrl.loggers.rewind import rewind_jsonl

__all__ = ["JsonLinesLogger"]

FILE_NAME = "progress.jsonl"


class JsonLinesLogger(ResultLogger):
    """Appends ``{"training_iteration": step, <metric>: value, ...}`` lines to ``<log_dir>/progress.jsonl``.

    Strict JSON: a non-finite value is written as null. Each line is flushed as it is written, so a
    killed run leaves every finished iteration on disk (at most the last line cut short); a resumed run
    moves the rows past its checkpoint to ``progress.discarded.jsonl`` (`rewind`).
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(os.fspath(log_dir), FILE_NAME)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - open for the run's life

    def log(
        self, step: int, scalars: Mapping[str, Any], histograms: Mapping[str, Sequence[float]] | None = None
    ) -> None:
        row = {"training_iteration": float(step), **numeric_scalars(scalars)}
        row = {k: v if math.isfinite(v) else None for k, v in row.items()}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def rewind(self, step: int) -> None:
        self._file.close()
        rewind_jsonl(self.path, step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - the file was replaced

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
