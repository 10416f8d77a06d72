"""Agents on real frameworks train through ``flashrl/Agent-v0`` (Ray actors on CPU, the tiny model, the torch
engine, one update): LangChain's ``ChatOpenAI`` as LangChain agents set it up (a ReAct stop string, one tool
call at a time), on the client's endpoint and key. LiteLLM and the OpenAI Agents SDK are not in the
``agents`` extra: their packages pin versions below the ones flashrl's environment has (docs/agents.md,
"Agent frameworks")."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.ray

B = 4
TASKS = [{"id": f"t{i}", "question": f"{i} + {i}", "answer": str(2 * i)} for i in range(8)]


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def langchain_agent(client: Any, task: dict[str, Any]) -> float:
    """Two turns on LangChain's ChatOpenAI, built on the episode's endpoint (the client's base URL and key)."""
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key, max_retries=0,
                     max_tokens=4).bind_tools([add], parallel_tool_calls=False, stop=["Observation:"])
    messages: list[Any] = [HumanMessage(task["question"])]
    first = await llm.ainvoke(messages)
    messages += [first, HumanMessage("Your final answer?")]
    second = await llm.ainvoke(messages)
    return float(task["answer"] in str(second.content))


def test_a_langchain_agent_trains(ray_session: Any, tiny_config: Any) -> None:
    config = tiny_config(env="flashrl/Agent-v0", env_config={"tasks": TASKS, "agent": langchain_agent},
                         tensorboard=False)
    algo = config.build_algo()
    try:
        result = algo.train()
    finally:
        algo.stop()
    assert result["learners/version"] == 1 and result["num_episodes"] == B
    assert result["env_runners/episode_turns_min"] == result["env_runners/episode_turns_max"] == 2.0
    assert result["env_runners/episode_info/tito_mismatches_max"] == 0.0  # LangChain's messages sent back matched
    assert result.get("env_runners/num_skipped_env_error_lifetime", 0.0) == 0.0
