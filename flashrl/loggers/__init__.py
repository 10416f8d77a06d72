"""Where a run's metrics go: one module per backend, one interface (`ResultLogger`).

Every run writes ``progress.csv`` and ``progress.jsonl`` (one row per iteration) into its results
folder, and TensorBoard event files unless ``tensorboard=False``; ``loggers=[...]`` adds experiment
trackers by name (the ``loggers`` extra installs both)::

    config.reporting(loggers=["wandb", "mlflow"],
                     logger_options={"wandb": {"project": "math", "mode": "offline"},
                                     "mlflow": {"tracking_uri": "file:/data/mlruns"}})

- ``wandb``: Weights & Biases (`WandbLogger`; ``WANDB_MODE=offline`` works without network);
- ``mlflow``: MLflow tracking (`MLflowLogger`; a local file store by default).

A backend of your own: subclass `ResultLogger` (``log(step, scalars, histograms)``, ``close()``; its
constructor takes the results folder and the keywords ``config``, ``run_name`` and its options) and
``register_logger("name")`` it before the config is validated.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flashrl.loggers.base import ResultLogger, finite_scalars, numeric_scalars
from flashrl.loggers.csv_file import CSVLogger
from flashrl.loggers.json_lines import JsonLinesLogger
from flashrl.loggers.mlflow_logger import MLflowLogger
from flashrl.loggers.tensorboard import TensorBoardLogger
from flashrl.loggers.wandb_logger import WandbLogger

__all__ = [
    "LOGGERS",
    "CSVLogger",
    "JsonLinesLogger",
    "MLflowLogger",
    "ResultLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "build_loggers",
    "finite_scalars",
    "logger_problems",
    "numeric_scalars",
    "register_logger",
]

LOGGERS: dict[str, type[ResultLogger]] = {"wandb": WandbLogger, "mlflow": MLflowLogger}
"""The optional backends ``loggers=[...]`` names (CSV, JSON lines and TensorBoard are not optional)."""
REQUIRES: dict[str, tuple[str, str]] = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}
"""Backend -> (the module it imports, the package that provides it)."""


def register_logger(name: str) -> Callable[[type[ResultLogger]], type[ResultLogger]]:
    """Decorator: make a `ResultLogger` subclass available as ``loggers=[name]``."""

    def register(cls: type[ResultLogger]) -> type[ResultLogger]:
        if not (isinstance(cls, type) and issubclass(cls, ResultLogger)):
            raise TypeError(f"register_logger({name!r}): expected a ResultLogger subclass, got {cls!r}.")
        LOGGERS[name] = cls
        return cls

    return register


def logger_problems(names: Any, options: Any) -> list[str]:
    """What is wrong with ``loggers`` / ``logger_options`` (empty when nothing), for a config's validate()."""
    problems = []
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        return [f"loggers: expected a list of names among {sorted(LOGGERS)}, got {names!r}. Fix: e.g. ['wandb']"]
    for name in names:
        if name not in LOGGERS:
            problems.append(f"loggers: expected names among {sorted(LOGGERS)}, got {name!r}. Fix: use one of "
                            "them, or register_logger() your own first (CSV, JSON lines and TensorBoard are always on)")
        elif name in REQUIRES and importlib.util.find_spec(REQUIRES[name][0]) is None:
            package = REQUIRES[name][1]
            problems.append(f"loggers: {name!r} needs the {package!r} package, which is not installed. Fix: pip "
                            f"install 'flashrl[loggers]' (or pip install {package}), or remove {name!r}")
    if len(set(names)) != len(names):
        problems.append(f"loggers: expected each name once, got {list(names)!r}. Fix: remove the repeats")
    if not isinstance(options, Mapping) or not all(isinstance(v, Mapping) for v in options.values()):
        problems.append(f"logger_options: expected a dict of logger name -> dict of options, got {options!r}. "
                        "Fix: e.g. {'wandb': {'project': 'math'}}")
    else:
        unused = sorted(set(options) - set(names))
        if unused:
            problems.append(f"logger_options: expected options only for the loggers in use {list(names)!r}, got "
                            f"options for {unused}. Fix: add them to loggers, or remove their options")
    return problems


def build_loggers(
    results_dir: str | os.PathLike[str],
    *,
    names: Sequence[str] = (),
    options: Mapping[str, Mapping[str, Any]] | None = None,
    tensorboard_dir: str | os.PathLike[str] | None = None,
    config: Mapping[str, Any] | None = None,
    run_name: str | None = None,
) -> list[ResultLogger]:
    """CSV and JSON lines in ``results_dir``, TensorBoard in ``tensorboard_dir`` (None: none), then ``names``.

    If a backend fails to start, the ones already started are closed and the error is raised.
    """
    built: list[ResultLogger] = []
    try:
        built += [CSVLogger(results_dir), JsonLinesLogger(results_dir)]
        if tensorboard_dir is not None:
            built.append(TensorBoardLogger(tensorboard_dir))
        for name in names:
            if name not in LOGGERS:
                raise ValueError(f"loggers: expected names among {sorted(LOGGERS)}, got {name!r}.")
            kwargs = dict((options or {}).get(name, {}))
            built.append(LOGGERS[name](results_dir, config=config, run_name=run_name, **kwargs))
    except BaseException:
        for logger in built:
            logger.close()
        raise
    return built
