"""Request settings by what they do to the method, through the real ``openai`` client: ``stop``, ``seed`` and
``parallel_tool_calls`` are served; settings that would change the sampled distribution follow the run's
``agent_sampling_overrides`` policy (refused, or ignored and counted)."""

from __future__ import annotations

import logging

import openai
import pytest

from flashrl.agents import AgentLimits, AgentServer
from flashrl.engines.types import SamplingConfig
from flashrl.env_runners.spec import EnvRunnerSpec
from flashrl.tool_calls import function_schema

USER = [{"role": "user", "content": "What is 2 + 3?"}]
TOOLS = [function_schema("add", "Add two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}})]
CHANGING = [  # (request keyword arguments, the setting's name): each would change the distribution sampled from
    ({"temperature": 0.3}, "temperature"),
    ({"top_p": 0.5}, "top_p"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"logit_bias": {"42": 5}}, "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
]


def test_a_stop_string_ends_the_reply_where_the_engine_stops(torch_engine, serve, agent_client, stop_string_check):
    async def scenario(server):
        return await stop_string_check(server, agent_client)

    result = serve(torch_engine, scenario)
    assert len(result["stopped_ids"]) < len(result["free_ids"])  # the engine stopped early, not the reply cut


def test_the_torch_engine_stops_at_a_stop_string_as_vllm_does(torch_engine) -> None:
    import asyncio

    tok = torch_engine.tokenizer
    prompt = tok("Once upon a time", add_special_tokens=False)["input_ids"]
    free = asyncio.run(torch_engine.generate(prompt, SamplingConfig(max_tokens=12, seed=3)))
    texts = [tok.decode(free.token_ids[:k], skip_special_tokens=True) for k in range(len(free.token_ids) + 1)]
    k = next(k for k in range(4, len(texts)) if texts[k][len(texts[k - 1]):].strip())
    stop = texts[k][len(texts[k - 1]):].strip()
    first = next(j for j in range(1, len(texts)) if stop in texts[j])
    stopped = asyncio.run(torch_engine.generate(prompt, SamplingConfig(max_tokens=12, seed=3, stop=(stop, "never!"))))
    assert stopped.token_ids == free.token_ids[:first] and stopped.finish_reason == "stop"
    assert stopped.logprobs == pytest.approx(free.logprobs[:first])


def test_seed_and_parallel_tool_calls_are_served_and_the_runs_seed_governs(torch_engine, serve, agent_client):
    async def scenario(server):
        replies = []
        for kwargs in ({}, {"seed": 1}, {"seed": 2}, {"tools": TOOLS, "parallel_tool_calls": False},
                       {"tools": TOOLS, "parallel_tool_calls": True}):
            session = server.open_session(prompt_id="p", seed=7, limits=AgentLimits())
            reply = await agent_client(session).chat.completions.create(model=server.model_name, messages=USER,
                                                                        **kwargs)
            episode = session.to_episode(reward=0.0)
            replies.append([t for t, m in zip(episode.token_ids, episode.loss_mask) if m])
            assert reply.choices[0].finish_reason in ("stop", "length") and not session.errors
        return replies

    plain, seed1, seed2, single, parallel = serve(torch_engine, scenario)
    assert plain == seed1 == seed2  # call 0 of an episode seeded 7 samples with stream_seed(7, 0), whatever the seed
    assert single and parallel


def test_settings_that_change_the_distribution_are_refused_by_default_naming_the_policy(scripted_engine, serve,
                                                                                         agent_client) -> None:
    engine = scripted_engine(["4"] * len(CHANGING))

    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        messages = []
        for kwargs, name in CHANGING:
            with pytest.raises(openai.BadRequestError) as caught:
                await agent_client(session).chat.completions.create(model=server.model_name, messages=USER, **kwargs)
            assert caught.value.param == name
            messages.append(caught.value.body["message"])
        return messages, session

    messages, session = serve(engine, scenario)
    assert all('agent_sampling_overrides="ignore"' in m for m in messages)
    assert engine.requests == [] and session.calls == 0


def test_ignored_settings_are_served_with_the_runs_sampling_counted_and_warned_once(
    scripted_engine, serve, agent_client, caplog,
) -> None:
    engine = scripted_engine(["4"] * (len(CHANGING) + 1))

    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        agent = agent_client(session)
        for kwargs, _ in [*CHANGING, CHANGING[0]]:
            reply = await agent.chat.completions.create(model=server.model_name, messages=USER, **kwargs)
            assert reply.choices[0].message.content == "4"
        return session

    with caplog.at_level(logging.WARNING, logger="flashrl.agents"):
        session = serve(engine, scenario, sampling_overrides="ignore")
    run = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0)
    assert [(s.temperature, s.top_p, s.top_k) for _, s in engine.requests] == [(1.0, 1.0, 0)] * (len(CHANGING) + 1)
    assert all(s.temperature == run.temperature for _, s in engine.requests)
    names = [name for _, name in CHANGING] + ["temperature"]
    assert dict(session.ignored) == {n: names.count(n) for n in names} and not session.errors
    assert session.to_episode(reward=1.0).info["ignored_settings"] == len(names)
    warned = [r.getMessage() for r in caplog.records if "agent_sampling_overrides" in r.getMessage()]
    assert len(warned) == len(set(names))  # once per setting (and process), naming it
    assert all(any(repr(n) in w for w in warned) for n in set(names))


def test_settings_that_change_nothing_of_the_method_stay_refused_under_ignore(torch_engine, serve, agent_client):
    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        codes = []
        for kwargs in ({"n": 2}, {"logprobs": True}, {"max_tokens": 7}, {"stop": [""]}):
            with pytest.raises(openai.BadRequestError) as caught:
                await agent_client(session).chat.completions.create(model=server.model_name, messages=USER, **kwargs)
            codes.append(caught.value.param)
        return codes

    assert serve(torch_engine, scenario, sampling_overrides="ignore") == ["n", "logprobs", "max_tokens", "stop"]


def test_the_policy_is_a_runner_setting_checked_once(torch_engine) -> None:
    assert EnvRunnerSpec(env="flashrl/Math-v0").agent_sampling_overrides == "refuse"
    with pytest.raises(ValueError, match="agent_sampling_overrides"):
        EnvRunnerSpec(env="flashrl/Math-v0", agent_sampling_overrides="allow")
    with pytest.raises(ValueError, match="sampling_overrides must be one of"):
        AgentServer(torch_engine, sampling={"max_tokens": 4}, max_episode_tokens=64, model_name="m",
                    sampling_overrides="allow")


def test_the_torch_engines_stop_check_finds_a_match_ending_in_the_last_tokens_text_only(torch_engine) -> None:
    """Past a long completion (the check decodes a window of the last tokens) and only when the last token's
    text completes the stop string: as vLLM's ``check_stop_strings``."""
    tok = torch_engine.tokenizer
    ids = tok("word " * 300 + "Observation: done", add_special_tokens=False)["input_ids"]
    hits = [k for k in range(1, len(ids) + 1) if torch_engine._stop_string_hit(ids[:k], ("Observation:",))]
    first = next(k for k in range(1, len(ids) + 1) if "Observation:" in tok.decode(ids[:k]))
    assert hits == [first] and first > 300  # once, where the text first holds it; not again after
