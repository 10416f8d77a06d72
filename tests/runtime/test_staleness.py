"""Bounded staleness: with async_queue_size = Q the policy lag never exceeds Q (Molt's meaning)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray


def _lags(algo, iterations: int) -> tuple[list[float], list[dict]]:
    results = [algo.train() for _ in range(iterations)]
    return [r["env_runners/policy_lag_max"] for r in results], results


@pytest.mark.timeout(900)
def test_async_queue_size_bounds_the_policy_lag(ray_session, tiny_config):
    # Two runners x (4 in flight + 4 buffered) run up to 4 batches of B = 4 ahead when unbounded.
    common = {"env": "flashrl-test/Parity-v0", "num_env_runners": 2, "tensorboard": False, "console_every": 0}
    unbounded = tiny_config(**common).build_algo()
    try:
        free_lags, _ = _lags(unbounded, 8)
    finally:
        unbounded.stop()
    assert max(free_lags) > 1  # the bound below is not vacuous on this workload

    q, b = 1, 4
    algo = tiny_config(**common, async_queue_size=q).build_algo()
    try:
        lags, results = _lags(algo, 8)
    finally:
        algo.stop()
    assert max(lags) <= q, lags
    for r in results:
        # The histogram shows every allowed lag; nothing lands beyond the bound.
        assert r["env_runners/policy_lag_hist/2"] == r["env_runners/policy_lag_hist/3"] == 0.0
        assert r["env_runners/policy_lag_hist/4+"] == 0.0
        # Admission: started, not trained, not dropped, not lost, not waiting for a later batch <= Q x B.
        skipped = sum(v for k, v in r.items() if k.startswith("env_runners/num_skipped_"))
        ahead = (
            r["env_runners/num_started_lifetime"] - r["env_runners/num_episodes_lifetime"] - skipped
            - r["env_runners/num_lost_episodes_lifetime"] - r["env_runners/num_pending_episodes"]
        )
        assert ahead <= q * b, r

