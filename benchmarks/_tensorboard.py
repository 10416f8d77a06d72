"""A benchmark report's runs as TensorBoard runs, stepped by rollouts trained on."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from _training import ROW_METRICS


def write_tensorboard(report: Mapping[str, Any], logdir: str | os.PathLike[str]) -> list[str]:
    """A report's runs as TensorBoard runs, stepped by rollouts trained on (equal across methods).

    One run folder per (method or arm, seed): `<logdir>/<benchmark>/<name>/seed<k>`, with
    `heldout/accuracy` at every evaluation and `train/<metric>` (the `ROW_METRICS` short names) at
    every update. Returns the folders written.
    """
    from flashrl.metrics import TensorBoardLogger

    folders = []
    for run in report["runs"]:
        name = run.get("method") or run.get("arm") or run.get("mode") or "run"
        folder = Path(logdir) / str(report["benchmark"]) / str(name) / f"seed{run.get('seed', 0)}"
        logger = TensorBoardLogger(folder)
        try:
            for point in run.get("curve", []):
                logger.log(int(point["rollouts"]), {"heldout/accuracy": point["accuracy"]})
            for row in run.get("updates", []):
                scalars = {
                    f"train/{k}": v
                    for k, v in row.items()
                    if k in ROW_METRICS and isinstance(v, (int, float))
                }
                logger.log(int(row["rollouts"]), scalars)
        finally:
            logger.close()
        folders.append(str(folder))
    return folders
