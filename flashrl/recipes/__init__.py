"""Recipes: the shared command line of the tuned examples, the `--dry-run` report and the trainer loop.

* `Preset`, `NodePlan`: what a tuned example declares besides its config (success bar, hardware, pins).
* `run_preset(preset, make_config)`: the main of every tuned example (flags, dry-run or training).
* `dry_run_report(preset, config, node_plan)`: what `--dry-run` prints, with its verdict and exit code.
* The run plan it renders, the model shapes and memory formulas are `flashrl.plan` (below the algorithms).

The reference release's experiments, and their translation to flashrl and to Molt 0.2.1, are
`flashrl.reproduction`; it builds on this package, never the other way round.
"""

import importlib
from typing import Any

# name -> submodule. Imported on first use (PEP 562): importing the package costs nothing until a name
# is used (the dry-run report's modules import torch).
_EXPORTS = {
    "OVERRIDES": "args",
    "apply_overrides": "args",
    "node_plan_from_args": "args",
    "recipe_parser": "args",
    "Check": "plan",
    "DryRunReport": "plan",
    "dry_run_report": "plan",
    "CPU_PINS": "preset",
    "GPU_PINS": "preset",
    "NodePlan": "preset",
    "Preset": "preset",
    "TrainSummary": "run",
    "build_config": "run",
    "plot_curves": "run",
    "run_built": "run",
    "run_preset": "run",
    "train": "run",
    "validate_or_exit": "run",
}

__all__ = [
    "CPU_PINS",
    "GPU_PINS",
    "OVERRIDES",
    "Check",
    "DryRunReport",
    "NodePlan",
    "Preset",
    "TrainSummary",
    "apply_overrides",
    "build_config",
    "dry_run_report",
    "node_plan_from_args",
    "plot_curves",
    "recipe_parser",
    "run_built",
    "run_preset",
    "train",
    "validate_or_exit",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flashrl.recipes' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"flashrl.recipes.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
