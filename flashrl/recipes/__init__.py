"""Recipes: the shared command line of the tuned examples, the `--dry-run` report and the trainer loop.

* `Preset`, `NodePlan`: what a tuned example declares besides its config (success bar, hardware, pins).
* `run_preset(preset, make_config)`: the main of every tuned example (flags, dry-run or training).
* `dry_run_report(preset, config, node_plan)`: what `--dry-run` prints, with its verdict and exit code.
* `flashrl.recipes.settings`: the five reference settings (`r1`, `qwen_math`, `qwen7b_tool`,
  `qwen3_tool_ablation`, `alfworld`) and their variants as data; `resolve_setting(name, variants)`.
* `flashrl.recipes.translate`: reference flags -> `FlashReinforceConfig` fields, each with its source.
* `run_setting(name)`: the main of a reference-setting tuned example (`--variant`, `--print-config`).
* `flashrl.recipes.molt`: the same settings as a command line of Molt 0.2.1 (`scripts/train_molt.py`).
* `flashrl.recipes.architectures`, `flashrl.recipes.memory`: model shapes and memory formulas.
"""

import importlib
from typing import Any

# name -> submodule. Imported on first use (PEP 562), so that the data modules (settings, translate,
# molt) load without the dry-run report's dependencies (torch): scripts/train_molt.py runs on a bare Python.
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
    "config_factory": "setting_run",
    "run_setting": "setting_run",
    "setting_config": "setting_run",
    "setting_preset": "setting_run",
    "SETTINGS": "settings",
    "ResolvedSetting": "settings",
    "SettingError": "settings",
    "resolve_setting": "settings",
}

__all__ = [
    "CPU_PINS",
    "GPU_PINS",
    "OVERRIDES",
    "SETTINGS",
    "Check",
    "DryRunReport",
    "NodePlan",
    "Preset",
    "ResolvedSetting",
    "SettingError",
    "TrainSummary",
    "apply_overrides",
    "build_config",
    "config_factory",
    "dry_run_report",
    "node_plan_from_args",
    "plot_curves",
    "recipe_parser",
    "resolve_setting",
    "run_built",
    "run_preset",
    "run_setting",
    "setting_config",
    "setting_preset",
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
