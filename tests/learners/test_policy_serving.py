"""A trained, saved policy serves from vLLM, and the learner agrees with what vLLM sampled."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flashrl.algorithms.flash_reinforce.components import bernoulli_kl
from flashrl.learners import Learner
from flashrl.models import compute_token_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_saved_policy_serves_from_vllm_with_learner_agreement(make_spec, batch, tmp_path):
    from flashrl.engines import SamplingConfig, make_engine

    learner = Learner(make_spec(optimizer="sgd", lr=0.5))
    initial = learner.get_weights()
    for _ in range(3):
        learner.update(batch)
    assert not torch.equal(learner.get_weights()["model.norm.weight"], initial["model.norm.weight"])
    path = learner.save_policy(tmp_path / "policy")

    prompt = batch.token_ids[0, :4].tolist()

    async def sample() -> list:
        engine = make_engine("vllm", path, seed=0)  # built inside the loop it serves on
        try:
            requests = [engine.generate(prompt, SamplingConfig(max_tokens=24, seed=s)) for s in range(4)]
            return await asyncio.wait_for(asyncio.gather(*requests), timeout=300)
        finally:
            engine.close()

    completions = asyncio.run(sample())
    assert any(c.token_ids != completions[0].token_ids for c in completions)  # real samples, not one answer
    for completion in completions:
        ids = torch.tensor([prompt + completion.token_ids])  # [1, T]
        with torch.no_grad():
            current, _ = compute_token_logprobs(learner.model, ids, torch.ones_like(ids, dtype=torch.bool))
        current = current[0, len(prompt) :]  # [n]
        behavior = torch.tensor(completion.logprobs)  # [n]
        drift = float(bernoulli_kl(behavior, current).mean())
        assert drift < 1e-3, (drift, (current - behavior).abs().max())
