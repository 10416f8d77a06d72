"""`ResultLogger`: where one iteration's metrics go (a file, TensorBoard, an experiment tracker).

A backend takes the iteration number (the step), the flat metrics dict that ``train()`` returns and
optionally named value lists (histograms), and writes them; ``close()`` flushes and releases it. Every
backend writes the same keys: the numeric metrics (ints and floats, not bools); a non-finite value is
left out of that step (TensorBoard and the trackers) or written empty (CSV) or as null (JSON lines).
"""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

__all__ = ["ResultLogger", "finite_scalars", "import_backend", "numeric_scalars"]


class ResultLogger(ABC):
    """One output of a run's metrics; build it with the run's results folder and config."""

    @abstractmethod
    def log(
        self, step: int, scalars: Mapping[str, Any], histograms: Mapping[str, Sequence[float]] | None = None
    ) -> None:
        """Write the metrics of iteration ``step`` (0: before the first update)."""

    def rewind(self, step: int) -> None:
        """Forget what was logged past iteration ``step``: the run resumed from its checkpoint at ``step``.

        The progress files cut their later rows (`flashrl.loggers.rewind`), TensorBoard purges its later
        steps; a tracker keeps its history (the resumed steps are logged again over it).
        """

    def close(self) -> None:
        """Flush and release the backend (idempotent)."""


def numeric_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric metrics (ints and floats, not bools), non-finite ones included, in order."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def finite_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric metrics with a finite value (what TensorBoard and the trackers record at a step)."""
    return {k: v for k, v in numeric_scalars(metrics).items() if math.isfinite(v)}


def import_backend(module: str, *, logger: str, package: str) -> ModuleType:
    """Import a tracker's library, or fail naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"loggers: {logger!r} needs the {package!r} package, which is not installed ({err}). Fix: "
            f"pip install 'flashrl[loggers]' (or pip install {package}), or remove {logger!r} from loggers."
        ) from err
