"""``stream=true`` through the real ``openai`` client: the chunks, and a recording identical to the plain call's.

Each streamed call is compared with the same call made without streaming in another session of the same
seed (the call's seed is ``stream_seed(seed, k)``), so the recorded tokens and log-probs must be equal.
"""

from __future__ import annotations

from collections import Counter

import httpx
import openai
import pytest

from flashrl.agents import AgentLimits
from flashrl.tool_calls import function_schema

SEED = 3
M1 = [{"role": "system", "content": "Add the numbers."}, {"role": "user", "content": "What is 2 + 3?"}]
TOOLS = [function_schema("add", "Add two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}})]
CALL_TEXT = 'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'


def _recorded(session):
    episode = session.to_episode(reward=1.0)
    return episode.token_ids, episode.loss_mask, episode.behavior_logprobs, episode.policy_versions, episode.info


async def _read(stream) -> tuple[list, dict]:
    """The chunks of a streamed reply, and the message they make (content, tool calls by index)."""
    chunks = [chunk async for chunk in stream]
    content, calls = "", {}
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    return chunks, {"content": content, "tool_calls": [calls[i] for i in sorted(calls)]}


def test_a_streamed_call_records_what_the_plain_call_records(torch_engine, serve, agent_client) -> None:
    async def scenario(server):
        plain = server.open_session(prompt_id="p", seed=SEED, limits=AgentLimits())
        streamed = server.open_session(prompt_id="p", seed=SEED, limits=AgentLimits())
        r1 = await agent_client(plain).chat.completions.create(model=server.model_name, messages=M1)
        chunks, message = await _read(await agent_client(streamed).chat.completions.create(
            model=server.model_name, messages=M1, stream=True, stream_options={"include_usage": True}))
        # a second call on each, the reply sent back: it must keep the sampled ids (one segment, no mismatch)
        m2 = [*M1, {"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "Why?"}]
        r2 = await agent_client(plain).chat.completions.create(model=server.model_name, messages=m2)
        m2s = [*M1, {"role": "assistant", "content": message["content"]}, {"role": "user", "content": "Why?"}]
        _, message2 = await _read(await agent_client(streamed).chat.completions.create(
            model=server.model_name, messages=m2s, stream=True))
        return plain, streamed, r1, chunks, message, r2, message2

    plain, streamed, r1, chunks, message, r2, message2 = serve(torch_engine, scenario)
    assert message["content"] == r1.choices[0].message.content and message["tool_calls"] == []
    assert message2["content"] == r2.choices[0].message.content
    assert _recorded(streamed) == _recorded(plain)  # token ids, loss mask, log-probs, versions, info
    assert streamed.num_segments == 1 and streamed.calls == 2 and streamed.tito_mismatches == 0
    # OpenAI's order: the role first, content pieces, the finish reason, then the usage chunk (no choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 2) + [r1.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == r1.usage
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1


def test_streamed_tool_calls_reassemble_to_the_plain_calls(scripted_engine, serve, agent_client) -> None:
    """Plain, ``create(stream=True)`` and the ``stream()`` helper, one session each on the same replies."""
    engine = scripted_engine([CALL_TEXT, "It is 5.<|im_end|>"] * 3)

    async def play(server, mode):
        session = server.open_session(prompt_id="p", seed=SEED, limits=AgentLimits())
        chat = agent_client(session).chat.completions
        kwargs = {"model": server.model_name, "messages": M1, "tools": TOOLS}
        if mode == "create":
            chunks, message = await _read(await chat.create(**kwargs, stream=True))
            finish = chunks[-1].choices[0].finish_reason
        else:
            if mode == "plain":
                reply = (await chat.create(**kwargs)).choices[0]
            else:
                async with chat.stream(**kwargs) as stream:
                    reply = (await stream.get_final_completion()).choices[0]
            message = {"content": reply.message.content or "", "tool_calls": [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                for c in reply.message.tool_calls]}
            finish = reply.finish_reason
        back = {"role": "assistant", "content": message["content"] or None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in message["tool_calls"]]}
        m2 = [*M1, back, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "5"}]
        await chat.create(model=server.model_name, messages=m2, tools=TOOLS, stream=mode != "plain")
        return session, message, finish

    async def scenario(server):
        return [await play(server, mode) for mode in ("plain", "create", "helper")]

    (plain, plain_message, plain_finish), *streamed = serve(engine, scenario)
    assert plain_message == {"content": "Adding.\n", "tool_calls": [
        {"id": "call_0_0", "name": "add", "arguments": '{"a": 2, "b": 3}'}]} and plain_finish == "tool_calls"
    for session, message, finish in streamed:
        assert message == plain_message and finish == plain_finish
        assert _recorded(session) == _recorded(plain) and session.tito_mismatches == 0
        assert session.to_episode(reward=0.0).info["tool_calls"] == 1
    assert engine.requests[:2] == engine.requests[2:4] == engine.requests[4:]  # the same prompts and sampling


@pytest.mark.parametrize(("body", "code", "param"), [
    ({"stream_options": {"include_usage": True}}, "invalid_request", "stream_options"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "unsupported_parameter",
     "stream_options.continuous_usage_stats"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "invalid_request", "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"foo": True}}, "unsupported_parameter", "stream_options"),
    ({"stream": "yes"}, "invalid_request", "stream"),
    ({"stream": True, "max_tokens": 7}, "unsupported_value", "max_tokens"),  # refused as the plain call, no stream
])
def test_bad_stream_settings_are_refused_before_any_chunk(torch_engine, serve, body, code, param) -> None:
    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        async with httpx.AsyncClient() as http:
            response = await http.post(f"{session.base_url}/chat/completions", json={
                "model": server.model_name, "messages": M1, **body}, headers={"Authorization": f"Bearer {session.api_key}"})
        return session, response

    session, response = serve(torch_engine, scenario)
    assert response.status_code == 400 and response.headers["content-type"] == "application/json"
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == (code, param)
    assert session.errors == Counter({code: 1}) and session.calls == 0


def test_the_stream_is_server_sent_events_ending_with_done(torch_engine, serve) -> None:
    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        async with httpx.AsyncClient() as http:
            response = await http.post(f"{session.base_url}/chat/completions", json={
                "model": server.model_name, "messages": M1, "stream": True},
                headers={"Authorization": f"Bearer {session.api_key}"})
        return response

    response = serve(torch_engine, scenario)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])
    assert openai.types.chat.ChatCompletionChunk.model_validate_json(events[0][6:]).object == "chat.completion.chunk"
