"""Running a reference experiment as a tuned example: its preset, its config, its command line.

A GPU tuned example is three lines::

    from flashrl.reproduction.experiment_run import run_experiment
    if __name__ == "__main__":
        sys.exit(run_experiment("qwen_math"))

`run_experiment` adds to the shared flags (`flashrl.recipes.args`): `--variant NAME` (repeatable,
applied in order), `--print-config` (the resolved experiment and its flashrl fields as JSON) and the
data arguments of the experiment's environment. The values come from `flashrl.reproduction.experiments`;
`flashrl.reproduction.translate` maps them onto `FlashReinforceConfig`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from flashrl.recipes.plan import EXIT_INVALID_CONFIG
from flashrl.recipes.preset import GPU_PINS, NodePlan, Preset
from flashrl.reproduction.experiments import (
    EXPERIMENTS,
    FLASHRL_CHOICE,
    FLASHRL_CHOICES,
    ExperimentError,
    ResolvedExperiment,
    dumps,
    resolve_experiment,
)
from flashrl.reproduction.translate import flashrl_fields

__all__ = ["config_factory", "experiment_config", "experiment_preset", "run_experiment"]

SUCCESS_METRIC = "evaluation/episode_return_mean"
ALFWORLD_EVAL_GAMES = {"valid_seen": 140, "valid_unseen": 134}
"""Generated evaluation games per split when no official data is given (examples/README.md counts)."""


def experiment_preset(name: str, variants: Sequence[str] = ()) -> Preset:
    """The `Preset` (success bar, node plan, pins, sources) of an experiment with its variants."""
    resolved = _resolve_or_exit(name, variants)
    choices = FLASHRL_CHOICES[name]
    experiment = resolved.experiment
    pins = dict(GPU_PINS)
    if experiment.agent_kind == "alfworld":
        pins["alfworld"] = "==0.4.2"
    if experiment.agent_kind == "python_tool":
        pins["pyseccomp"] = ">=0.1"
    out = flashrl_fields(resolved)
    sources = {
        f"{key}={_short(_field_value(out.values, key))}": origin
        for key, origin in sorted(out.sources.items())
    }
    sources[f"success {choices.success_threshold:g} on {SUCCESS_METRIC}"] = FLASHRL_CHOICE
    sources["node plan, actors, GPUs"] = FLASHRL_CHOICE + " (the reference's launch commands are examples)"
    data_args = (
        {"ALFWorld data (json_2.1.1)": "alfworld_data"}
        if experiment.agent_kind == "alfworld"
        else {"training data": "data", "held-out data": "eval_data"}
    )
    notes = tuple(f"reference ({experiment.source}): {note}" for note in experiment.notes)
    notes += (f"variants of {name}: {list(experiment.variants)} (selected: {list(resolved.variants)})",)
    return Preset(
        name=choices.script,
        description=choices.description,
        success_metric=SUCCESS_METRIC,
        success_threshold=choices.success_threshold,
        stop_iters=resolved.total_updates,
        node_plan=NodePlan(
            num_nodes=choices.num_nodes,
            gpus_per_node=choices.gpus_per_node,
            cpus_per_node=96,
            gpu_memory_gib=80,
            host_memory_gib=1024 * choices.num_nodes,
        ),
        pins=pins,
        sources=sources,
        notes=notes,
        needs_sandbox=experiment.agent_kind == "python_tool",
        needs_alfworld=experiment.agent_kind == "alfworld",
        data_args=data_args,
    )


def add_experiment_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """`--variant`, `--print-config` and the data arguments of the experiment's environment."""
    experiment = EXPERIMENTS[name]
    group = parser.add_argument_group(f"reference experiment {name!r} ({experiment.source})")
    group.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME",
        help=f"a variant of the experiment, by the reference's name (repeatable, applied in order): "
        f"{', '.join(experiment.variants)}",
    )
    group.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved experiment and its flashrl fields as JSON",
    )
    if experiment.agent_kind == "alfworld":
        official = (
            os.path.join(os.environ["ALFWORLD_DATA"], "json_2.1.1")
            if os.environ.get("ALFWORLD_DATA")
            else None
        )
        group.add_argument(
            "--alfworld-data",
            default=official,
            help="official json_2.1.1 folder (default: $ALFWORLD_DATA/json_2.1.1); unset = generated games",
        )
        group.add_argument(
            "--num-generated-games",
            type=int,
            default=int(resolve_experiment(name).flags["data.max_samples"]),
            help="training games to generate without data (default: the experiment's data.max_samples)",
        )
    else:
        group.add_argument("--data", default=f"data/{name}/train.jsonl", help="training rows (JSONL/Parquet)")
        group.add_argument("--eval-data", default=f"data/{name}/eval.jsonl", help="held-out rows")


def experiment_config(resolved: ResolvedExperiment, args: argparse.Namespace) -> Any:
    """The `FlashReinforceConfig` of a resolved experiment (data from `args`); not validated.

    Raises:
        ExperimentError: the experiment needs a field this flashrl's `FlashReinforceConfig` lacks.
    """
    from flashrl.algorithms import FlashReinforceConfig

    train_env, eval_env, splits = _data(resolved, args)
    out = flashrl_fields(resolved, env_config=train_env)
    values = dict(out.values)
    values["evaluation_env_config"] = eval_env
    if splits is not None:
        values["evaluation_splits"] = splits
    known = set(FlashReinforceConfig.setting_names())
    missing = sorted(set(values) - known)
    if missing:
        raise ExperimentError(
            f"experiment {resolved.name!r} needs FlashReinforceConfig fields {missing}, which this flashrl does "
            f"not have (expected every field of the experiment to exist; sources: "
            f"{ {k: out.sources.get(k, '') for k in missing} }). Fix: update flashrl; nothing is dropped."
        )
    config = FlashReinforceConfig()
    config.update_from_dict(
        {**values, "engine_options": {**config.engine_options, **values["engine_options"]}}
    )
    return config


def config_factory(name: str) -> Callable[[argparse.Namespace], Any]:
    """`make_config(args)` for `run_preset`-style callers (the Tune sweep uses the math one)."""

    def make_config(args: argparse.Namespace) -> Any:
        resolved = _resolve_or_exit(name, getattr(args, "variant", None) or ())
        try:
            return experiment_config(resolved, args)
        except ExperimentError as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(EXIT_INVALID_CONFIG) from err

    # The flags make_config reads (--variant, --data, ...): `flashrl launch` builds the config without the script.
    make_config.add_arguments = lambda parser: add_experiment_arguments(parser, name)  # type: ignore[attr-defined]
    return make_config


def run_experiment(name: str, argv: Sequence[str] | None = None) -> int:
    """The main of a reference-experiment tuned example; returns the exit code (see `run_preset`)."""
    from flashrl.recipes.run import build_config, run_built

    argv = list(sys.argv[1:] if argv is None else argv)
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    probe.add_argument("--variant", action="append", default=[])
    variants = probe.parse_known_args(argv)[0].variant
    preset = experiment_preset(name, variants)
    config, args = build_config(
        preset, config_factory(name), argv, add_arguments=lambda parser: add_experiment_arguments(parser, name)
    )
    if args.print_config:
        resolved = resolve_experiment(name, args.variant)
        out = flashrl_fields(resolved)
        extra = {
            "flashrl_config": {k: getattr(config, k) for k in out.values if k not in ("env_config",)}
            | {"env_config": config.env_config, "evaluation_env_config": config.evaluation_env_config},
            "flashrl_sources": out.sources,
        }
        print(dumps(resolved, extra))
        return 0
    return run_built(preset, config, args)


def _resolve_or_exit(name: str, variants: Sequence[str]) -> ResolvedExperiment:
    try:
        return resolve_experiment(name, variants)
    except ExperimentError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_INVALID_CONFIG) from err


def _data(resolved: ResolvedExperiment, args: argparse.Namespace) -> tuple[dict, dict, dict | None]:
    """Training env_config, evaluation env_config and evaluation splits from the data arguments."""
    if resolved.experiment.agent_kind != "alfworld":
        template = {"template": "boxed"} if resolved.experiment.agent_kind == "math" else {}
        return {"tasks": args.data, **template}, {"tasks": args.eval_data}, None
    root = getattr(args, "alfworld_data", None)
    if root:
        return (
            {"games": root, "split": "train"},
            {"games": root},
            {split: {"split": split} for split in ALFWORLD_EVAL_GAMES},
        )
    return (
        {"split": "train", "num_games": args.num_generated_games},
        {},
        {split: {"split": split, "num_games": n} for split, n in ALFWORLD_EVAL_GAMES.items()},
    )


def _field_value(values: dict[str, Any], key: str) -> Any:
    if key.startswith("engine_options."):
        return values.get("engine_options", {}).get(key.split(".", 1)[1])
    if key.startswith("env_config."):
        return values.get("env_config", {}).get(key.split(".", 1)[1])
    return values.get(key)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
