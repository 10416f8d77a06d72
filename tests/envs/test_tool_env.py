"""ToolEnv (``flashrl/Tool-v0``): user functions called in the Hermes/Qwen format, every refusal explained."""

from __future__ import annotations

import json

import pytest

from flashrl.envs.tool_env import Tool, ToolEnv, answer_tool_calls
from flashrl.tool_calls import parse_tool_calls


def _add(a: int, b: int) -> int:
    return a + b


def _lookup(key: str) -> str:
    return {"paris": "France"}[key]


ADD = Tool("add", "Add two integers.", _add, {"a": {"type": "integer"}, "b": {"type": "integer"}}, ("a", "b"))
LOOKUP = Tool("lookup", "Country of a city.", _lookup, {"key": {"type": "string"}}, ("key",))
TASKS = [{"question": "What is (2 + 3) + 4?", "answer": "9", "id": "sum"}, {"question": "Where is paris?", "answer": "France"}]


def call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_an_episode_with_two_turns_of_calls() -> None:
    env = ToolEnv(TASKS, [ADD, LOOKUP], system_prompt="Use the tools.", max_turns=4)
    messages, info = env.reset(options={"task_index": 0})
    assert messages == [{"role": "system", "content": "Use the tools."},
                        {"role": "user", "content": "What is (2 + 3) + 4?"}]
    assert info["prompt_id"] == "sum" and info["tools"] == [ADD.schema(), LOOKUP.schema()]
    obs, reward, terminated, truncated, info = env.step(call("add", a=2, b=3))
    assert (obs, reward, terminated, truncated) == ([{"role": "tool", "content": "5"}], 0.0, False, False)
    obs, *_ , info = env.step(call("add", a=5, b=4) + call("lookup", key="rome"))
    assert obs == [{"role": "tool", "content": "9"}, {"role": "tool", "content": "Error: lookup raised KeyError: 'rome'."}]
    assert (info["tool_calls"], info["tool_calls_refused"], info["success"]) == (2, 1, False)  # raised: refused
    obs, reward, terminated, truncated, info = env.step(" 9 ")
    assert (obs, reward, terminated, truncated, info["success"], info["turn"]) == ([], 1.0, True, False, True, 3)


def test_refusals_say_what_is_wrong() -> None:
    text = (call("add", a=1) + call("add", a=1, b=2, c=3) + call("mul", a=1) + "<tool_call>oops</tool_call>"
            + call("add", a=1, b=1))
    messages, run, refused = answer_tool_calls(parse_tool_calls(text).calls, {"add": ADD}, max_calls=4, max_chars=60)
    assert [m["content"] for m in messages] == [
        "Error: add needs the arguments ['b'].",
        "Error: add has no arguments ['c']; it takes ['a', 'b'].",
        "Error: there is no tool 'mul'; the tools are ['add'].",
        # 72 characters, cut to 60 with a marker
        "Error: the tool call is not valid JSON (Expecting value at c\n[... 12 more characters cut]",
        "Error: at most 4 tool calls are run per turn; this one was n\n[... 7 more characters cut]",
    ]
    assert all(m["role"] == "tool" for m in messages) and (run, refused) == (0, 5)


def test_a_deep_call_is_answered_as_malformed() -> None:
    env = ToolEnv(TASKS, [ADD], max_turns=4)
    env.reset(options={"task_index": 0})
    deep = "<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>"
    obs, reward, terminated, truncated, info = env.step(deep)
    assert obs == [{"role": "tool", "content": "Error: the tool call nests 100000 levels deep; at most 100 are accepted."}]
    assert (reward, terminated, truncated, info["tool_calls"], info["tool_calls_refused"]) == (0.0, False, False, 0, 1)


def test_turn_limit_grades_the_last_reply_and_bad_arguments() -> None:
    env = ToolEnv(TASKS, [ADD], max_turns=2)
    env.reset(options={"task_index": 1})
    env.step(call("add", a=1, b=1))
    obs, reward, terminated, truncated, info = env.step(call("add", a=1, b=1))
    assert (obs, reward, terminated, truncated, info["turn_limit_reached"]) == ([], 0.0, False, True, True)
    with pytest.raises(TypeError, match="must have a str 'answer'"):
        ToolEnv([{"question": "q"}], [ADD])
    with pytest.raises(ValueError, match="tool names must be distinct"):
        ToolEnv(TASKS, [ADD, ADD])
    with pytest.raises(TypeError, match="Tool objects"):
        ToolEnv(TASKS, [_add])
