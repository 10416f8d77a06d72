"""The endpoint in front of the vLLM engine (tiny random Llama): two calls, one segment, vLLM's log-probs;
streamed and Responses calls recorded as the plain ones."""

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


M1 = [{"role": "user", "content": "What is 2 + 3?"}]
FOLLOW_UP = {"role": "user", "content": "Why?"}


def test_streamed_and_responses_calls_record_the_plain_calls_tokens(engine, loop, agent_client) -> None:
    """Streaming and the Responses API: a streamed conversation and a Responses one record what the plain chat
    conversation of the same seed records."""

    async def scenario():
        server = AgentServer(engine, sampling={"temperature": 1.0, "max_tokens": 8}, max_episode_tokens=512,
                             model_name="tiny-policy")
        await server.start()
        try:
            plain, streamed, responses = (server.open_session(prompt_id="sum", seed=5, limits=AgentLimits())
                                          for _ in range(3))
            chat = agent_client(plain).chat.completions
            r1 = await chat.create(model="tiny-policy", messages=M1)
            await chat.create(model="tiny-policy", messages=[*M1, r1.choices[0].message.model_dump(exclude_none=True),
                                                             FOLLOW_UP])
            texts = []
            for _ in range(2):
                messages = [*M1, {"role": "assistant", "content": texts[0]}, FOLLOW_UP] if texts else M1
                stream = await agent_client(streamed).chat.completions.create(
                    model="tiny-policy", messages=messages, stream=True, stream_options={"include_usage": True})
                texts.append("".join([c.choices[0].delta.content or "" async for c in stream if c.choices]))
            api = agent_client(responses).responses
            first = [e async for e in await api.create(model="tiny-policy", input=M1[0]["content"], stream=True)][-1].response
            await api.create(model="tiny-policy", input="Why?", previous_response_id=first.id)
        finally:
            await server.stop()
        return plain, streamed, responses, r1, texts, first

    plain, streamed, responses, r1, texts, first = loop.run(scenario())
    assert texts[0] == first.output_text == r1.choices[0].message.content
    expected = plain.to_episode(reward=1.0)
    for session in (streamed, responses):
        episode = session.to_episode(reward=1.0)
        assert session.num_segments == 1 and session.tito_mismatches == 0 and episode.info["calls"] == 2
        # the same prompts and seeds: vLLM samples the same tokens with the same log-probs (measured equal to
        # the last bit, with the later sessions' prompts served from the prefix cache)
        assert (episode.token_ids, episode.loss_mask, episode.behavior_logprobs) == (
            expected.token_ids, expected.loss_mask, expected.behavior_logprobs)


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
