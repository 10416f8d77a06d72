"""Learning per rollout: FlashREINFORCE (B prompts x 1 rollout) vs the reference's GRPO (B/G prompts x G).

The task is the CPU main job's (`tuned_examples/smollm2_arithmetic_cpu.py`, imported, not copied):
SmolLM2-135M-Instruct learning easy sums a + b (a, b in 1..30), vLLM's CPU build sampling, held-out
greedy accuracy on sums the training stream never shows. Both methods take exactly B rollouts per
update, so at every update they have consumed the same rollout budget:

* `flash_reinforce`: the main job as it is (B distinct prompts, one rollout each, batch-mean baseline,
  token importance ratio, Sequence Trust Region, sample-mean, asynchronous collection);
* `grpo`: the reference's `grpo` variant (`qwen7b_tool`; fields derived by `benchmarks/_configs.py`
  through `flashrl.reproduction.translate`): B/G prompts x G = 4 rollouts, `baseline="group_norm"`,
  token-mean, no importance sampling, no trust region, `rollout_mode="sync_group"`.

Held-out accuracy is measured before training, every `--eval-every` updates and after the last, for
every seed; the report gives accuracy against rollouts trained on (mean and min..max over seeds),
the rollouts each seed needed to first reach `--target`, and flash/grpo ratios. Runs alternate
between the methods seed by seed, so slow drifts of a shared machine hit both alike.

Size of the full run (2 cores): B = 16 (the main job's), 30 updates = 480 rollouts per run, 64
held-out prompts (the main job's split) evaluated every 5 updates (7 evaluations), 3 seeds. Measured
on a quiet machine: 7-10 minutes per run (11-13 s per update), 49 minutes for 2 methods x 3 seeds;
the results are in `docs/benchmarks.md`. `--target 0.45`: the main job
(0.31 before training) passed it at about 20 updates (0.47) in its measured run.

    python benchmarks/learning_efficiency.py --seeds 0 1 2     # the full run, about 50 minutes
    python benchmarks/learning_efficiency.py --quick           # smoke: tiny random model, about 1 minute

Writes `benchmarks/results/learning_efficiency.json` (every setting and seed, every evaluation and
update) and `docs/figures/learning_efficiency.png`; `--quick` writes under the system temp folder
unless `--output` / `--figure` say otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from itertools import pairwise
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _configs import (
    FULL,
    QUICK,
    Scale,
    arithmetic_config,
    benchmark_model,
    reference_fields,
    reference_source,
    task_max_new_tokens,
)
from _figures import plot_curves, write_training_outputs
from _ray_setup import connect_ray
from _repo import FIGURES, MAIN_JOB, RESULTS
from _reports import config_record, fmt, fmt_spread, machine, table, write_json
from _run_log import RunLog
from _stats import ratio, run_summary, spread
from _training import run_updates

NAME = "learning_efficiency"
METHODS = ("flash_reinforce", "grpo")
BASELINE = "grpo"


def method_overrides(method: str, max_new_tokens: int) -> dict[str, Any]:
    """Config fields a method changes on the main job (FlashREINFORCE is the main job itself)."""
    return (
        {} if method == "flash_reinforce" else reference_fields(method, max_new_tokens=max_new_tokens)
    )


def rollouts_to_target(curve: list[dict[str, Any]], target: float) -> int | None:
    """Rollouts trained on at the first evaluation with accuracy >= target; None if never reached."""
    return next((p["rollouts"] for p in curve if p["accuracy"] >= target), None)


def curve_area(curve: list[dict[str, Any]]) -> float | None:
    """Mean accuracy over the rollout axis (trapezoids / rollouts): one number per learning curve."""
    if len(curve) < 2 or curve[-1]["rollouts"] <= 0:
        return None
    area = sum(
        (b["rollouts"] - a["rollouts"]) * (a["accuracy"] + b["accuracy"]) / 2 for a, b in pairwise(curve)
    )
    return area / curve[-1]["rollouts"]


def mean_curve(curves: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Seeds' curves point by point (same evaluation schedule): mean, std, min, max of the accuracy."""
    points = []
    for same in zip(*curves):
        stats = spread(p["accuracy"] for p in same)
        points.append(
            {"update": same[0]["update"], "rollouts": sum(p["rollouts"] for p in same) / len(same), **stats}
        )
    return points


def summarize(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for method in METHODS:
        mine = [r for r in runs if r["method"] == method]
        to_target = [rollouts_to_target(r["curve"], target) for r in mine]
        out[method] = {
            "seeds": [r["seed"] for r in mine],
            "initial_accuracy": spread(r["summary"]["initial_accuracy"] for r in mine),
            "final_accuracy": spread(r["summary"]["final_accuracy"] for r in mine),
            "curve_mean_accuracy": spread(curve_area(r["curve"]) for r in mine),
            "rollouts_to_target": spread(to_target),
            "rollouts_to_target_per_seed": to_target,
            "seeds_reaching_target": sum(t is not None for t in to_target),
            "accepted_fraction": spread(r["summary"]["accepted_fraction_mean"] for r in mine),
            "policy_lag_mean": spread(r["summary"]["policy_lag_mean"] for r in mine),
            "iteration_s": spread(r["summary"]["iteration_s_mean"] for r in mine),
            "curve": mean_curve([r["curve"] for r in mine]),
        }
    return out


def ratios(summary: dict[str, Any]) -> dict[str, float | None]:
    flash, grpo = summary["flash_reinforce"], summary[BASELINE]
    return {
        "final_accuracy_flash_over_grpo": ratio(
            flash["final_accuracy"]["mean"], grpo["final_accuracy"]["mean"]
        ),
        "curve_mean_accuracy_flash_over_grpo": ratio(
            flash["curve_mean_accuracy"]["mean"], grpo["curve_mean_accuracy"]["mean"]
        ),
        "rollouts_to_target_grpo_over_flash": ratio(
            grpo["rollouts_to_target"]["mean"], flash["rollouts_to_target"]["mean"]
        ),
    }


def render(summary: dict[str, Any], method_ratios: dict[str, float | None], target: float) -> str:
    headers = [
        "method",
        "initial acc",
        "final acc (min..max)",
        "mean acc over curve",
        f"rollouts to {target:g}",
        "seeds reaching",
        "s/update",
    ]
    rows = []
    for method in METHODS:
        s = summary[method]
        rows.append(
            [
                method,
                fmt_spread(s["initial_accuracy"]),
                fmt_spread(s["final_accuracy"]),
                fmt_spread(s["curve_mean_accuracy"]),
                fmt_spread(s["rollouts_to_target"], ".0f"),
                f"{s['seeds_reaching_target']}/{len(s['seeds'])}",
                fmt_spread(s["iteration_s"], ".1f"),
            ]
        )
    curve_rows = [
        [
            str(p["update"]),
            f"{p['rollouts']:.0f}",
            *(
                f"{summary[m]['curve'][i]['mean']:.3f} +- {summary[m]['curve'][i]['std']:.3f}"
                for m in METHODS
            ),
        ]
        for i, p in enumerate(summary["flash_reinforce"]["curve"])
    ]
    lines = [
        table(headers, rows),
        "",
        table(["update", "rollouts", *(f"{m} acc (mean +- std)" for m in METHODS)], curve_rows),
        "",
    ]
    lines += [f"{k}: {fmt(v, '.2f')}" for k, v in method_ratios.items()]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--quick", action="store_true", help="smoke size: tiny random model, B=4, 2 updates")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (quick: 0)")
    parser.add_argument("--model", default=None, help="'tiny' or a model spec (default: the scale's)")
    parser.add_argument("--batch-size", type=int, default=None, help="B, rollouts per update (both methods)")
    parser.add_argument("--updates", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--eval-episodes", type=int, default=None, help="held-out prompts per evaluation")
    parser.add_argument("--target", type=float, default=0.45, help="held-out accuracy to reach")
    parser.add_argument("--output", default=None, help="JSON report path")
    parser.add_argument("--figure", default=None, help="PNG path")
    parser.add_argument(
        "--tensorboard", default=None, help="TensorBoard log folder (default runs/benchmarks; quick: temp)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="keep the finished runs in <output>.runs.tmp, run the rest"
    )
    parser.add_argument(
        "--discard-log", action="store_true",
        help="without --resume: delete the finished runs of <output>.runs.tmp and start over (else refused)",
    )
    args = parser.parse_args(argv)
    quick_dir = Path(tempfile.gettempdir()) / "flashrl-bench-quick"
    args.seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    args.output = args.output or str((quick_dir if args.quick else RESULTS) / f"{NAME}.json")
    args.figure = args.figure or str((quick_dir if args.quick else FIGURES) / f"{NAME}.png")
    args.tensorboard = args.tensorboard or str(quick_dir / "tensorboard" if args.quick else "runs/benchmarks")
    return args


def scale_of(args: argparse.Namespace) -> Scale:
    scale = QUICK if args.quick else FULL
    given = {
        "model": args.model,
        "batch_size": args.batch_size,
        "updates": args.updates,
        "eval_every": args.eval_every,
        "eval_episodes": args.eval_episodes,
    }
    return dataclasses.replace(scale, **{k: v for k, v in given.items() if v is not None})


def check_budget(method: str, config: Any, batch_size: int) -> None:
    """Equal budgets: both methods must train on exactly B rollouts per update."""
    per_prompt = config.group_size if config.rollout_mode == "sync_group" else 1
    if config.prompts_per_batch * per_prompt != batch_size:
        raise ValueError(
            f"{method}: expected {batch_size} rollouts per update, got "
            f"{config.prompts_per_batch} prompts x {per_prompt}"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    scale = scale_of(args)
    max_new_tokens = task_max_new_tokens(scale)
    overrides = {m: method_overrides(m, max_new_tokens) for m in METHODS}
    log = RunLog(
        args.output,
        key_fields=("method", "seed"),
        settings={"scale": scale},
        resume=args.resume,
        discard=args.discard_log or args.quick,  # a --quick run is a throwaway smoke test
    )
    connected = connect_ray()
    runs, configs = [], {}
    try:
        with tempfile.TemporaryDirectory(prefix="flashrl-bench-") as tmp:
            model_path = benchmark_model(scale.model, tmp)
            for seed in args.seeds:
                for method in METHODS:
                    config = arithmetic_config(
                        scale, model_path=model_path, seed=seed, overrides=overrides[method]
                    )
                    check_budget(method, config, scale.batch_size)
                    configs.setdefault(method, config_record(config, model=scale.model))
                    done = log.get(method=method, seed=seed)
                    if done is not None:
                        print(f"{method}, seed {seed}: kept from {log.path}", flush=True)
                        runs.append(done)
                        continue
                    print(f"{method}, seed {seed}: {config.prompts_per_batch} prompts per update", flush=True)
                    run = run_updates(
                        config, updates=scale.updates, eval_every=scale.eval_every, label=f"{method}/s{seed}"
                    )
                    runs.append({"method": method, "seed": seed, **run, "summary": run_summary(run)})
                    log.add(runs[-1])
    finally:
        if connected:
            import ray

            ray.shutdown()
    summary = summarize(runs, args.target)
    method_ratios = ratios(summary)
    report = {
        "benchmark": NAME,
        "command": [
            "python",
            "benchmarks/learning_efficiency.py",
            *(argv if argv is not None else sys.argv[1:]),
        ],
        "settings": {
            "quick": args.quick,
            "seeds": args.seeds,
            "target": args.target,
            "scale": scale,
            "rollouts_per_update": scale.batch_size,
            "rollout_budget_per_run": scale.batch_size * scale.updates,
            "main_job": MAIN_JOB.as_posix(),
        },
        "methods": {
            m: {
                "overrides": overrides[m],
                "source": "the main job" if m == "flash_reinforce" else reference_source(m),
                "config": configs[m],
            }
            for m in METHODS
        },
        "runs": runs,
        "summary": summary,
        "ratios": method_ratios,
        "machine": machine(),
    }
    print()
    print(render(summary, method_ratios, args.target))
    print(f"wrote {write_json(args.output, report)}")
    curves = {m: summary[m]["curve"] for m in METHODS}
    title = f"{scale.model}: held-out accuracy vs rollouts (B={scale.batch_size}, {len(args.seeds)} seeds)"
    print(f"wrote {plot_curves(curves, args.figure, title=title, target=args.target)}")
    write_training_outputs(
        report,
        {m: [r["updates"] for r in runs if r["method"] == m] for m in METHODS},
        figure=args.figure,
        tensorboard=args.tensorboard,
        title=f"{scale.model}: the learner per update (B={scale.batch_size}, mean and min..max over seeds)",
    )
    return report


if __name__ == "__main__":
    main()
