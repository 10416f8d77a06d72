"""Agents written on real frameworks against the endpoint: LangChain's ``ChatOpenAI`` (langchain-openai, the
``agents`` extra). Its requests are served and recorded token-exactly (its conversation sent
back continues one segment); tests/runtime/test_agent_frameworks_ray.py trains on each."""

from __future__ import annotations

from typing import Any

from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI

from flashrl.agents import AgentLimits


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
