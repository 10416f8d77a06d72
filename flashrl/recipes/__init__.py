"""Recipes: the shared command line of the tuned examples, the `--dry-run` planner and the trainer loop.

* `Preset`, `NodePlan`: what a tuned example declares besides its config (success bar, hardware, pins).
* `run_preset(preset, make_config)`: the main of every tuned example (flags, dry-run or training).
* `make_plan(preset, config, node_plan)`: the dry-run plan, with its verdict and exit code.
* `flashrl.recipes.settings`: the five reference settings (`r1`, `qwen_math`, `qwen7b_tool`,
  `qwen3_tool_ablation`, `alfworld`) and their variants as data; `resolve_setting(name, variants)`.
* `flashrl.recipes.translate`: reference flags -> `FlashReinforceConfig` fields, each with its source.
* `run_setting(name)`: the main of a reference-setting tuned example (`--variant`, `--print-config`).
* `flashrl.recipes.molt`: the same settings as a command line of Molt 0.2.1 (`scripts/train_molt.py`).
* `flashrl.recipes.architectures`, `flashrl.recipes.memory`: model shapes and memory formulas.
"""

from flashrl.recipes.args import OVERRIDES, apply_overrides, node_plan_from_args, recipe_parser
from flashrl.recipes.plan import Check, Plan, make_plan
from flashrl.recipes.preset import CPU_PINS, GPU_PINS, NodePlan, Preset
from flashrl.recipes.run import (
    TrainSummary,
    build_config,
    plot_curves,
    run_built,
    run_preset,
    train,
    validate_or_exit,
)
from flashrl.recipes.setting_run import config_factory, run_setting, setting_config, setting_preset
from flashrl.recipes.settings import SETTINGS, ResolvedSetting, SettingError, resolve_setting

__all__ = [
    "CPU_PINS",
    "GPU_PINS",
    "OVERRIDES",
    "SETTINGS",
    "Check",
    "NodePlan",
    "Plan",
    "Preset",
    "ResolvedSetting",
    "SettingError",
    "TrainSummary",
    "apply_overrides",
    "build_config",
    "config_factory",
    "make_plan",
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
