"""A Ray Tune grid over the trust-region threshold `delta` and the batch size B (`train_batch_size`).

    python tuned_examples/tune_delta_batch_sweep.py --dry-run                # the GPU grid (math preset)
    python tuned_examples/tune_delta_batch_sweep.py --tiny --resume                           # restore the newest sweep (Tune's own restore)
    python tuned_examples/tune_delta_batch_sweep.py --tiny                   # a 2 x 2 grid on a laptop CPU
    python tuned_examples/tune_delta_batch_sweep.py --tiny --model smollm2-135m-instruct --stop-iters 5

Every trial is one `FlashReinforce` Trainable built from `param_space=config` (a dict of the config's
fields with `tune.grid_search` in it); Tune reserves each trial's actors as one placement group.
Without --tiny the base config is the Qwen2.5-Math-1.5B preset (8 GPUs per trial). --tiny swaps in a
tiny random-weight Llama (or --model), the torch engine and easy sums, with fractional CPUs so a
2-core machine runs it (one trial at a time).
"""

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from qwen25_math_1p5b import PRESET as MATH_PRESET  # the sibling preset: the GPU grid's base
from qwen25_math_1p5b import make_config as math_config

from flashrl.algorithms import FlashReinforceConfig
from flashrl.recipes import (
    CPU_PINS,
    NodePlan,
    Preset,
    build_config,
    dry_run_report,
    node_plan_from_args,
    validate_or_exit,
)

GPU_GRID = {"delta": [0.003, 0.01, 0.03], "train_batch_size": [64, 128]}
TINY_GRID = {"delta": [0.01, 0.1], "train_batch_size": [4, 8]}

SWEEP = Preset(
    name="tune_delta_batch_sweep",
    description="Ray Tune grid over delta x train_batch_size (base: the Qwen2.5-Math-1.5B preset)",
    success_metric="env_runners/episode_return_mean",
    success_threshold=float("inf"),
    stop_iters=100,
    node_plan=MATH_PRESET.node_plan,
    pins=MATH_PRESET.pins,
    sources={"grid": "ours: delta around the default 0.01 (x3 steps), B at half and full preset size"},
    notes=("Trials run one after another when each needs the whole node (8 GPUs).",),
    data_args=MATH_PRESET.data_args,
    checkpoint_frequency=0,  # trials checkpoint through Tune's CheckpointConfig (_new_tuner)
    checkpoint_interval_minutes=None,
)
TINY = Preset(
    name="tune_delta_batch_sweep_tiny",
    description="Ray Tune 2 x 2 grid over delta x train_batch_size on CPU (tiny model, torch engine)",
    success_metric="env_runners/episode_return_mean",
    success_threshold=float("inf"),
    stop_iters=2,
    node_plan=NodePlan(num_nodes=1, gpus_per_node=0, cpus_per_node=os.cpu_count() or 2, host_memory_gib=24),
    pins=CPU_PINS,
    checkpoint_frequency=0,  # trials checkpoint through Tune's CheckpointConfig (_new_tuner)
    checkpoint_interval_minutes=None,
    notes=(
        (
            "--tiny builds a random-weight 2-layer Llama with SmolLM2's tokenizer at start (seconds): the "
            "grid exercises the whole stack, it does not learn arithmetic in 2 updates."
        ),
        "Until the first --tiny run builds it, 'model reachable' fails and memory is not estimated.",
    ),
    needs_gpu=False,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default="data/math/train.jsonl", help="training questions (GPU grid)")
    parser.add_argument(
        "--eval-data", default="data/math/math500.jsonl", help="held-out questions (GPU grid)"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny CPU grid (tiny model, torch engine)")
    parser.add_argument("--deltas", type=float, nargs="+", default=None, help="grid values of delta")
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=None, help="grid values of train_batch_size"
    )
    parser.add_argument("--max-concurrent-trials", type=int, default=None, help="default: 1 with --tiny")


def tiny_config(args: argparse.Namespace) -> FlashReinforceConfig:
    return (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0", env_config={"preset": "easy_sums"})
        .env_runners(
            num_env_runners=1,
            num_cpus_per_env_runner=0.5,
            engine="torch",
            episodes_in_flight_per_env_runner=8,
            max_new_tokens=16,
            max_episode_tokens=256,
            sample_timeout_s=300.0,
        )
        .learners(num_learners=0, num_cpus_per_learner=0.5)
        .training(model=os.path.join(os.path.abspath(args.output), "tiny_model"), lr=1e-5, train_batch_size=4)
        .resources(num_cpus_for_main_process=0.5)
        .reporting(tensorboard=True, console_every=1)
    )


def make_config(args: argparse.Namespace) -> FlashReinforceConfig:
    return tiny_config(args) if args.tiny else math_config(args)


def main(argv: list[str] | None = None) -> int:
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    probe.add_argument("--tiny", action="store_true")
    preset = TINY if probe.parse_known_args(argv)[0].tiny else SWEEP
    config, args = build_config(preset, make_config, argv, add_arguments=add_arguments, find_resume_checkpoint=False)
    base = TINY_GRID if args.tiny else GPU_GRID
    grid = {
        "delta": args.deltas or base["delta"],
        "train_batch_size": args.batch_sizes or base["train_batch_size"],
    }
    for values in itertools.product(*grid.values()):  # every trial's config must be valid
        code = validate_or_exit(config.copy().update_from_dict(dict(zip(grid, values))))
        if code:
            return code
    if args.dry_run:
        data = {label: getattr(args, dest, None) for label, dest in preset.data_args.items()}
        report = dry_run_report(preset, config, node_plan_from_args(args), grid=grid, data_paths=data)
        print(report.render(strict=args.strict))
        return report.exit_code(strict=args.strict)
    return sweep(config, grid, args)


def sweep(config: FlashReinforceConfig, grid: dict[str, list], args: argparse.Namespace) -> int:
    from ray import tune

    from flashrl.algorithms import FlashReinforce
    from flashrl.ray_utils import init_or_join

    if args.resume:  # Tune's own restore: finished trials kept, unfinished and errored ones resumed
        experiment = _experiment_to_resume(args)
        print(f"resuming the sweep in {experiment}", flush=True)
        init_or_join()
        tuner = tune.Tuner.restore(str(experiment), trainable=FlashReinforce, resume_unfinished=True,
                                   resume_errored=True)
        return _report(tuner.fit(), str(experiment.parent))
    output = os.path.abspath(args.output)
    if args.tiny and args.model is None:
        from flashrl.models import build_tiny_llama

        build_tiny_llama(config.model, seed=0)
    config.reporting(log_dir=None)  # each trial logs into its own Tune folder
    param_space = config.to_dict() | {k: tune.grid_search(v) for k, v in grid.items()}
    init_or_join()
    return _report(_new_tuner(param_space, output, args).fit(), output)


def _report(results, output: str) -> int:
    """The grid's table on the console and in `<output>/sweep_results.json`; 1 if any trial failed."""
    rows = []
    for result in results:
        metrics = result.metrics or {}
        rows.append(
            {
                "delta": result.config["delta"],
                "train_batch_size": result.config["train_batch_size"],
                "iterations": metrics.get("training_iteration"),
                "return_mean": metrics.get("env_runners/episode_return_mean"),
                "accepted_fraction": metrics.get("learners/accepted_fraction"),
                "error": str(result.error) if result.error else None,
            }
        )
    print(f"{'delta':>8} {'B':>5} {'iters':>5} {'return':>8} {'accepted':>8}")

    def num(value: float | None) -> float:
        return float("nan") if value is None else float(value)

    for row in rows:
        iters = "-" if row["iterations"] is None else str(row["iterations"])
        print(
            f"{row['delta']:>8g} {row['train_batch_size']:>5d} {iters:>5} "
            f"{num(row['return_mean']):>8.3f} {num(row['accepted_fraction']):>8.3f}"
            + (f"  ERROR {row['error']}" if row["error"] else "")
        )
    with open(os.path.join(output, "sweep_results.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=2)
    return 1 if any(row["error"] for row in rows) else 0


def _new_tuner(param_space: dict, output: str, args: argparse.Namespace):
    from ray import tune

    from flashrl.algorithms import FlashReinforce

    return tune.Tuner(
        FlashReinforce,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            max_concurrent_trials=args.max_concurrent_trials or (1 if args.tiny else None)
        ),
        run_config=tune.RunConfig(
            name="sweep", storage_path=output, stop={"training_iteration": args.stop_iters}, verbose=1,
            # every trial resumes (--resume) from its newest of 2 checkpoints, taken every 10 updates
            checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=10, num_to_keep=2),
        ),
    )


def _experiment_to_resume(args: argparse.Namespace) -> Path:
    """`--resume PATH` (a sweep folder), or `latest`: `<--output>/sweep`, else the newest sweep of this preset
    under the results root."""
    from ray import tune

    if args.resume != "latest":
        candidates = [Path(args.resume).expanduser()]
    elif args.output_given:
        candidates = [Path(args.output).expanduser() / "sweep"]
    else:
        root = Path(args.output).expanduser().parent  # <results root>/<preset>/<this run's time>
        candidates = sorted(root.glob("*/sweep"), reverse=True)
    for path in candidates:
        if tune.Tuner.can_restore(str(path.resolve())):
            return path.resolve()
    raise SystemExit(f"error: --resume: expected a Tune sweep folder to restore, found none in {candidates or root}")


if __name__ == "__main__":
    sys.exit(main())
