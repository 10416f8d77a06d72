"""`MLflowLogger`: MLflow tracking (the ``loggers`` extra; ``pip install mlflow-skinny``).

A local store needs no server: the default tracking URI is ``MLFLOW_TRACKING_URI`` if set, else the
file store ``file:<log_dir>/mlruns`` (``mlflow ui --backend-store-uri <that>`` shows it). MLflow 3 keeps
its file store in maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE``; for a ``file:`` URI this logger
sets that variable to true unless it is set already (a database or server URI needs no such opt-in).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flashrl.loggers.base import ResultLogger, finite_scalars, import_backend

__all__ = ["MLflowLogger", "mlflow_key"]

MAX_PARAM_LENGTH = 6000
"""MLflow's limit on a parameter's value (``mlflow.utils.validation.MAX_PARAM_VAL_LENGTH``)."""
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000
"""MLflow's limits per ``log_batch`` call (``MAX_PARAMS_TAGS_PER_BATCH``, ``MAX_METRICS_PER_BATCH``)."""


def mlflow_key(key: str) -> str:
    """A metric name MLflow accepts: ``@`` becomes ``_at_`` (``evaluation/avg@4`` -> ``evaluation/avg_at_4``),
    any other character outside letters, digits, ``_ - . / : `` and space becomes ``_``."""
    return re.sub(r"[^/\w.\- :]", "_", key.replace("@", "_at_"))


class MLflowLogger(ResultLogger):
    """One MLflow run per algorithm: the config as parameters, every metric at step = the iteration.

    Args:
        log_dir: the run's results folder (the default file store goes under it).
        config: the run's settings, logged as parameters (values as JSON, cut to MLflow's 6000 characters).
        run_name: the run's name (None: MLflow picks one).
        tracking_uri: where the runs go (a ``file:`` folder, ``http(s)://`` server, ``databricks``, ...).
        experiment_name: the experiment, created if missing.
        tags: the run's tags.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        config: Mapping[str, Any] | None = None,
        run_name: str | None = None,
        tracking_uri: str | None = None,
        experiment_name: str = "flashrl",
        tags: Mapping[str, str] | None = None,
    ) -> None:
        import_backend("mlflow", logger="mlflow", package="mlflow-skinny")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or Path(log_dir, "mlruns").resolve().as_uri()
        self.tracking_uri = uri
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
        self.run_id: str | None = self.client.create_run(
            experiment_id, run_name=run_name, tags=dict(tags or {})
        ).info.run_id
        params = [Param(key, _param_value(value)) for key, value in sorted((config or {}).items())]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + PARAMS_PER_BATCH])

    def log(
        self, step: int, scalars: Mapping[str, Any], histograms: Mapping[str, Sequence[float]] | None = None
    ) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(mlflow_key(k), v, now, int(step)) for k, v in finite_scalars(scalars).items()]
        for i in range(0, len(metrics), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + METRICS_PER_BATCH])

    def close(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.run_id = None


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= MAX_PARAM_LENGTH else text[: MAX_PARAM_LENGTH - 3] + "..."
