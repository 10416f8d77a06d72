"""The run summaries, by hand: spreads over seeds, the policy-lag distribution, the curve measures."""

from __future__ import annotations

import math

import pytest
from _stats import lag_distribution, spread


def test_summaries_by_hand(bench):
    s = spread([1.0, 2.0, None, 4.0])
    assert s["n"] == 3 and (s["min"], s["max"]) == (1.0, 4.0)
    assert s["mean"] == pytest.approx(7 / 3) and s["std"] == pytest.approx(math.sqrt(14 / 9))
    assert spread([None])["mean"] is None
    rows = [
        {"num_episodes": 4, "policy_lag_hist": {"0": 0.5, "1": 0.5, "2": 0.0}},
        {"num_episodes": 12, "policy_lag_hist": {"0": 0.25, "1": 0.25, "2": 0.5}},
    ]
    assert lag_distribution(rows) == {"0": 0.3125, "1": 0.3125, "2": 0.375}
    le = bench("learning_efficiency")
    curve = [{"rollouts": r, "accuracy": a} for r, a in ((0, 0.3), (16, 0.4), (32, 0.5), (48, 0.45))]
    assert le.rollouts_to_target(curve, 0.45) == 32
    assert le.rollouts_to_target(curve, 0.6) is None
    assert le.curve_area(curve) == pytest.approx((16 * 0.35 + 16 * 0.45 + 16 * 0.475) / 48)


def test_update_row_counts_drops_by_reason():
    from _training import _row

    result = {"env_runners/num_skipped_env_timeout_lifetime": 3.0, "env_runners/num_skipped_stale_lifetime": 1.0,
              "env_runners/num_skipped_empty_lifetime": 0.0, "env_runners/num_started_lifetime": 20.0}
    missing: set[str] = set()
    row = _row(result, update=1, rollouts=16, missing=missing)
    assert row["skipped_lifetime"] == 4.0
    assert row["skipped_by_reason"] == {"env_timeout": 3.0, "stale": 1.0}  # reasons never seen are left out
    assert row["started_lifetime"] == 20.0 and "timers/iteration_s" in missing
