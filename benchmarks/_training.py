"""A benchmark's training run: N updates, a held-out evaluation every k, the metrics of every update."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Mapping
from typing import Any

from _stats import generated_at

ACCURACY = "evaluation/episode_return_mean"
"""Held-out greedy accuracy: the main job's reward is 1 for a correct sum, 0 otherwise."""

ROW_METRICS = {
    "num_episodes": "num_episodes",
    "return_mean": "env_runners/batch_episode_return_mean",
    "accepted_fraction": "learners/accepted_fraction",
    "drift_mean": "learners/drift_mean",
    "drift_max": "learners/drift_max",
    "policy_lag_mean": "env_runners/policy_lag_mean",
    "policy_lag_max": "env_runners/policy_lag_max",
    "idle_fraction": "learners/idle_fraction",
    "trajectories_per_s": "learners/trajectories_per_s",
    "iteration_s": "timers/iteration_s",
    "sample_wait_s": "timers/sample_wait_s",
    "learner_update_s": "timers/learner_update_s",
    "weight_sync_s": "timers/weight_sync_s",
    "generated_tokens_per_s": "env_runners/generated_tokens_per_s",
    "started_lifetime": "env_runners/num_started_lifetime",
    "lost_lifetime": "env_runners/num_lost_episodes_lifetime",
    "skipped_stale_lifetime": "env_runners/num_skipped_stale_lifetime",
    "turns_mean": "env_runners/episode_turns_mean",
}
"""Short name in the report -> the `algo.train()` metric (docs/runtime.md, Metrics)."""
OPTIONAL_ROW_METRICS = {
    "tool_calls_mean": "env_runners/episode_info/tool_calls_mean",
    # the trained episodes' wall time on their runner, reset to last step (flashrl.env_runners.env_runner)
    "episode_s_mean": "env_runners/episode_info/duration_s_mean",
    "episode_s_min": "env_runners/episode_info/duration_s_min",
    "episode_s_max": "env_runners/episode_info/duration_s_max",
}
"""Recorded when the runners report them (tool calls: a tool env), None otherwise; never counted as missing."""
LAG_HIST = "env_runners/policy_lag_hist/"
SKIPPED = "env_runners/num_skipped_"


def _row(result: Mapping[str, Any], update: int, rollouts: int, missing: set[str]) -> dict[str, Any]:
    row: dict[str, Any] = {"update": update, "rollouts": rollouts}
    for short, key in ROW_METRICS.items():
        value = result.get(key)
        if value is None:
            missing.add(key)
        row[short] = None if value is None else float(value)
    for short, key in OPTIONAL_ROW_METRICS.items():
        row[short] = None if result.get(key) is None else float(result[key])
    by_reason = {k[len(SKIPPED):].removesuffix("_lifetime"): float(v) for k, v in result.items()
                 if k.startswith(SKIPPED) and k.endswith("_lifetime")}
    row["skipped_lifetime"] = sum(by_reason.values())
    row["skipped_by_reason"] = {k: v for k, v in sorted(by_reason.items()) if v}
    row["policy_lag_hist"] = {
        k[len(LAG_HIST) :]: float(v) for k, v in result.items() if k.startswith(LAG_HIST)
    }
    return row


def _evaluate(algo: Any, update: int, rollouts: int, generated: float | None) -> dict[str, Any]:
    return {"update": update, "rollouts": rollouts, "generated": generated, **evaluation_point(algo.evaluate())}


def evaluation_point(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """What a benchmark keeps of one held-out evaluation's metrics (`algo.evaluate()` or `run_evaluation`)."""
    return {
        "accuracy": float(metrics[ACCURACY]),
        "num_episodes": int(metrics.get("evaluation/num_episodes", 0)),
        "seconds": float(metrics.get("timers/evaluation_s", math.nan)),
        # what the agent did on the held-out episodes (flashrl.env_runners.evaluation)
        "turns_mean": _maybe(metrics, "evaluation/episode_turns_mean"),
        "tool_calls_mean": _maybe(metrics, "evaluation/episode_info/tool_calls_mean"),
        "truncated": _maybe(metrics, "evaluation/termination/truncated"),
    }


def _maybe(metrics: Mapping[str, Any], key: str) -> float | None:
    return None if metrics.get(key) is None else float(metrics[key])


def run_updates(
    config: Any,
    *,
    updates: int,
    eval_every: int | None,
    label: str,
    warmup: int = 0,
    until_generated: int | None = None,
) -> dict[str, Any]:
    """Build the algorithm, run `warmup + updates` iterations, evaluate, stop it.

    With `eval_every`, the held-out set is scored before the first update, after every `eval_every`
    updates and after the last. `rollouts` counts the trajectories trained on (the learner's
    budget); `started_lifetime` also counts those sampled but not (yet) trained on, and each
    evaluation's `generated` is what the runners had started by then (`_stats.generated_at`).
    With `until_generated`, the run ends after the first update at which that many have been
    started (`updates` is then an upper bound, an error if reached first).

    Returns:
        {"curve": [evaluations], "updates": [one row per measured update], "missing_metrics": [...],
         "wall_s": seconds from build to stop}
    """
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sync_group "comparison baseline" notice
        algo = config.build_algo()
    curve: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    missing: set[str] = set()
    rollouts = 0
    reached = False
    at_warmup_end = {"started_lifetime": 0.0, "skipped_lifetime": 0.0}
    try:
        if eval_every:
            curve.append(_evaluate(algo, 0, 0, 0.0))
        for i in range(1, warmup + updates + 1):
            result = algo.train()
            update = i - warmup
            if update <= 0:
                warm = _row(result, update, 0, set())
                at_warmup_end = {k: warm[k] or 0.0 for k in at_warmup_end}
                continue
            rollouts += int(result["num_episodes"])
            rows.append(_row(result, update, rollouts, missing))
            generated = generated_at(rows[-1], config.rollout_mode, at_warmup_end)
            reached = until_generated is not None and generated is not None and generated >= until_generated
            last = update == updates or reached
            if eval_every and (update % eval_every == 0 or last):
                curve.append(_evaluate(algo, update, rollouts, generated))
            accuracy = (
                f", held-out {curve[-1]['accuracy']:.3f}" if curve and curve[-1]["update"] == update else ""
            )
            skipped = ", ".join(f"{k} {v:g}" for k, v in rows[-1]["skipped_by_reason"].items())
            print(
                f"  {label} update {update}/{updates}: {result['timers/iteration_s']:.1f} s, "
                f"return {result.get('env_runners/batch_episode_return_mean', math.nan):.2f}{accuracy}"
                + (f", skipped so far: {skipped}" if skipped else ""),
                flush=True,
            )
            if last:
                break
        if until_generated is not None and not reached:
            raise RuntimeError(
                f"{label}: {updates} updates generated fewer than {until_generated} rollouts; raise the bound"
            )
    finally:
        algo.stop()
    return {
        "rollout_mode": config.rollout_mode,
        "curve": curve,
        "updates": rows,
        "warmup": warmup,
        "at_warmup_end": at_warmup_end,
        "missing_metrics": sorted(missing),
        "wall_s": time.perf_counter() - start,
    }
