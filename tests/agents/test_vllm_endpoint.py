"""The endpoint in front of the vLLM engine (tiny random Llama): two calls, one segment, vLLM's log-probs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from flashrl.agents import AgentLimits, AgentServer
from flashrl.conversation import chat_stop_token_ids
from flashrl.engines import SamplingConfig, make_engine
from flashrl.seeds import stream_seed

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.Runner]:
    """vLLM's async engine stays bound to the loop that first used it: one loop for the module (closing
    the runner cancels what is left on it, e.g. vLLM's output handler)."""
    with asyncio.Runner() as runner:
        yield runner


@pytest.fixture(scope="module")
def engine(tiny_llama_path: str, loop):  # the loop must outlive the engine
    eng = make_engine("vllm", tiny_llama_path, seed=0, max_model_len=512)
    yield eng
    eng.close()


def test_the_endpoint_records_the_vllm_engines_samples(engine, loop, agent_client) -> None:
    tok = engine.tokenizer
    m1 = [{"role": "user", "content": "What is 2 + 3?"}]
    stop = tuple(sorted(chat_stop_token_ids(tok)))

    async def scenario():
        server = AgentServer(engine, sampling={"temperature": 1.0, "max_tokens": 8}, max_episode_tokens=512,
                             model_name="tiny-policy")
        await server.start()
        try:
            session = server.open_session(prompt_id="sum", seed=5, limits=AgentLimits())
            agent = agent_client(session)
            r1 = await agent.chat.completions.create(model="tiny-policy", messages=m1)
            m2 = [*m1, r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Why?"}]
            await agent.chat.completions.create(model="tiny-policy", messages=m2)
            session.close()
        finally:
            await server.stop()
        p1 = tok.apply_chat_template(m1, add_generation_prompt=True, tokenize=True, return_dict=False)
        direct = await engine.generate(p1, SamplingConfig(max_tokens=8, seed=stream_seed(5, 0), stop_token_ids=stop))
        return session, p1, direct

    session, p1, direct = loop.run(scenario())
    episode = session.to_episode(reward=1.0)
    assert session.num_segments == 1 and episode.segment_starts is None and session.tito_mismatches == 0
    n = len(direct.token_ids)
    assert episode.token_ids[: len(p1) + n] == p1 + direct.token_ids  # call 1: the template's prompt, vLLM's sample
    assert episode.loss_mask[: len(p1) + n] == [False] * len(p1) + [True] * n
    torch.testing.assert_close(torch.tensor(episode.behavior_logprobs[len(p1): len(p1) + n]),
                               torch.tensor(direct.logprobs), atol=1e-4, rtol=0)
    assert episode.info["calls"] == 2 and sum(episode.loss_mask) > n and episode.policy_versions == [0, 0]


def test_a_stop_string_ends_the_vllm_engines_reply_as_on_the_torch_engine(engine, loop, agent_client,
                                                                            stop_string_check) -> None:
    """vLLM's own stop-string rule (the token completing it kept, the reply's text before it) gives what the
    torch engine's does (tests/agents/test_sampling_settings.py runs the same check there)."""

    async def scenario():
        server = AgentServer(engine, sampling={"temperature": 1.0, "max_tokens": 8}, max_episode_tokens=512,
                             model_name="tiny-policy")
        await server.start()
        try:
            return await stop_string_check(server, agent_client)
        finally:
            await server.stop()

    result = loop.run(scenario())
    assert len(result["stopped_ids"]) < len(result["free_ids"])
