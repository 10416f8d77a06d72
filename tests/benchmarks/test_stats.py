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
