"""An agent's recorded calls are what the learner trains on: the learner's recomputation of every segment
matches the engine's recorded log-probs (both engines; three calls, the third not a prefix)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from flashrl.agents import AgentLimits, AgentServer
from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
from flashrl.engines.agreement import bernoulli_kl
from flashrl.learners import Learner, LearnerSpec
from flashrl.learners.batch import TrainBatch

MODEL = "tiny-policy"
SAMPLING = {"temperature": 1.0, "max_tokens": 8}


async def _three_calls(engine: Any) -> Any:
    """An agent on the `openai` client: ask, follow up (same segment), then start over with a summary."""
    import openai

    server = AgentServer(engine, sampling=SAMPLING, max_episode_tokens=512, model_name=MODEL)
    await server.start()
    try:
        session = server.open_session(prompt_id="sum", seed=11, limits=AgentLimits())
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        m1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
        r1 = (await client.chat.completions.create(model=MODEL, messages=m1)).choices[0].message
        m2 = [*m1, r1.model_dump(exclude_none=True), {"role": "user", "content": "Are you sure?"}]
        r2 = (await client.chat.completions.create(model=MODEL, messages=m2)).choices[0].message
        summary = [{"role": "user", "content": f"Earlier you said: {r2.content!r}. Now answer: what is 2 + 3?"}]
        await client.chat.completions.create(model=MODEL, messages=summary)
        session.close()
        await client.close()
    finally:
        await server.stop()
    return session


def _recomputed_drift(model_path: str, session: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
    episode = session.to_episode(reward=1.0)
    assert episode.info["calls"] == 3 and episode.info["segments"] == 2 and session.tito_mismatches == 0
    assert episode.segment_starts is not None and len(episode.segment_starts) == 2
    batch = TrainBatch.from_episodes([episode], pad_token_id=0)
    learner = Learner(LearnerSpec(model=model_path, lr=1e-6, grad_clip=None, device="cpu", dtype="float32",
                                  pack_sequences=False, loss=FlashReinforceLossSpec(delta=0.05)))
    lengths = batch.attention_mask.sum(-1).tolist()
    with torch.no_grad():
        current, _ = learner.policy.run(learner._logprobs, batch, lengths)  # [1, T]
    mask = batch.loss_mask
    recorded = batch.behavior_logprobs[mask]
    return recorded, current[mask].float(), episode


def _check(recorded: torch.Tensor, current: torch.Tensor, episode: Any) -> None:
    assert recorded.numel() == sum(episode.loss_mask) > 0
    drift = bernoulli_kl(recorded, current)
    assert float(drift.mean()) < 1e-3, f"mean drift {float(drift.mean()):.3g}"
    # each call's tokens, on its segment's context: a learner that scored the third call with the first
    # segment in front would not agree token by token
    torch.testing.assert_close(current, recorded, atol=5e-3, rtol=0)


def test_the_learner_recomputes_the_torch_engines_calls(tiny_llama_path: str, torch_engine) -> None:
    session = asyncio.run(_three_calls(torch_engine))
    _check(*_recomputed_drift(tiny_llama_path, session))


@pytest.mark.vllm
def test_the_learner_recomputes_the_vllm_engines_calls(tiny_llama_path: str) -> None:
    from flashrl.engines import make_engine

    with asyncio.Runner() as loop:  # vLLM's async engine stays on the loop that first used it
        engine = make_engine("vllm", tiny_llama_path, seed=0, max_model_len=512)
        try:
            session = loop.run(_three_calls(engine))
        finally:
            engine.close()
    _check(*_recomputed_drift(tiny_llama_path, session))
