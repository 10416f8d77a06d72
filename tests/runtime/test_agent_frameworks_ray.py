"""Agents on real frameworks (the ``agents`` extra) train through ``flashrl/Agent-v0`` (Ray actors on CPU, the
tiny model, the torch engine, one update), each on the episode's endpoint and key: LangChain's ``ChatOpenAI``
as LangChain agents set it up (a ReAct stop string, one tool call at a time), ``litellm.acompletion`` with a
tool, and an OpenAI Agents SDK agent with one function tool on the SDK's default model (the Responses API)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from flashrl.tool_calls import function_schema

pytestmark = pytest.mark.ray

B = 4
TASKS = [{"id": f"t{i}", "question": f"{i} + {i}", "answer": str(2 * i)} for i in range(8)]


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


ADD_SCHEMA = function_schema("add", "Add two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}})


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


async def litellm_agent(client: Any, task: dict[str, Any]) -> float:
    """Two turns on ``litellm.acompletion`` (its OpenAI provider at the episode's endpoint), with a tool."""
    # Before the import: `import litellm` fetches a model cost map from GitHub (blocking up to 5 s offline).
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    call = {"model": "openai/policy", "api_base": str(client.base_url), "api_key": client.api_key,
            "max_retries": 0, "max_tokens": 4, "tools": [ADD_SCHEMA]}
    messages: list[Any] = [{"role": "user", "content": task["question"]}]
    first = await litellm.acompletion(messages=messages, **call)
    messages += [first.choices[0].message, {"role": "user", "content": "Your final answer?"}]
    second = await litellm.acompletion(messages=messages, **call)
    return float(task["answer"] in str(second.choices[0].message.content))


async def agents_sdk_agent(client: Any, task: dict[str, Any]) -> float:
    """An OpenAI Agents SDK agent with one function tool, on the SDK's default model (the Responses API). The
    SDK raises ``ModelBehaviorError`` on a response cut at ``max_output_tokens`` (status "incomplete"): that
    answer scores 0, and its calls, recorded, are trained."""
    from agents import (
        Agent,
        ModelBehaviorError,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # its traces go to OpenAI's servers otherwise
    agent = Agent(name="adder", instructions="Add the numbers.", tools=[function_tool(add)],
                  model=OpenAIResponsesModel(model="policy", openai_client=client),
                  model_settings=ModelSettings(max_tokens=4))
    try:
        result = await Runner.run(agent, task["question"], max_turns=3)
    except ModelBehaviorError:
        return 0.0
    return float(task["answer"] in str(result.final_output))


@pytest.mark.parametrize(("agent", "turns"), [(langchain_agent, 2), (litellm_agent, 2), (agents_sdk_agent, 1)],
                         ids=["langchain", "litellm", "agents_sdk"])
def test_a_framework_agent_trains(ray_session: Any, tiny_config: Any, agent: Any, turns: int) -> None:
    config = tiny_config(env="flashrl/Agent-v0", env_config={"tasks": TASKS, "agent": agent}, tensorboard=False)
    algo = config.build_algo()
    try:
        result = algo.train()
    finally:
        algo.stop()
    assert result["learners/version"] == 1 and result["num_episodes"] == B
    assert result["env_runners/episode_turns_min"] == result["env_runners/episode_turns_max"] == turns
    assert result["env_runners/episode_info/tito_mismatches_max"] == 0.0  # the messages sent back matched
    assert result.get("env_runners/num_skipped_env_error_lifetime", 0.0) == 0.0
