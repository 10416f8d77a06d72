"""``POST .../responses`` through the real ``openai`` client: recorded exactly as the equivalent chat call.

Each Responses conversation is compared with the same conversation made with chat completions in
another session of the same seed: the recorded tokens, log-probs and the prompts the engine got must be
equal.
"""

from __future__ import annotations

from collections import Counter

import openai
import pytest

from flashrl.agents import AgentLimits
from flashrl.tool_calls import function_schema

SEED = 3
SYSTEM = "Add the numbers."
QUESTION = "What is 2 + 3?"
CHAT_TOOLS = [function_schema("add", "Add two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}})]
TOOLS = [{"type": "function", **CHAT_TOOLS[0]["function"]}]  # the Responses' flat form
CALL_TEXT = 'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'


def _recorded(session):
    episode = session.to_episode(reward=1.0)
    return episode.token_ids, episode.loss_mask, episode.behavior_logprobs, episode.policy_versions, episode.info


def _items(response) -> list[tuple[str, ...]]:
    """A response's output items as what an agent reads of them."""
    return [(i.type, i.content[0].text) if i.type == "message" else (i.type, i.call_id, i.name, i.arguments)
            for i in response.output]


def test_a_response_records_what_the_chat_call_records(torch_engine, serve, agent_client) -> None:
    async def scenario(server):
        chat = server.open_session(prompt_id="p", seed=SEED, limits=AgentLimits())
        responses = server.open_session(prompt_id="p", seed=SEED, limits=AgentLimits())
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        c1 = await agent_client(chat).chat.completions.create(model=server.model_name, messages=messages)
        events = [e async for e in await agent_client(responses).responses.create(
            model=server.model_name, instructions=SYSTEM, input=QUESTION, max_output_tokens=6, stream=True)]
        r1 = events[-1].response  # streamed: the plain call's response, its last event
        assert events[-1].type == ("response.incomplete" if r1.status == "incomplete" else "response.completed")
        # the second call continues the first: by previous_response_id, and as chat messages
        messages += [c1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Why?"}]
        c2 = await agent_client(chat).chat.completions.create(model=server.model_name, messages=messages)
        r2 = await agent_client(responses).responses.create(model=server.model_name, instructions=SYSTEM,
                                                            input="Why?", previous_response_id=r1.id)
        return chat, responses, (c1, c2), (r1, r2)

    chat, responses, replies, answers = serve(torch_engine, scenario)
    for reply, answer in zip(replies, answers, strict=True):
        assert answer.output_text == reply.choices[0].message.content and answer.object == "response"
        (item,) = answer.output
        assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
        assert (answer.usage.input_tokens, answer.usage.output_tokens) == (reply.usage.prompt_tokens,
                                                                            reply.usage.completion_tokens)
        assert answer.status == ("incomplete" if reply.choices[0].finish_reason == "length" else "completed")
    assert answers[1].previous_response_id == answers[0].id and answers[0].instructions == SYSTEM
    assert _recorded(responses) == _recorded(chat)
    assert responses.num_segments == 1 and responses.tito_mismatches == 0 and responses.calls == 2
    assert responses.transcript[-1]["content"] == answers[1].output_text


def test_a_function_call_round_trip_by_previous_response_id_and_by_full_input(
    scripted_engine, serve, agent_client
) -> None:
    engine = scripted_engine([CALL_TEXT, "It is 5.<|im_end|>"] * 3)

    async def scenario(server):
        sessions = [server.open_session(prompt_id="p", seed=SEED, limits=AgentLimits()) for _ in range(3)]
        chat, chained, full = (agent_client(s) for s in sessions)
        # chat completions
        m1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        c1 = await chat.chat.completions.create(model=server.model_name, messages=m1, tools=CHAT_TOOLS)
        call = c1.choices[0].message.tool_calls[0]
        m2 = [*m1, c1.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        await chat.chat.completions.create(model=server.model_name, messages=m2, tools=CHAT_TOOLS)
        # responses, chained by previous_response_id
        first = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
        r1 = await chained.responses.create(model=server.model_name, instructions=SYSTEM, input=first, tools=TOOLS)
        calls = [item for item in r1.output if item.type == "function_call"]
        output = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}]
        r2 = await chained.responses.create(model=server.model_name, instructions=SYSTEM, input=output, tools=TOOLS,
                                            previous_response_id=r1.id)
        # responses, the full conversation as input (what the OpenAI Agents SDK sends by default)
        f1 = await full.responses.create(model=server.model_name, instructions=SYSTEM, input=first, tools=TOOLS)
        items = [*first, *(item.model_dump(exclude_none=True) for item in f1.output), *output]
        f2 = await full.responses.create(model=server.model_name, instructions=SYSTEM, input=items, tools=TOOLS)
        return sessions, c1, (r1, r2), (f1, f2)

    (chat, chained, full), c1, (r1, r2), (f1, f2) = serve(engine, scenario)
    message, function_call = r1.output
    assert message.type == "message" and message.content[0].text == c1.choices[0].message.content == "Adding.\n"
    assert (function_call.type, function_call.call_id, function_call.name, function_call.arguments) == (
        "function_call", "call_0_0", "add", '{"a": 2, "b": 3}')
    assert r2.output_text == f2.output_text == "It is 5."
    assert [i.model_dump(exclude={"id"}) for i in f1.output] == [i.model_dump(exclude={"id"}) for i in r1.output]
    for session in (chained, full):
        assert _recorded(session) == _recorded(chat)
        assert session.tito_mismatches == 0 and session.num_segments == 1
    assert engine.requests[:2] == engine.requests[2:4] == engine.requests[4:]  # the same prompts and sampling


def test_a_streamed_response_is_the_plain_responses_events(scripted_engine, serve, agent_client) -> None:
    """``create(stream=True)`` for the function call, the ``stream()`` helper for the answer, against plain calls."""
    engine = scripted_engine([CALL_TEXT, "It is 5.<|im_end|>"] * 2)
    first = [{"role": "user", "content": QUESTION}]

    async def scenario(server):
        plain, streamed = (server.open_session(prompt_id="p", seed=SEED, limits=AgentLimits()) for _ in range(2))
        api = agent_client(plain).responses
        p1 = await api.create(model=server.model_name, input=first, tools=TOOLS)
        output = [{"type": "function_call_output", "call_id": "call_0_0", "output": "5"}]
        p2 = await api.create(model=server.model_name, input=output, tools=TOOLS, previous_response_id=p1.id)
        api = agent_client(streamed).responses
        events = [event async for event in await api.create(model=server.model_name, input=first, tools=TOOLS,
                                                               stream=True)]
        s1 = events[-1].response
        async with api.stream(model=server.model_name, input=output, tools=TOOLS, previous_response_id=s1.id) as stream:
            s2 = await stream.get_final_response()
        return plain, streamed, (p1, p2), events, (s1, s2)

    plain, streamed, answers, events, streamed_answers = serve(engine, scenario)
    for answer, streamed_answer in zip(answers, streamed_answers, strict=True):
        assert _items(streamed_answer) == _items(answer) and streamed_answer.status == answer.status == "completed"
    assert _items(answers[0]) == [("message", "Adding.\n"), ("function_call", "call_0_0", "add", '{"a": 2, "b": 3}')]
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Adding.\n"
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == '{"a": 2, "b": 3}'
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _recorded(streamed) == _recorded(plain) and streamed.tito_mismatches == 0
    assert engine.requests[:2] == engine.requests[2:]


@pytest.mark.parametrize(("kwargs", "code", "param"), [
    ({"previous_response_id": "resp_nope"}, "previous_response_not_found", "previous_response_id"),
    ({"stream_options": {"include_obfuscation": False}}, "invalid_request", "stream_options"),
    ({"max_output_tokens": 7}, "unsupported_value", "max_output_tokens"),
    ({"tools": [{"type": "web_search"}]}, "invalid_tools", "tools[0]"),
    ({"tools": [{"type": "function", "name": "add two"}]}, "invalid_tools", "tools[0].name"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "unsupported_content", "input[0].content[0]"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "unsupported_content", "input[0].type"),
    ({"input": []}, "invalid_request", "input"),
    ({"truncation": "auto"}, "unsupported_parameter", "truncation"),
    ({"extra_body": {"top_a": 0.1}}, "unsupported_parameter", "top_a"),
])
def test_requests_the_endpoint_does_not_serve_get_openai_errors(torch_engine, serve, agent_client, kwargs, code,
                                                               param) -> None:
    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        with pytest.raises(openai.BadRequestError) as caught:
            await agent_client(session).responses.create(**{"model": server.model_name, "input": QUESTION, **kwargs})
        return session, caught.value

    session, error = serve(torch_engine, scenario)
    assert (error.code, error.param) == (code, param) and error.body["message"]
    assert session.errors == Counter({code: 1}) and session.calls == 0


def test_store_false_keeps_no_response_and_the_model_is_checked(torch_engine, serve, agent_client) -> None:
    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        agent = agent_client(session)
        first = await agent.responses.create(model=server.model_name, input=QUESTION, store=False)
        with pytest.raises(openai.BadRequestError) as caught:
            await agent.responses.create(model=server.model_name, input="Why?", previous_response_id=first.id)
        with pytest.raises(openai.NotFoundError) as wrong:
            await agent.responses.create(model="gpt-4o", input=QUESTION)
        listed = await agent.models.list()
        return session, caught.value.code, wrong.value.code, [m.id for m in listed.data]

    session, code, wrong, listed = serve(torch_engine, scenario)
    assert (code, wrong, listed) == ("previous_response_not_found", "model_not_found", ["tiny-policy"])
    assert session.calls == 1
