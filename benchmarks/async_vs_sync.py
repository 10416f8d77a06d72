"""Async one-rollout-per-prompt (FlashREINFORCE) vs the synchronous group baseline, same pipeline, fair.

Both modes run the real pipeline: EnvRunner actors with engines, the Math env, the learner. The
workload has long-tailed episode durations: every env step waits a lognormal "tool latency"
(median `--latency-median-s`, 2 s by default; sigma `--latency-sigma`, 1), as agentic tools do.
The two modes get the same resources and the same work:

* the same runners (`--num-env-runners`, the same CPUs each) and the same engine and model;
* the same number of episodes in flight: B in total (B / N per runner) in both modes. A
  sync_group round has exactly B episodes (B/G prompts x G, the prompts spread evenly over the
  runners), so async gets no more concurrency than sync can use;
* the same rollout budget: batch size B and `--iterations` measured updates in both, i.e. the
  same trajectories into the learner (after `--warmup` unmeasured ones).

The difference is only the collection: async takes the next B finished episodes of B distinct
prompts (the rest keep running through the update), sync_group waits for its whole round (the
straggler barrier) and loads the new weights before the next.

Reported (measured iterations only): trajectories per second into the learner, learner idle
fraction, iteration time, the policy-lag distribution of each mode, the async/sync ratios; a table
on stdout and JSON at `--output`.

    python benchmarks/async_vs_sync.py            # the full run: tiny random model, about 4 minutes
    python benchmarks/async_vs_sync.py --model smollm2-135m-instruct --iterations 8   # about 10 minutes
    python benchmarks/async_vs_sync.py --quick    # smoke: 0.05 s latencies, 2 iterations, about 1 minute
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _configs import benchmark_model
from _ray_setup import connect_ray
from _repo import RESULTS
from _reports import config_record, fmt, machine, table, write_json
from _stats import lag_distribution, mean_of, ratio, rollouts_sampled
from _training import run_updates

NAME = "async_vs_sync"
LATENCY_ENV = "flashrl-bench/LatencyMath-v0"
MODES = ("async", "sync_group")


class LatencyMath(gym.Wrapper):
    """`flashrl/Math-v0` whose every step first waits a lognormal tool latency (a long tail)."""

    def __init__(self, median_s: float = 1.0, sigma: float = 1.0, **math_kwargs: Any) -> None:
        import flashrl.envs  # noqa: F401 - registers flashrl/Math-v0

        super().__init__(gym.make("flashrl/Math-v0", **math_kwargs).unwrapped)
        self.median_s, self.sigma = median_s, sigma
        # Independent of the reset seed: the G rollouts of a prompt share that seed, but a tool's
        # latency does not repeat across rollouts.
        self._latency_rng = np.random.default_rng()

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        return self.env.reset(seed=seed, options=options)

    def step(self, action: str):
        time.sleep(float(self._latency_rng.lognormal(math.log(self.median_s), self.sigma)))
        return self.env.step(action)


def check_fair(args: argparse.Namespace) -> None:
    """B episodes in flight in both modes needs B/N per runner and B/G prompts spread evenly."""
    b, g, n = args.batch_size, args.group_size, args.num_env_runners
    problems = []
    if b % g:
        problems.append(f"--batch-size {b} must be a multiple of --group-size {g}")
    elif (b // g) % n:
        problems.append(
            f"the B/G = {b // g} prompts of a sync round must spread evenly over the {n} runners "
            f"(a multiple of --num-env-runners)"
        )
    if b % n:
        problems.append(
            f"--batch-size {b} must be a multiple of --num-env-runners {n} (B/N in flight per runner)"
        )
    if problems:
        raise SystemExit(
            "unfair comparison: " + "; ".join(problems) + ". Fix: e.g. --batch-size 16 "
            "--group-size 8 --num-env-runners 2."
        )


def make_config(args: argparse.Namespace, model: str, mode: str) -> Any:
    from flashrl.algorithms import FlashReinforceConfig

    config = (
        FlashReinforceConfig()
        .environment(LATENCY_ENV, env_config={"median_s": args.latency_median_s, "sigma": args.latency_sigma})
        .env_runners(
            num_env_runners=args.num_env_runners,
            num_cpus_per_env_runner=args.num_cpus_per_env_runner,
            engine=args.engine,
            episodes_in_flight_per_env_runner=args.batch_size // args.num_env_runners,
            max_new_tokens=args.max_new_tokens,
            max_episode_tokens=512,
            sample_timeout_s=600.0,
        )
        .learners(num_learners=0)
        .training(model=model, train_batch_size=args.batch_size, lr=1e-5, delta=1.0)
        .reporting(tensorboard=False, console_every=0)
        .debugging(seed=args.seed)
    )
    if mode == "sync_group":
        config.training(rollout_mode="sync_group", group_size=args.group_size)
    return config


def mode_summary(mode: str, run: dict[str, Any]) -> dict[str, Any]:
    rows = run["updates"]
    wall = sum(r["iteration_s"] for r in rows)
    episodes = sum(r["num_episodes"] for r in rows)
    return {
        "mode": mode,
        "iterations": len(rows),
        "episodes_into_learner": episodes,
        "episodes_sampled": rollouts_sampled(run),
        "wall_s": wall,
        "trajectories_per_s": episodes / wall,
        "learner_idle_fraction": sum(r["sample_wait_s"] for r in rows) / wall,
        "learner_update_s_mean": mean_of(rows, "learner_update_s"),
        "iteration_s_mean": mean_of(rows, "iteration_s"),
        "policy_lag_mean": mean_of(rows, "policy_lag_mean"),
        "policy_lag_max": max(r["policy_lag_max"] for r in rows),
        "policy_lag_distribution": lag_distribution(rows),
        "generated_tokens_per_s": mean_of(rows, "generated_tokens_per_s"),
        "lost_episodes": rows[-1]["lost_lifetime"],
    }


def render(runs: dict[str, dict[str, Any]], ratios: dict[str, float | None]) -> str:
    a, s = runs["async"], runs["sync_group"]
    specs = [
        ("trajectories/s into learner", "trajectories_per_s", "trajectories_per_s", ".2f"),
        ("learner idle fraction", "learner_idle_fraction", "learner_idle_fraction", ".1%"),
        ("iteration time (s)", "iteration_s_mean", "iteration_s", ".2f"),
        ("learner update (s)", "learner_update_s_mean", "learner_update_s", ".2f"),
        ("episodes into learner", "episodes_into_learner", None, ".0f"),
        ("episodes sampled", "episodes_sampled", None, ".0f"),
        ("policy lag mean", "policy_lag_mean", None, ".2f"),
        ("policy lag max", "policy_lag_max", None, ".0f"),
        ("generated tokens/s", "generated_tokens_per_s", "generated_tokens_per_s", ".1f"),
    ]
    rows = [
        [
            name,
            fmt(a[key], spec),
            fmt(s[key], spec),
            f"{ratios[r]:.2f}x" if r and ratios.get(r) is not None else "-",
        ]
        for name, key, r, spec in specs
    ]
    lines = [table(["metric", "async", "sync_group", "async/sync"], rows)]
    for mode in MODES:
        hist = " ".join(f"{k}:{v:.2f}" for k, v in runs[mode]["policy_lag_distribution"].items())
        lines.append(f"{mode} policy lag (fraction of trained episodes by versions behind): {hist}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke: B=8, G=4, 0.05 s latencies, 2 iterations"
    )
    parser.add_argument("--model", default="tiny", help="'tiny' (random weights) or a model spec/folder")
    parser.add_argument("--engine", default="torch", choices=["torch", "vllm"])
    parser.add_argument("--num-env-runners", type=int, default=2)
    parser.add_argument("--num-cpus-per-env-runner", type=float, default=0.5)
    parser.add_argument("--batch-size", type=int, default=None, help="B (default 16; quick 8); B in flight")
    parser.add_argument(
        "--group-size", type=int, default=None, help="G of the sync_group baseline (default 8; quick 4)"
    )
    parser.add_argument(
        "--iterations", type=int, default=None, help="measured iterations per mode (default 8)"
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--latency-median-s", type=float, default=None, help="default 2.0 (quick 0.05)")
    parser.add_argument("--latency-sigma", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="JSON report path")
    args = parser.parse_args(argv)
    quick = {"batch_size": 8, "group_size": 4, "iterations": 2, "latency_median_s": 0.05}
    full = {"batch_size": 16, "group_size": 8, "iterations": 8, "latency_median_s": 2.0}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    quick_dir = Path(tempfile.gettempdir()) / "flashrl-bench-quick"
    args.output = args.output or str((quick_dir if args.quick else RESULTS) / f"{NAME}.json")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    check_fair(args)
    if LATENCY_ENV not in gym.registry:
        gym.register(LATENCY_ENV, entry_point=LatencyMath)
    connected = connect_ray()
    runs, configs = {}, {}
    try:
        with tempfile.TemporaryDirectory(prefix="flashrl-bench-") as tmp:
            model = benchmark_model(args.model, tmp)
            for mode in MODES:
                print(f"running {mode} ...", flush=True)
                config = make_config(args, model, mode)
                configs[mode] = config_record(config, model=args.model)
                run = run_updates(
                    config, updates=args.iterations, eval_every=None, label=mode, warmup=args.warmup
                )
                runs[mode] = {
                    **mode_summary(mode, run),
                    "updates": run["updates"],
                    "missing_metrics": run["missing_metrics"],
                }
    finally:
        if connected:
            import ray

            ray.shutdown()
    a, s = runs["async"], runs["sync_group"]
    ratios = {
        key: ratio(a[key], s[key])
        for key in ("trajectories_per_s", "learner_idle_fraction", "generated_tokens_per_s")
    }
    ratios["iteration_s"] = ratio(a["iteration_s_mean"], s["iteration_s_mean"])
    ratios["learner_update_s"] = ratio(a["learner_update_s_mean"], s["learner_update_s_mean"])
    report = {
        "benchmark": NAME,
        "command": ["python", "benchmarks/async_vs_sync.py", *(argv if argv is not None else sys.argv[1:])],
        "settings": vars(args)
        | {
            "episodes_in_flight_total": args.batch_size,
            "episodes_in_flight_per_env_runner": args.batch_size // args.num_env_runners,
        },
        "configs": configs,
        "runs": runs,
        "ratios_async_over_sync": ratios,
        "goals": {
            "trajectories_per_s_ratio_ge_3": ratios["trajectories_per_s"] is not None
            and ratios["trajectories_per_s"] >= 3.0,
            "async_learner_idle_lt_10pct": a["learner_idle_fraction"] < 0.10,
        },
        "machine": machine(),
    }
    print()
    print(render(runs, ratios))
    print(f"goals: {report['goals']}")
    print(f"wrote {write_json(args.output, report)}")
    return report


if __name__ == "__main__":
    main()
