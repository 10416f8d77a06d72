"""Recipes: the shared command line of the tuned examples, the `--dry-run` planner and the trainer loop.

* `Preset`, `NodePlan`: what a tuned example declares besides its config (success bar, hardware, pins).
* `run_preset(preset, make_config)`: the main of every tuned example (flags, dry-run or training).
* `make_plan(preset, config, node_plan)`: the dry-run plan, with its verdict and exit code.
* `flashrl.recipes.architectures`, `flashrl.recipes.memory`: model shapes and memory formulas.
"""

from flashrl.recipes.args import OVERRIDES, apply_overrides, node_plan_from_args, recipe_parser
from flashrl.recipes.plan import Check, Plan, make_plan
from flashrl.recipes.preset import CPU_PINS, GPU_PINS, NodePlan, Preset
from flashrl.recipes.run import TrainSummary, build_config, plot_curves, run_preset, train, validate_or_exit

__all__ = [
    "CPU_PINS",
    "GPU_PINS",
    "OVERRIDES",
    "Check",
    "NodePlan",
    "Plan",
    "Preset",
    "TrainSummary",
    "apply_overrides",
    "build_config",
    "make_plan",
    "node_plan_from_args",
    "plot_curves",
    "recipe_parser",
    "run_preset",
    "train",
    "validate_or_exit",
]
