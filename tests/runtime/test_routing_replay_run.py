"""Routing replay through the real actors: an MoE policy, the torch engine recording, a Learner actor replaying."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashrl.learners import TrainBatch

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # about a minute on two shared cores


def test_a_run_with_routing_replay_trains_on_the_engines_routing(ray_session, tiny_config, tiny_qwen3_moe_path):
    config = tiny_config(model=tiny_qwen3_moe_path, routing_replay=True, num_learners=1,
                         env="flashrl-test/Parity-v0", async_queue_size=1)
    algo = config.build_algo()
    try:
        first = algo.train()
        assert first["learners/applied"] == 1.0 and first["env_runners/policy_lag_max"] == 0.0
        assert first["learners/drift_max"] < 1e-8  # lag 0: the engine's routing, the engine's log-probs

        # what reached the learner actor: episodes with the engine's routing of every token it fed
        episodes = algo.stream.next_batch(algo.learner_group.version).episodes
        for ep in episodes:
            fed = max(t for t, m in enumerate(ep.loss_mask) if m)  # the last sampled token was never fed
            assert ep.routed_experts.shape == (len(ep.token_ids), 2, 2)
            assert (ep.routed_experts[:fed] >= 0).all() and (ep.routed_experts[fed:] == -1).all()
        batch = TrainBatch.from_episodes(episodes, pad_token_id=algo.pad_token_id)
        recorded = algo.learner_group.update(batch)
        # the same episodes routed to experts the engine never chose: the actor replays what the batch says
        forced = batch.routed_experts.clone()
        forced[forced >= 0] = torch.tensor([6, 7], dtype=torch.int16).repeat(int((forced >= 0).sum()) // 2)
        wrong = algo.learner_group.update(batch.derived(routed_experts=forced))
    finally:
        algo.stop()
    assert recorded["applied"] == wrong["applied"] == 1.0
    assert wrong["drift_mean"] > 10 * max(recorded["drift_mean"], 1e-6)
    assert np.isfinite(wrong["drift_mean"])
