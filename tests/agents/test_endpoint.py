"""The endpoint's HTTP side through the real ``openai`` client: authentication, refusals, limits, 404s."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import openai
import pytest

from flashrl.agents import AgentLimits, AgentServer
from flashrl.tool_calls import function_schema

USER = [{"role": "user", "content": "What is 2 + 3?"}]
TOOLS = [function_schema("add", "Add two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}})]

# (request keyword arguments, expected error code, expected param)
REFUSED = [
    ({"temperature": 0.7}, "unsupported_value", "temperature"),
    ({"top_p": 0.9}, "unsupported_value", "top_p"),
    ({"extra_body": {"top_k": 5}}, "unsupported_value", "top_k"),
    ({"max_tokens": 7}, "unsupported_value", "max_tokens"),
    ({"max_completion_tokens": 0}, "unsupported_value", "max_completion_tokens"),
    ({"n": 2}, "unsupported_value", "n"),
    ({"logprobs": True}, "unsupported_parameter", "logprobs"),
    ({"logit_bias": {"42": 5}}, "unsupported_parameter", "logit_bias"),
    ({"presence_penalty": 0.5}, "unsupported_parameter", "presence_penalty"),
    ({"extra_body": {"chat_template": "{{ messages }}"}}, "unsupported_parameter", "chat_template"),
    ({"extra_body": {"min_tokens": 3}}, "unsupported_parameter", "min_tokens"),
    ({"extra_body": {"top_a": 0.1}}, "unsupported_parameter", "top_a"),
    ({"tools": TOOLS, "tool_choice": "required"}, "unsupported_value", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "add two"}}]}, "invalid_tools", "tools[0].function.name"),
    ({"tools": [{"type": "function"}]}, "invalid_tools", "tools[0]"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "invalid_tools", "tools[1].function.name"),
]


def test_refused_parameters_get_openai_errors_and_are_counted(torch_engine, serve, agent_client) -> None:
    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        agent = agent_client(session)
        seen = []
        for kwargs, _, _ in REFUSED:
            with pytest.raises(openai.BadRequestError) as caught:
                await agent.chat.completions.create(model=server.model_name, messages=USER, **kwargs)
            error = caught.value
            assert error.status_code == 400 and error.type == "invalid_request_error"
            assert error.body["message"], kwargs
            seen.append((error.code, error.param))
        with pytest.raises(openai.NotFoundError) as caught:
            await agent.chat.completions.create(model="gpt-4o", messages=USER)
        assert caught.value.code == "model_not_found" and server.model_name in caught.value.body["message"]
        # the same values as the run's, and neutral ones, are accepted
        reply = await agent.chat.completions.create(
            model=server.model_name, messages=USER, temperature=1.0, top_p=1.0, max_tokens=6, n=1,
            frequency_penalty=0.0, user="someone", stream=False, extra_body={"top_k": -1},
        )
        assert reply.choices[0].finish_reason in ("stop", "length") and session.calls == 1
        return seen, session.errors

    seen, errors = serve(torch_engine, scenario)
    assert seen == [(code, param) for _, code, param in REFUSED]
    assert errors == Counter([code for _, code, _ in REFUSED] + ["model_not_found"])


def test_the_error_body_says_what_was_refused_and_why(torch_engine, serve) -> None:
    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        async with httpx.AsyncClient() as http:
            response = await http.post(f"{session.base_url}/chat/completions", json={
                "model": server.model_name, "messages": USER, "temperature": 0.5},
                headers={"Authorization": f"Bearer {session.api_key}"})
        return response

    response = serve(torch_engine, scenario)
    assert response.status_code == 400 and response.headers["x-should-retry"] == "false"
    assert response.json() == {"error": {
        "message": "temperature=0.5 is refused: the run samples at temperature 1.0; leave it out or send that. (To "
        "serve such requests with the run's sampling instead, counted in the episode info's ignored_settings: "
        ".env_runners(agent_sampling_overrides=\"ignore\").)",
        "type": "invalid_request_error", "param": "temperature", "code": "unsupported_value"}}


def test_requests_without_the_sessions_key_are_refused(torch_engine, serve, agent_client) -> None:
    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        for key in (session.api_key + "x", server.api_key):  # the server's own token opens no session
            async with openai.AsyncOpenAI(base_url=session.base_url, api_key=key, max_retries=0) as wrong:
                with pytest.raises(openai.AuthenticationError) as caught:
                    await wrong.chat.completions.create(model=server.model_name, messages=USER)
            assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
        async with httpx.AsyncClient() as http:
            bare = await http.post(f"{session.base_url}/chat/completions", json={"messages": USER})
            models = await http.get(f"{session.base_url}/models")
        assert (bare.status_code, bare.json()["error"]["code"]) == (401, "invalid_api_key")
        assert models.status_code == 401
        listed = await agent_client(session).models.list()
        return session, [m.id for m in listed.data]

    session, listed = serve(torch_engine, scenario, api_key="run-token")
    assert session.api_key != "run-token" and len(session.api_key) >= 32 and session.calls == 0
    assert session.errors == Counter({"invalid_api_key": 4})
    assert listed == ["tiny-policy"]


def test_a_fresh_token_per_server_and_the_loopback_address(torch_engine) -> None:
    async def scenario():
        a = AgentServer(torch_engine, sampling={"max_tokens": 4}, max_episode_tokens=64, model_name="m")
        b = AgentServer(torch_engine, sampling={"max_tokens": 4}, max_episode_tokens=64, model_name="m")
        url = await a.start()
        assert await a.start() == url  # idempotent
        await a.stop()
        await a.stop()
        return a.api_key, b.api_key, url

    key_a, key_b, url = asyncio.run(scenario())
    assert key_a != key_b and len(key_a) >= 32
    assert url.startswith("http://127.0.0.1:") and int(url.rsplit(":", 1)[1]) > 0


def test_unknown_and_closed_sessions_get_404(torch_engine, serve, agent_client) -> None:
    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        async with openai.AsyncOpenAI(base_url=f"{server.url}/sessions/nope/v1", api_key=server.api_key,
                                      max_retries=0) as unknown:
            with pytest.raises(openai.NotFoundError) as caught:
                await unknown.chat.completions.create(model=server.model_name, messages=USER)
        assert caught.value.code == "session_not_found"
        agent = agent_client(session)
        await agent.chat.completions.create(model=server.model_name, messages=USER)
        session.close()
        with pytest.raises(openai.NotFoundError) as caught:
            await agent.chat.completions.create(model=server.model_name, messages=USER)
        assert caught.value.code == "session_closed"
        with pytest.raises(openai.NotFoundError):
            await agent.models.list()
        return session

    session = serve(torch_engine, scenario)
    assert session.calls == 1 and session.errors == Counter({"session_closed": 2})
    assert session.to_episode(reward=0.0).info["errors"] == {"session_closed": 2}


def test_a_prompt_over_the_context_gets_context_length_exceeded(torch_engine, serve, agent_client) -> None:
    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        agent = agent_client(session)
        with pytest.raises(openai.BadRequestError) as caught:
            await agent.chat.completions.create(model=server.model_name,
                                                messages=[{"role": "user", "content": "word " * 80}])
        assert caught.value.code == "context_length_exceeded" and "64" in caught.value.body["message"]
        # a prompt that fits with less room than max_tokens gets a shorter reply, within the context
        reply = await agent.chat.completions.create(model=server.model_name,
                                                    messages=[{"role": "user", "content": "word " * 29}])
        return session, reply

    session, reply = serve(torch_engine, scenario, max_episode_tokens=64)
    assert session.errors == Counter({"context_length_exceeded": 1})
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (60, 4)  # 4 < max_tokens 6
    assert reply.choices[0].finish_reason == "length"
    episode = session.to_episode(reward=0.0)
    assert len(episode.token_ids) == 64  # the closing "<|im_end|>\n" did not fit: left out


def test_calls_past_the_limits_get_429(torch_engine, serve, agent_client) -> None:
    async def scenario(server):
        few_calls = server.open_session(prompt_id="p", seed=0, limits=AgentLimits(max_calls=1))
        agent = agent_client(few_calls)
        await agent.chat.completions.create(model=server.model_name, messages=USER)
        with pytest.raises(openai.RateLimitError) as caught:
            await agent.chat.completions.create(model=server.model_name, messages=USER)
        assert caught.value.status_code == 429 and caught.value.code == "call_limit"
        few_tokens = server.open_session(prompt_id="q", seed=0, limits=AgentLimits(max_completion_tokens=8))
        agent = agent_client(few_tokens)
        first = await agent.chat.completions.create(model=server.model_name, messages=USER)
        second = await agent.chat.completions.create(model=server.model_name, messages=USER)
        with pytest.raises(openai.RateLimitError) as caught:
            await agent.chat.completions.create(model=server.model_name, messages=USER)
        assert caught.value.code == "completion_token_limit"
        return few_calls, few_tokens, first, second

    few_calls, few_tokens, first, second = serve(torch_engine, scenario)
    assert few_calls.calls == 1 and few_calls.errors == Counter({"call_limit": 1})
    assert (first.usage.completion_tokens, second.usage.completion_tokens) == (6, 2)
    assert few_tokens.errors == Counter({"completion_token_limit": 1})


@pytest.mark.parametrize(("messages", "code"), [
    ([], "invalid_request"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "he"}], "invalid_request"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
     "unsupported_content"),
])
def test_malformed_messages_are_refused(torch_engine, serve, agent_client, messages, code) -> None:
    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        with pytest.raises(openai.BadRequestError) as caught:
            await agent_client(session).chat.completions.create(model=server.model_name, messages=messages)
        return caught.value.code, session.errors

    found, errors = serve(torch_engine, scenario)
    assert found == code and errors == Counter({code: 1})


def test_the_servers_settings_are_checked(torch_engine) -> None:
    with pytest.raises(ValueError, match="seed and stop_token_ids are the endpoint's own"):
        AgentServer(torch_engine, sampling={"max_tokens": 4, "seed": 1}, max_episode_tokens=64, model_name="m")
    with pytest.raises(ValueError, match="max_calls must be an int >= 1"):
        AgentLimits(max_calls=0)
    with pytest.raises(RuntimeError, match="before start"):
        _ = AgentServer(torch_engine, sampling={}, max_episode_tokens=64, model_name="m").url


def test_a_call_in_flight_when_the_session_closes_is_not_recorded(scripted_engine, serve, agent_client) -> None:
    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        call = asyncio.create_task(agent_client(session).chat.completions.create(model=server.model_name,
                                                                                 messages=USER))
        while not engine.requests:  # the engine has the request
            await asyncio.sleep(0.01)
        session.close()
        gate.set()
        with pytest.raises(openai.NotFoundError) as caught:
            await call
        return session, caught.value.code

    gate = asyncio.Event()
    engine = scripted_engine(["Five.<|im_end|>"], gate=gate)
    session, code = serve(engine, scenario)
    assert code == "session_closed" and session.calls == 0 and session.errors == Counter({"session_closed": 1})
    assert session.to_episode(reward=1.0) is None


def test_an_engine_failure_is_a_server_error_and_counted(scripted_engine, serve, agent_client) -> None:
    engine = scripted_engine([RuntimeError("engine died")])

    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        with pytest.raises(openai.InternalServerError) as caught:
            await agent_client(session).chat.completions.create(model=server.model_name, messages=USER)
        return session, caught.value

    session, error = serve(engine, scenario)
    assert error.status_code == 500 and error.code == "engine_error" and "engine died" in error.body["message"]
    assert session.calls == 0 and session.errors == Counter({"engine_error": 1})
