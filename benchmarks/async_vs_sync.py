"""Async one-rollout-per-prompt (FlashREINFORCE) vs the synchronous group baseline, same pipeline.

Both modes run the real pipeline: EnvRunner actors with engines, the Math env, the learner. The
workload has long-tailed episode durations: every env step waits a lognormal "tool latency"
(median `--latency-median-s`, 2 s by default; sigma `--latency-sigma`, 1), as agentic tools do. Same
runners, same episodes in flight per runner, same batch size B, same number of iterations, i.e. the
same rollout budget into the learner:

* async: each iteration takes the next B finished episodes of B distinct prompts;
* sync_group: each iteration plays B/G prompts x G rollouts (G = 8) and waits for all of them.

Reported (first `--warmup` iterations excluded): trajectories per second into the learner, learner
idle fraction, policy-lag distribution, the async/sync ratios; a table on stdout and JSON at
`--output`. Goal: >= 3x trajectories/s and learner idle < 10% in async mode.

    python benchmarks/async_vs_sync.py                     # tiny random model, about 3-5 minutes on 2 cores
    python benchmarks/async_vs_sync.py --model smollm2-135m-instruct --iterations 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile
import time
from typing import Any

import gymnasium as gym
import numpy as np

LATENCY_ENV = "flashrl-bench/LatencyMath-v0"


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


def _config(args: argparse.Namespace, model: str, mode: str) -> Any:
    from flashrl.algorithms import FlashReinforceConfig

    config = (
        FlashReinforceConfig()
        .environment(LATENCY_ENV, env_config={"median_s": args.latency_median_s, "sigma": args.latency_sigma})
        .env_runners(
            num_env_runners=args.num_env_runners,
            num_cpus_per_env_runner=args.num_cpus_per_env_runner,
            engine=args.engine,
            episodes_in_flight_per_env_runner=args.in_flight,
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


def _run(args: argparse.Namespace, model: str, mode: str) -> dict[str, Any]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sync_group "comparison baseline" notice
        algo = _config(args, model, mode).build_algo()
    try:
        results = []
        for i in range(args.warmup + args.iterations):
            r = algo.train()
            print(f"  {mode:<10s} iter {i + 1:>2d}: {r['num_episodes']} episodes in {r['timers/iteration_s']:.2f} s, "
                  f"idle {100 * r['learners/idle_fraction']:.0f}%", flush=True)
            if i >= args.warmup:
                results.append(r)
    finally:
        algo.stop()
    wall = sum(r["timers/iteration_s"] for r in results)
    episodes = sum(r["num_episodes"] for r in results)
    wait = sum(r["timers/sample_wait_s"] for r in results)
    lag_keys = ["0", "1", "2", "3", "4+"]
    lag_hist = {k: float(np.mean([r[f"env_runners/policy_lag_hist/{k}"] for r in results])) for k in lag_keys}
    return {
        "mode": mode,
        "iterations": len(results),
        "episodes_into_learner": episodes,
        "wall_s": wall,
        "trajectories_per_s": episodes / wall,
        "learner_idle_fraction": wait / wall,
        "learner_update_s_mean": float(np.mean([r["timers/learner_update_s"] for r in results])),
        "iteration_s_mean": float(np.mean([r["timers/iteration_s"] for r in results])),
        "policy_lag_mean": float(np.mean([r["env_runners/policy_lag_mean"] for r in results])),
        "policy_lag_hist": lag_hist,
        "generated_tokens_per_s": float(np.mean([r["env_runners/generated_tokens_per_s"] for r in results])),
        "lost_episodes": int(results[-1]["env_runners/num_lost_episodes_lifetime"]),
    }


def _model(args: argparse.Namespace) -> str:
    from flashrl.models import build_tiny_llama, resolve_model

    if args.model != "tiny":
        return resolve_model(args.model)
    out = os.path.join(tempfile.mkdtemp(prefix="flashrl-bench-"), "tiny")
    return build_tiny_llama(out, seed=0, tokenizer_source=resolve_model("smollm2-135m-instruct"))


def _table(runs: dict[str, dict[str, Any]], ratios: dict[str, float]) -> str:
    a, s = runs["async"], runs["sync_group"]
    rows = [
        ("trajectories/s into learner", a["trajectories_per_s"], s["trajectories_per_s"],
         ratios["trajectories_per_s"], "{:.2f}"),
        ("learner idle fraction", a["learner_idle_fraction"], s["learner_idle_fraction"],
         ratios["learner_idle_fraction"], "{:.1%}"),
        ("iteration time (s)", a["iteration_s_mean"], s["iteration_s_mean"], ratios["iteration_s"], "{:.2f}"),
        ("learner update (s)", a["learner_update_s_mean"], s["learner_update_s_mean"], None, "{:.2f}"),
        ("policy lag mean", a["policy_lag_mean"], s["policy_lag_mean"], None, "{:.2f}"),
        ("generated tokens/s", a["generated_tokens_per_s"], s["generated_tokens_per_s"], None, "{:.1f}"),
    ]
    lines = [f"{'metric':<30s} {'async':>10s} {'sync_group':>12s} {'async/sync':>11s}", "-" * 66]
    for name, x, y, ratio, fmt in rows:
        r = f"{ratio:.2f}x" if ratio is not None and math.isfinite(ratio) else "-"
        lines.append(f"{name:<30s} {fmt.format(x):>10s} {fmt.format(y):>12s} {r:>11s}")
    hist = " ".join(f"{k}:{v:.2f}" for k, v in a["policy_lag_hist"].items())
    lines.append(f"async policy-lag histogram (fraction of episodes by versions behind): {hist}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny' (random weights) or a model spec/folder")
    parser.add_argument("--engine", default="torch", choices=["torch", "vllm"])
    parser.add_argument("--num-env-runners", type=int, default=2)
    parser.add_argument("--num-cpus-per-env-runner", type=float, default=0.5)
    parser.add_argument("--in-flight", type=int, default=16, help="episodes in flight per runner (K)")
    parser.add_argument("--batch-size", type=int, default=16, help="B")
    parser.add_argument("--group-size", type=int, default=8, help="G of the sync_group baseline")
    parser.add_argument("--iterations", type=int, default=6, help="measured iterations per mode")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--latency-median-s", type=float, default=2.0)
    parser.add_argument("--latency-sigma", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=os.path.join("benchmarks", "results", "async_vs_sync.json"))
    args = parser.parse_args()

    import ray

    from flashrl.ray_utils import init_or_join

    if LATENCY_ENV not in gym.registry:
        gym.register(LATENCY_ENV, entry_point=LatencyMath)
    init_or_join(runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}, log_to_driver=False)
    model = _model(args)
    runs = {}
    for mode in ("async", "sync_group"):
        print(f"running {mode} ...", flush=True)
        runs[mode] = _run(args, model, mode)
    a, s = runs["async"], runs["sync_group"]
    ratios = {
        "trajectories_per_s": a["trajectories_per_s"] / s["trajectories_per_s"],
        "learner_idle_fraction": a["learner_idle_fraction"] / s["learner_idle_fraction"]
        if s["learner_idle_fraction"] > 0 else float("nan"),
        "iteration_s": a["iteration_s_mean"] / s["iteration_s_mean"],
    }
    report = {
        "benchmark": "async_vs_sync",
        "settings": vars(args) | {"model_path": model},
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "runs": runs,
        "ratios_async_over_sync": ratios,
        "goals": {
            "trajectories_per_s_ratio_ge_3": ratios["trajectories_per_s"] >= 3.0,
            "async_learner_idle_lt_10pct": a["learner_idle_fraction"] < 0.10,
        },
    }
    print()
    print(_table(runs, ratios))
    print(f"goals: {report['goals']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.output}")
    ray.shutdown()


if __name__ == "__main__":
    main()
