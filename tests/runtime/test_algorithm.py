"""FlashReinforce end to end through real Ray actors on CPU: the tiny model, the torch engine."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from flashrl.algorithms import FlashReinforce
from flashrl.algorithms.flash_reinforce.config import ConfigError

pytestmark = pytest.mark.ray

B = 4


@pytest.fixture(scope="module")
def async_algo(ray_session, tiny_llama_path, tmp_path_factory):
    from flashrl.algorithms import FlashReinforceConfig

    config = (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0", env_config={"preset": "easy_sums"})
        .env_runners(
            num_env_runners=2,
            num_cpus_per_env_runner=0.5,
            engine="torch",
            episodes_in_flight_per_env_runner=4,
            max_new_tokens=8,
            max_episode_tokens=256,
            sample_timeout_s=120.0,
        )
        .training(model=tiny_llama_path, train_batch_size=B, lr=1e-3, delta=1.0)
        .reporting(log_dir=str(tmp_path_factory.mktemp("tb")))
    )
    algo = config.build_algo()
    yield algo
    algo.stop()


def test_async_iterations_advance_versions_and_report_metrics(async_algo):
    results = [async_algo.train() for _ in range(3)]
    for i, r in enumerate(results, start=1):
        assert r["training_iteration"] == i
        assert r["learners/version"] == i  # exactly one update per iteration
        assert r["learners/applied"] == 1.0
        assert r["num_episodes"] == B
        assert r["env_runners/batch_num_distinct_prompts"] == B  # B different prompts
        assert r["learners/episodes"] == B
        assert 0.0 <= r["learners/accepted_fraction"] <= 1.0
        assert 0.0 <= r["learners/idle_fraction"] <= 1.0
        assert r["env_runners/generated_tokens_per_s"] > 0
        hist = [r[f"env_runners/policy_lag_hist/{k}"] for k in ("0", "1", "2", "3", "4+")]
        assert sum(hist) == pytest.approx(1.0)
        assert r["timers/iteration_s"] >= r["timers/learner_update_s"] > 0
        for key in ("learners/drift_mean", "learners/drift_max", "learners/ratio_mean", "learners/ratio_max",
                    "env_runners/episode_return_mean", "timers/sample_wait_s", "timers/weight_sync_s"):
            assert key in r
    assert results[0]["env_runners/policy_lag_max"] == 0  # nothing older than version 0 exists yet
    assert results[-1]["env_runners/num_episodes_lifetime"] == 3 * B
    # TensorBoard: scalars and the histograms were written.
    events = glob.glob(os.path.join(async_algo.algo_config.log_dir, "events.out.tfevents.*"))
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(async_algo.algo_config.log_dir, size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    assert len(acc.Scalars("learners/accepted_fraction")) == 3
    assert {"hist/policy_lag", "hist/episode_len"} <= set(acc.Tags()["histograms"])


def test_dead_runner_is_restarted_and_the_books_balance(async_algo):
    async_algo.env_runner_group.kill(0)
    # The death shows up at the next failed poll or weight update; the run goes on meanwhile.
    for iteration in range(4, 8):
        r = async_algo.train()
        if r["env_runners/num_restarts_lifetime"]:
            break
    assert r["env_runners/num_restarts_lifetime"] == 1
    assert r["learners/version"] == iteration
    r = async_algo.train()  # the restarted runner takes part
    assert r["learners/version"] == iteration + 1
    skipped = sum(v for k, v in r.items() if k.startswith("env_runners/num_skipped_"))
    # Every started episode is trained on, pending, dropped with a reason, lost, or still running.
    assert r["env_runners/num_started_lifetime"] == (
        r["env_runners/num_episodes_lifetime"]
        + r["env_runners/num_pending_episodes"]
        + skipped
        + r["env_runners/num_lost_episodes_lifetime"]
        + r["env_runners/num_in_flight"]
    )


def test_sync_group_mode_with_a_learner_actor_evaluation_and_checkpoints(ray_session, tiny_config):
    config = tiny_config(
        rollout_mode="sync_group",
        group_size=2,
        num_learners=1,
        num_cpus_per_learner=0.5,
        evaluation_interval=1,
        evaluation_num_episodes=2,
        tensorboard=False,
        checkpoint_frequency=1,
    )
    algo = config.build_algo()
    try:
        r = algo.train()
        periodic = os.path.join(algo.logdir, "checkpoints", "checkpoint_000001")
    finally:
        algo.stop()
    assert os.path.isfile(os.path.join(periodic, "flashrl_checkpoint.json"))
    from flashrl.checkpoints import latest_checkpoint, read_checkpoint

    assert latest_checkpoint(os.path.dirname(periodic)) == periodic  # `latest` names the newest save
    assert read_checkpoint(periodic).manifest["learner_layout"] == "single_file"  # the actor wrote its file
    assert r["learners/version"] == 1
    assert r["num_episodes"] == B
    assert r["env_runners/batch_num_distinct_prompts"] == B // 2  # B/G prompts x G rollouts
    assert r["env_runners/policy_lag_max"] == 0  # synchronous: on-policy
    assert r["learners/idle_fraction"] > 0  # the learner waited for the whole round
    assert r["evaluation/num_episodes"] == 2


def test_resources_beyond_the_cluster_fail_before_any_actor(ray_session, tiny_config):
    config = tiny_config(num_env_runners=3, num_cpus_per_env_runner=2.0)
    with pytest.raises(ConfigError, match="CPU: the run asks for 6 in total .* but the cluster has 4"):
        config.build_algo()


def test_resume_gives_the_same_next_update(ray_session, tiny_config, exact_sync_group, tmp_path):
    """Interrupted after 2 iterations and resumed from the checkpoint == uninterrupted, to the bit."""
    config = tiny_config(**exact_sync_group)
    algo = config.build_algo()
    try:
        before = {k: v.clone() for k, v in algo.learner_group.get_weights().items()}
        algo.train()
        algo.train()
        path = algo.save_to_path(str(tmp_path / "ckpt"))
        expected = algo.train()
        expected_weights = algo.learner_group.get_weights()
    finally:
        algo.stop()
    # The updates really moved the weights (rewards differ, so advantages are not all zero).
    assert any(not torch.equal(before[k], expected_weights[k]) for k in before)
    # The policy folder loads with transformers.
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(os.path.join(path, "policy"))
    assert set(policy.state_dict()) >= set(before) - {"lm_head.weight"}

    resumed = FlashReinforce.from_checkpoint(path)
    try:
        assert resumed.iteration == 2
        got = resumed.train()
        got_weights = resumed.learner_group.get_weights()
    finally:
        resumed.stop()
    assert got["training_iteration"] == 3
    assert got["learners/loss"] == expected["learners/loss"]
    assert got["env_runners/batch_episode_return_mean"] == expected["env_runners/batch_episode_return_mean"]
    for name, tensor in expected_weights.items():
        assert torch.equal(got_weights[name], tensor), name
