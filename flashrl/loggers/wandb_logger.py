"""`WandbLogger`: Weights & Biases (the ``loggers`` extra; ``pip install wandb``).

Offline runs need no network or account: ``logger_options={"wandb": {"mode": "offline"}}`` or the
environment variable ``WANDB_MODE=offline`` (wandb's own); ``wandb sync <dir>`` uploads them later.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from flashrl.loggers.base import ResultLogger, finite_scalars, import_backend

__all__ = ["WandbLogger"]


class WandbLogger(ResultLogger):
    """One wandb run per algorithm: the config as the run's config, the metrics against ``training_iteration``.

    Args:
        log_dir: the run's results folder; wandb writes its files under ``<log_dir>/wandb`` unless the
            options name another ``dir``.
        config: the run's settings (``FlashReinforceConfig.to_dict()``).
        run_name: the run's display name (None: wandb picks one).
        **options: more keyword arguments of ``wandb.init`` (``project``, ``entity``, ``group``, ``tags``,
            ``mode``, ...); they win over the above.

    The x-axis is the metric ``training_iteration``, not wandb's own step: a restored run repeats
    iterations, which wandb's step (strictly increasing) would drop. Histograms are logged as
    ``wandb.Histogram``.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        config: Mapping[str, Any] | None = None,
        run_name: str | None = None,
        **options: Any,
    ) -> None:
        self._wandb = import_backend("wandb", logger="wandb", package="wandb")
        os.makedirs(log_dir, exist_ok=True)
        init: dict[str, Any] = {
            "dir": os.fspath(log_dir),
            "config": dict(config or {}),
            "name": run_name,
            "project": "flashrl",
            "reinit": "create_new",  # several algorithms in one process each get their own run
        }
        init.update(options)
        self.run = self._wandb.init(**init)
        self.run.define_metric("training_iteration")
        self.run.define_metric("*", step_metric="training_iteration")

    def log(
        self, step: int, scalars: Mapping[str, Any], histograms: Mapping[str, Sequence[float]] | None = None
    ) -> None:
        data: dict[str, Any] = {**finite_scalars(scalars), "training_iteration": step}
        for key, values in (histograms or {}).items():
            values = [float(v) for v in values if math.isfinite(v)]
            if values:
                data[key] = self._wandb.Histogram(values)
        self.run.log(data)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
