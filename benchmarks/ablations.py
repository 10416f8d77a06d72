"""Does each component matter? The reference's ablations on the CPU main job's task, at one budget.

Every arm is the CPU main job (`tuned_examples/smollm2_arithmetic_cpu.py`: SmolLM2-135M-Instruct,
easy sums, held-out greedy accuracy, vLLM's CPU build) with the config fields of one variant of the
reference (`yifanzhang-pro/FlashREINFORCE`; derived by `benchmarks/_configs.py` through
`flashrl.reproduction.translate`, never retyped), and the same rollout budget (B rollouts x updates):

* `flash_reinforce`: the main job itself (sample-mean, token IS, trust region at its delta 0.05);
* `token_mean`, `constant_length`: the reference's reductions (`qwen7b_tool`); constant_length's
  L is the reference's L / max_new_tokens (6144 / 6144) times this task's max_new_tokens;
* `no_is`: no token importance sampling (`alfworld`'s variant; the gate is then inert);
* `negative_q09`: failed episodes train on their 90% highest-entropy tokens (`qwen7b_tool`);
* `flash_reinforce@Q4`, `flash_reinforce@Q8`: the reference's queue depths (`async_queue_size`
  4 of `qwen3_tool_ablation`, 8 of `r1`) with those settings' delta (0.003), and real lag: the
  runner keeps Q x B episodes in flight, so sampling runs the full Q batches ahead of the learner
  and episodes train up to Q versions after their weights;
* `no_trust@Q4`, `no_trust@Q8`: the same staleness without the trust region (`r1`'s no_trust,
  delta = inf); each is compared with the `flash_reinforce@Q` arm of its depth.

One table (and JSON, and a bar PNG): final held-out accuracy (mean and min..max over seeds), its
difference and ratio to the arm's baseline, the learner's accepted fraction, mean drift, mean and
max policy lag and the episodes dropped as stale, all from `algo.train()` metrics.

Size of a run (2 cores): the learning-efficiency budget (B = 16, 30 updates = 480 rollouts per
arm, 64 held-out prompts), evaluated before and after training, 9 arms per seed. Measured on a quiet
machine: about 8 minutes for each of the first five arms, 9 for each Q = 4 arm (64 episodes in
flight) and 11 for each Q = 8 arm (128), about 1.4 hours per seed; `--arms` runs a subset. The
committed report has seeds 0 and 1. Results: `docs/benchmarks.md`.

    python benchmarks/ablations.py                 # one seed, about 1.4 hours on 2 cores
    python benchmarks/ablations.py --quick         # smoke: tiny random model, every arm, about 2 minutes
    python benchmarks/ablations.py --seeds 0 1 2 --resume   # add seeds to the committed report
    python benchmarks/ablations.py --seeds 0 1 2 --report-only   # report what has run so far

`--resume` keeps the runs already made (the gitignored run log, or in a fresh clone the committed
report's runs) and runs the rest, seed by seed; `--report-only` runs nothing and writes the report
of the finished runs, listing the others under `missing` (each arm's seeds are in its summary).

Writes `benchmarks/results/ablations.json` and `docs/figures/ablations.png` (`--quick`: under the
system temp folder unless `--output` / `--figure` say otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _configs import (
    FULL,
    QUICK,
    STALENESS_SETTINGS,
    arithmetic_config,
    benchmark_model,
    reference_fields,
    reference_source,
    staleness_fields,
    task_max_new_tokens,
)
from _figures import plot_bars, write_training_outputs
from _ray_setup import connect_ray
from _repo import FIGURES, MAIN_JOB, RESULTS
from _reports import config_record, fmt, fmt_spread, machine, table, write_json
from _run_log import RunLog
from _stats import ratio, run_summary, spread
from _training import run_updates

NAME = "ablations"
QUEUE_SIZES = (4, 8)


@dataclass(frozen=True)
class Arm:
    """One ablation: config fields on top of the main job, where they come from, what it is compared with."""

    name: str
    overrides: dict[str, Any]
    source: str
    baseline: str | None


def make_arms(batch_size: int, max_new_tokens: int) -> list[Arm]:
    from flashrl.reproduction.experiments import EXPERIMENTS, REFERENCE

    def ref(variant: str) -> dict[str, Any]:
        return reference_fields(variant, max_new_tokens=max_new_tokens)

    arms = [Arm("flash_reinforce", {}, f"the main job ({MAIN_JOB.as_posix()})", None)]
    for variant in ("token_mean", "constant_length", "no_is", "negative_q09"):
        arms.append(Arm(variant, ref(variant), reference_source(variant), "flash_reinforce"))
    for q in QUEUE_SIZES:
        stale = staleness_fields(q, train_batch_size=batch_size)
        source = (
            f"{REFERENCE}: {EXPERIMENTS[STALENESS_SETTINGS[q]].source} (train.async_queue_size, "
            f"actor.flash_gate_delta); {q} x B episodes in flight"
        )
        arms.append(Arm(f"flash_reinforce@Q{q}", stale, source, None))
        arms.append(
            Arm(
                f"no_trust@Q{q}",
                stale | ref("no_trust"),
                f"{source}; {reference_source('no_trust')}",
                f"flash_reinforce@Q{q}",
            )
        )
    return arms


def describe(overrides: dict[str, Any]) -> str:
    short = {
        "episodes_in_flight_per_env_runner": "K",
        "async_queue_size": "Q",
        "negative_token_fraction": "q",
        "constant_length_normalizer": "L",
        "importance_sampling": "is",
    }
    return ", ".join(f"{short.get(k, k)}={v}" for k, v in overrides.items()) or "(main job)"


def summarize(arms: list[Arm], runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm.name]

        def over_seeds(key: str, mine: list[dict[str, Any]] = mine) -> dict[str, Any]:
            return spread(r["summary"][key] for r in mine)

        out[arm.name] = {
            "baseline": arm.baseline,
            "seeds": [r["seed"] for r in mine],
            "initial_accuracy": over_seeds("initial_accuracy"),
            "final_accuracy": over_seeds("final_accuracy"),
            "accepted_fraction": over_seeds("accepted_fraction_mean"),
            "drift_mean": over_seeds("drift_mean"),
            "drift_max": over_seeds("drift_max"),
            "policy_lag_mean": over_seeds("policy_lag_mean"),
            "policy_lag_max": over_seeds("policy_lag_max"),
            "stale_dropped": spread(r["updates"][-1]["skipped_stale_lifetime"] for r in mine),
            "iteration_s": over_seeds("iteration_s_mean"),
        }
    for arm in arms:
        s = out[arm.name]
        base = out.get(arm.baseline) if arm.baseline else None
        mean, base_mean = s["final_accuracy"]["mean"], base["final_accuracy"]["mean"] if base else None
        s["final_accuracy_minus_baseline"] = None if mean is None or base_mean is None else mean - base_mean
        s["final_accuracy_over_baseline"] = ratio(mean, base_mean)
    return out


def render(arms: list[Arm], summary: dict[str, Any]) -> str:
    headers = [
        "arm",
        "vs",
        "changes",
        "final acc (min..max)",
        "- base",
        "/ base",
        "accepted",
        "drift mean",
        "lag mean",
        "lag max",
        "stale dropped",
    ]
    rows = []
    for arm in arms:
        s = summary[arm.name]
        rows.append(
            [
                arm.name,
                arm.baseline or "-",
                describe(arm.overrides),
                fmt_spread(s["final_accuracy"]),
                fmt(s["final_accuracy_minus_baseline"], "+.3f"),
                fmt(s["final_accuracy_over_baseline"], ".2f"),
                fmt_spread(s["accepted_fraction"]),
                fmt_spread(s["drift_mean"], ".1e"),
                fmt_spread(s["policy_lag_mean"], ".2f"),
                fmt_spread(s["policy_lag_max"], ".0f"),
                fmt_spread(s["stale_dropped"], ".0f"),
            ]
        )
    return table(headers, rows)


def parse_args(argv: list[str] | None, arm_names: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--quick", action="store_true", help="smoke size: tiny random model, B=4, 2 updates")
    parser.add_argument(
        "--arms", nargs="+", choices=arm_names, default=None, help="default: all, in this order"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--model", default=None, help="'tiny' or a model spec (default: the scale's)")
    parser.add_argument("--batch-size", type=int, default=None, help="B, rollouts per update (every arm)")
    parser.add_argument("--updates", type=int, default=None)
    parser.add_argument("--eval-episodes", type=int, default=None, help="held-out prompts per evaluation")
    parser.add_argument("--output", default=None, help="JSON report path")
    parser.add_argument("--figure", default=None, help="PNG path")
    parser.add_argument(
        "--tensorboard", default=None, help="TensorBoard log folder (default runs/benchmarks; quick: temp)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the finished runs (<output>.runs.tmp, else the runs of <output> itself), run the rest",
    )
    parser.add_argument(
        "--discard-log", action="store_true",
        help="without --resume: delete the finished runs of <output>.runs.tmp and start over (else refused)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: report the finished runs (as --resume finds them), list the rest as missing",
    )
    args = parser.parse_args(argv)
    args.resume = args.resume or args.report_only
    quick_dir = Path(tempfile.gettempdir()) / "flashrl-bench-quick"
    args.output = args.output or str((quick_dir if args.quick else RESULTS) / f"{NAME}.json")
    args.figure = args.figure or str((quick_dir if args.quick else FIGURES) / f"{NAME}.png")
    args.tensorboard = args.tensorboard or str(quick_dir / "tensorboard" if args.quick else "runs/benchmarks")
    return args


ARM_NAMES = [
    "flash_reinforce",
    "token_mean",
    "constant_length",
    "no_is",
    "negative_q09",
    *(f"{name}@Q{q}" for q in QUEUE_SIZES for name in ("flash_reinforce", "no_trust")),
]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv, ARM_NAMES)
    scale = QUICK if args.quick else FULL
    given = {
        "model": args.model,
        "batch_size": args.batch_size,
        "updates": args.updates,
        "eval_episodes": args.eval_episodes,
    }
    scale = dataclasses.replace(scale, **{k: v for k, v in given.items() if v is not None})
    scale = dataclasses.replace(scale, eval_every=scale.updates)  # before and after training
    arms = make_arms(scale.batch_size, task_max_new_tokens(scale))
    assert [a.name for a in arms] == ARM_NAMES, [a.name for a in arms]
    if args.arms:
        arms = [a for a in arms if a.name in args.arms]
    log = RunLog(
        args.output, key_fields=("arm", "seed"), settings={"scale": scale}, resume=args.resume,
        discard=args.discard_log or args.quick,  # a --quick run is a throwaway smoke test
    )
    connected = False
    runs, configs, missing = [], {}, []
    try:
        with tempfile.TemporaryDirectory(prefix="flashrl-bench-") as tmp:
            model_path = benchmark_model(scale.model, tmp)
            for seed in args.seeds:
                for arm in arms:
                    config = arithmetic_config(
                        scale, model_path=model_path, seed=seed, overrides=arm.overrides
                    )
                    configs.setdefault(arm.name, config_record(config, model=scale.model))
                    done = log.get(arm=arm.name, seed=seed)
                    if done is not None:
                        print(f"{arm.name}, seed {seed}: kept from {log.path}", flush=True)
                        runs.append(done)
                        continue
                    if args.report_only:
                        print(f"{arm.name}, seed {seed}: not run yet (missing)", flush=True)
                        missing.append({"arm": arm.name, "seed": seed})
                        continue
                    connected = connect_ray() or connected
                    print(f"{arm.name}, seed {seed}: {describe(arm.overrides)}", flush=True)
                    run = run_updates(
                        config,
                        updates=scale.updates,
                        eval_every=scale.eval_every,
                        label=f"{arm.name}/s{seed}",
                    )
                    runs.append({"arm": arm.name, "seed": seed, **run, "summary": run_summary(run)})
                    log.add(runs[-1])
    finally:
        if connected:
            import ray

            ray.shutdown()
    arms = [a for a in arms if any(r["arm"] == a.name for r in runs)]  # --report-only: what ran
    if not runs:
        raise SystemExit(
            f"--report-only: no finished run for these arms and seeds in {log.path} or {args.output}"
        )
    summary = summarize(arms, runs)
    report = {
        "benchmark": NAME,
        "command": ["python", "benchmarks/ablations.py", *(argv if argv is not None else sys.argv[1:])],
        "settings": {
            "quick": args.quick,
            "seeds": args.seeds,
            "scale": scale,
            "rollout_budget_per_run": scale.batch_size * scale.updates,
            "main_job": MAIN_JOB.as_posix(),
        },
        "arms": {a.name: {**dataclasses.asdict(a), "config": configs[a.name]} for a in arms},
        "runs": runs,
        "missing": missing,
        "summary": summary,
        "machine": machine(),
    }
    print()
    print(render(arms, summary))
    print(f"wrote {write_json(args.output, report)}")
    names = [a.name for a in arms]
    panels = [
        (label, names, [summary[n][key] for n in names])
        for label, key in (
            ("final held-out accuracy", "final_accuracy"),
            ("accepted fraction", "accepted_fraction"),
            ("mean drift (Bernoulli KL)", "drift_mean"),
            ("mean policy lag", "policy_lag_mean"),
        )
    ]
    title = (
        f"{scale.model}: ablations at {scale.batch_size * scale.updates} rollouts ({len(args.seeds)} seed(s))"
    )
    print(f"wrote {plot_bars(panels, args.figure, title=title)}")
    write_training_outputs(
        report,
        {n: [r["updates"] for r in runs if r["arm"] == n] for n in names},
        figure=args.figure,
        tensorboard=args.tensorboard,
        title=f"{scale.model}: the learner per update, every arm ({len(args.seeds)} seed(s))",
    )
    return report


if __name__ == "__main__":
    main()
