"""Native tool calls: tool schemas for the chat template, and the model's Hermes/Qwen tool calls.

Models trained for tool use (Qwen2.5, Qwen3, Hermes 2 Pro/3 and the many that copy their format) get
the tools as JSON schemas through the chat template (``apply_chat_template(messages, tools=[...])``
renders them into the system turn) and answer with one ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` block per call; the tool's result goes back as a message with role ``"tool"``,
which the template wraps (Qwen: ``<tool_response>...</tool_response>`` inside a user turn).

* :func:`function_schema` writes the OpenAI-style schema the templates expect.
* :func:`parse_tool_calls` reads the calls out of a reply with the conventions of vLLM's Hermes parser
  (``vllm/tool_parsers/hermes_tool_parser.py``: the regex ``<tool_call>(.*?)</tool_call>`` or an
  unclosed ``<tool_call>`` to the end of the reply, the body parsed as JSON with ``name`` and
  ``arguments``, the reply's text before the first call as its content). Unlike vLLM, which falls back
  to "no tool call" when any block fails to parse, each block is kept: a malformed one becomes a
  :class:`ToolCall` with an ``error``, so the environment can tell the model what was wrong (for RL the
  model must learn from a broken call, not have it silently ignored).
* :func:`hermes_tools_prompt` is the tool description for a chat template that ignores ``tools``
  (SmolLM2's, for example): :class:`flashrl.conversation.TokenizedConversation` puts it into the
  system message instead, in the words Qwen2.5's template uses, so the same env works with both kinds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MAX_TOOL_CALL_DEPTH",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "ParsedToolCalls",
    "ToolCall",
    "function_schema",
    "hermes_tools_prompt",
    "json_depth",
    "parse_tool_calls",
    "template_renders_tools",
]

MAX_TOOL_CALL_DEPTH = 100
"""Deepest nesting of ``[`` and ``{`` a tool call's JSON may have; a deeper one is a malformed call."""
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# As vLLM's Hermes parser: a closed block, or an unclosed one to the end of the reply (cut by the limit).
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One ``<tool_call>`` block of a reply."""

    name: str | None
    """The function's name (None when the block could not be parsed)."""
    arguments: dict[str, Any] = field(default_factory=dict)
    """The call's arguments (a JSON object)."""
    raw: str = ""
    """The block's body as the model wrote it."""
    error: str | None = None
    """Why the block is not a valid call (not JSON, no name, arguments not an object, unclosed), or None."""


@dataclass(frozen=True)
class ParsedToolCalls:
    """What a reply holds: its prose and its tool calls."""

    content: str
    """The reply without its tool-call blocks (where a final answer outside the calls is looked for)."""
    calls: tuple[ToolCall, ...]
    """The ``<tool_call>`` blocks in order, valid or not."""


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """Split a reply into its prose and its Hermes/Qwen ``<tool_call>`` blocks (see the module doc).

    Example: ``'Let me compute.\\n<tool_call>\\n{"name": "python", "arguments": {"code": "print(2)"}}
    \\n</tool_call>'`` gives content ``'Let me compute.\\n'`` and one call ``python(code='print(2)')``.
    """
    calls = []
    for match in _TOOL_CALL_RE.finditer(text):
        closed = match.group(1) is not None
        calls.append(_parse_call(match.group(1) if closed else match.group(2), closed))
    return ParsedToolCalls(content=_TOOL_CALL_RE.sub("", text), calls=tuple(calls))


def _parse_call(body: str, closed: bool) -> ToolCall:
    raw = body.strip()
    depth = json_depth(raw)
    if depth > MAX_TOOL_CALL_DEPTH:
        # Python's JSON parser recurses once per level: a deep enough reply would raise RecursionError.
        return ToolCall(name=None, raw=raw, error=(
            f"the tool call nests {depth} levels deep; at most {MAX_TOOL_CALL_DEPTH} are accepted"))
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        why = f"the tool call is not valid JSON ({err.msg} at character {err.pos})"
        if not closed:
            why += f"; it is also missing its closing {TOOL_CALL_END}"
        return ToolCall(name=None, raw=raw, error=why)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return ToolCall(name=None, raw=raw, error='the tool call must be a JSON object with a "name" string')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name=value["name"], raw=raw, error='"arguments" must be a JSON object')
    return ToolCall(name=value["name"], arguments=arguments, raw=raw)


_JSON_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


def json_depth(text: str) -> int:
    """How deep ``[`` and ``{`` nest in ``text`` (JSON), outside its strings; 0 for a scalar."""
    depth = deepest = 0
    for char in _JSON_STRING_RE.sub("", text):
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def function_schema(
    name: str, description: str, parameters: Mapping[str, Mapping[str, Any]], required: Sequence[str] = ()
) -> dict[str, Any]:
    """The OpenAI-style tool schema chat templates render (``{"type": "function", "function": {...}}``).

    ``parameters`` maps each argument's name to its JSON schema (``{"type": "string", "description":
    ...}``); ``required`` names those the call must give.
    """
    unknown = sorted(set(required) - set(parameters))
    if unknown:
        raise ValueError(f"function_schema({name!r}): required arguments {unknown} are not in parameters.")
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: dict(v) for k, v in parameters.items()},
                "required": list(required),
            },
        },
    }


def hermes_tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool description Qwen2.5's chat template writes into the system turn, for templates without one."""
    listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f"{TOOL_CALL_START}{TOOL_CALL_END} XML tags:\n{TOOL_CALL_START}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n' + TOOL_CALL_END
    )


def template_renders_tools(tokenizer: Any, tools: Sequence[Mapping[str, Any]], **kwargs: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` (the rendered text changes with them)."""
    probe = [{"role": "user", "content": "flashrl-probe"}]
    plain = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False, **kwargs)
    with_tools = tokenizer.apply_chat_template(
        probe, tokenize=False, add_generation_prompt=False, tools=list(tools), **kwargs
    )
    return plain != with_tools
