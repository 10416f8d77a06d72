"""Agents written on real frameworks (the ``agents`` extra) against the endpoint: LangChain's ``ChatOpenAI``,
``litellm.acompletion`` and an OpenAI Agents SDK agent on its chat-completions and its default Responses model.
Their requests are served and recorded token-exactly (the conversation sent back continues one segment);
tests/runtime/test_agent_frameworks_ray.py trains on each."""

from __future__ import annotations

import os
from typing import Any

import pytest
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI

from flashrl.agents import AgentLimits
from flashrl.tool_calls import function_schema

# `import litellm` fetches a model cost map from GitHub (blocking up to 5 s offline); use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
ADD_TOOL = function_schema("add", "Add two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}})
SYSTEM = "Add the numbers."
CALL_TEXT = 'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'


def langchain_chat(base_url: str, api_key: str) -> ChatOpenAI:
    """The ``ChatOpenAI`` an agent builds on an episode's endpoint (no retries: a refusal is seen once)."""
    return ChatOpenAI(model="tiny-policy", base_url=base_url, api_key=api_key, max_retries=0, max_tokens=4)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def langchain_agent_model(base_url: str, api_key: str) -> Any:
    """What LangChain agents commonly build: a ReAct stop string, one tool call at a time (both refused before
    the endpoint honoured them, so every such episode was lost)."""
    return langchain_chat(base_url, api_key).bind_tools([add], parallel_tool_calls=False, stop=["Observation:"])


def test_a_langchain_agents_calls_are_served_and_recorded_in_one_segment(torch_engine, serve) -> None:
    async def scenario(server: Any):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        llm = langchain_agent_model(session.base_url, session.api_key)
        messages: list[Any] = [HumanMessage("What is 2 + 3?")]
        first = await llm.ainvoke(messages)
        messages += [first, HumanMessage("Your final answer?")]
        second = await llm.ainvoke(messages)
        return session, second

    session, second = serve(torch_engine, scenario)
    assert session.calls == 2 and not session.errors, session.errors
    assert session.num_segments == 1 and session.tito_mismatches == 0
    episode = session.to_episode(reward=1.0)
    assert episode.info["calls"] == 2 and isinstance(second.content, str)


async def litellm_turns(base_url: str, api_key: str, question: str) -> Any:
    """Two turns on ``litellm.acompletion`` (the OpenAI provider at the endpoint), the reply sent back as
    LiteLLM returned it."""
    import litellm

    call = {"model": "openai/tiny-policy", "api_base": base_url, "api_key": api_key, "max_retries": 0,
            "max_tokens": 4, "tools": [ADD_TOOL]}
    messages: list[Any] = [{"role": "user", "content": question}]
    first = await litellm.acompletion(messages=messages, **call)
    messages += [first.choices[0].message, {"role": "user", "content": "Your final answer?"}]
    return await litellm.acompletion(messages=messages, **call)


def test_a_litellm_agents_calls_are_served_and_recorded_in_one_segment(torch_engine, serve) -> None:
    async def scenario(server: Any):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        second = await litellm_turns(session.base_url, session.api_key, "What is 2 + 3?")
        return session, second

    session, second = serve(torch_engine, scenario)
    assert session.calls == 2 and not session.errors, session.errors
    assert session.num_segments == 1 and session.tito_mismatches == 0
    assert session.to_episode(reward=1.0).info["calls"] == 2 and second.model == "tiny-policy"


async def agents_sdk_run(client: AsyncOpenAI, model_kind: str, question: str) -> Any:
    """``Runner.run`` of an Agents SDK agent with one function tool on the episode's client, by chat completions
    (``OpenAIChatCompletionsModel``) or by the SDK's default, the Responses API (``OpenAIResponsesModel``)."""
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # its traces go to OpenAI's servers otherwise
    kind = {"chat": OpenAIChatCompletionsModel, "responses": OpenAIResponsesModel}[model_kind]
    agent = Agent(name="adder", instructions=SYSTEM, tools=[function_tool(add)],
                  model=kind(model="tiny-policy", openai_client=client))
    return await Runner.run(agent, question, max_turns=3)


def test_an_agents_sdk_tool_round_trip_records_the_same_tokens_by_chat_and_by_responses(
    scripted_engine, serve, agent_client, tokenizer
) -> None:
    engine = scripted_engine([CALL_TEXT, "It is 5.<|im_end|>"] * 2)

    async def scenario(server: Any):
        sessions = [server.open_session(prompt_id="p", seed=3, limits=AgentLimits()) for _ in range(2)]
        results = [await agents_sdk_run(agent_client(s), kind, "What is 2 + 3?")
                   for s, kind in zip(sessions, ("chat", "responses"), strict=True)]
        return sessions, results

    sessions, results = serve(engine, scenario)
    assert [r.final_output for r in results] == ["It is 5.", "It is 5."]
    for session in sessions:
        assert session.calls == 2 and not session.errors, session.errors
        assert session.num_segments == 1 and session.tito_mismatches == 0
    chat, responses = (s.to_episode(reward=1.0) for s in sessions)
    assert (responses.token_ids, responses.loss_mask, responses.behavior_logprobs) == (
        chat.token_ids, chat.loss_mask, chat.behavior_logprobs)
    assert engine.requests[:2] == engine.requests[2:]  # the same prompts
    assert tokenizer.decode(engine.requests[1][0]).endswith("<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")


def test_an_agents_sdk_reply_cut_at_max_tokens_raises_on_responses_and_is_recorded(scripted_engine, serve,
                                                                                    agent_client) -> None:
    """The SDK raises ``ModelBehaviorError`` on an "incomplete" response (as on OpenAI's); its chat model returns
    the cut reply. Either way the call is recorded, so an agent that scores the error 0 still trains on it."""
    from agents import ModelBehaviorError

    engine = scripted_engine(["Adding two"] * 2)  # no end-of-turn token: cut at max_tokens

    async def scenario(server: Any):
        chat, responses = (server.open_session(prompt_id="p", seed=3, limits=AgentLimits()) for _ in range(2))
        answer = await agents_sdk_run(agent_client(chat), "chat", "What is 2 + 3?")
        with pytest.raises(ModelBehaviorError, match="incomplete"):
            await agents_sdk_run(agent_client(responses), "responses", "What is 2 + 3?")
        return (chat, responses), answer

    sessions, answer = serve(engine, scenario)
    assert answer.final_output == "Adding two"
    for session in sessions:
        assert session.calls == 1 and not session.errors and session.to_episode(reward=0.0).info["calls"] == 1
