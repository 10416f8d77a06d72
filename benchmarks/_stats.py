"""Summaries of finished runs: spreads over seeds, means over updates, the policy-lag distribution."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def spread(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """Mean, population std, min and max of the values that are not None (n of them)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    m = sum(xs) / len(xs)
    return {
        "mean": m,
        "std": math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs)),
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
    }


def mean_of(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def lag_distribution(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Fraction of trained episodes per policy-lag bucket over all rows (weighted by episodes)."""
    total = sum(r["num_episodes"] or 0 for r in rows)
    keys = sorted({k for r in rows for k in r["policy_lag_hist"]}, key=lambda k: int(k.rstrip("+")))
    return {
        k: sum(r["policy_lag_hist"].get(k, 0.0) * (r["num_episodes"] or 0) for r in rows) / max(1, total)
        for k in keys
    }


def generated_at(row: Mapping[str, Any], rollout_mode: str, at_warmup_end: Mapping[str, Any]) -> float | None:
    """Training episodes the runners started from the warmup's end up to this update's row.

    Async: trained + dropped + still in flight or pending. `env_runners/num_started_lifetime` counts
    the async stream only (it stays 0 in sync_group mode, where every episode sampled is trained on or
    dropped and counted): sync_group's are the trained plus the dropped ones.
    """
    if row.get("started_lifetime") is None:
        return None
    if rollout_mode == "async":
        return row["started_lifetime"] - at_warmup_end["started_lifetime"]
    return row["rollouts"] + row["skipped_lifetime"] - at_warmup_end["skipped_lifetime"]


def rollouts_sampled(run: Mapping[str, Any]) -> float | None:
    """Training episodes the runners started during the measured updates (after the warmup):
    `generated_at` the last update."""
    rows = run["updates"]
    return generated_at(rows[-1], run["rollout_mode"], run["at_warmup_end"]) if rows else None


def run_summary(run: Mapping[str, Any]) -> dict[str, Any]:
    """One run's training-side means: accepted fraction, drift, lag, time per update."""
    rows = run["updates"]
    return {
        "accepted_fraction_mean": mean_of(rows, "accepted_fraction"),
        "drift_mean": mean_of(rows, "drift_mean"),
        "drift_max": max((r["drift_max"] for r in rows if r["drift_max"] is not None), default=None),
        "policy_lag_mean": mean_of(rows, "policy_lag_mean"),
        "policy_lag_max": max(
            (r["policy_lag_max"] for r in rows if r["policy_lag_max"] is not None), default=None
        ),
        "policy_lag_distribution": lag_distribution(rows),
        "iteration_s_mean": mean_of(rows, "iteration_s"),
        "rollouts_trained": rows[-1]["rollouts"] if rows else 0,
        "rollouts_sampled": rollouts_sampled(run),
        "initial_accuracy": run["curve"][0]["accuracy"] if run["curve"] else None,
        "final_accuracy": run["curve"][-1]["accuracy"] if run["curve"] else None,
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator
