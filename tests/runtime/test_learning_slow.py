"""Slow: SmolLM2-135M-Instruct learns easy sums through the full asynchronous pipeline on CPU.

About 10-15 minutes on 2 cores. Greedy accuracy on a fixed set of held-out sums (the evaluation
stream) must rise over a short run: the bare single-process loop went 0.47 -> 0.72 in 30 updates.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_smollm2_reward_rises_on_easy_sums(ray_session, smollm2_path, tmp_path):
    from flashrl.algorithms import FlashReinforceConfig

    config = (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0", env_config={"preset": "easy_sums"})
        .env_runners(
            num_env_runners=1,
            num_cpus_per_env_runner=1.0,
            engine="torch",
            episodes_in_flight_per_env_runner=16,
            max_new_tokens=24,
            max_episode_tokens=512,
            sample_timeout_s=600.0,
        )
        .training(model=smollm2_path, train_batch_size=16, lr=3e-6, delta=0.05, grad_clip=1.0)
        .evaluation(evaluation_num_episodes=64, evaluation_temperature=0.0)
        .reporting(log_dir=str(tmp_path / "tb"))
        .debugging(seed=0)
    )
    algo = config.build_algo()
    try:
        before = algo.evaluate()["evaluation/episode_return_mean"]
        results = [algo.train() for _ in range(30)]
        after = algo.evaluate()["evaluation/episode_return_mean"]
    finally:
        algo.stop()
    assert all(r["learners/applied"] == 1.0 for r in results)
    assert results[-1]["learners/version"] == 30
    assert after >= before + 0.1, (before, after)
