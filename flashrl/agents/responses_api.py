"""OpenAI's Responses API (``POST .../responses``) for the subset agents use, served by the chat path.

A Responses request is turned into the chat-completions request it means, and that request takes the
path of every chat call: the same checks (:func:`flashrl.agents.protocol.check_request`: the run's
sampling, ``max_tokens``, tools), the same chat template and recorder, the same seeds. So a call made
through ``client.responses.create`` is recorded token for token as the equivalent
``client.chat.completions.create`` call, and a reply the agent sends back as output items keeps the
token ids the model sampled, as a chat reply sent back does.

**The request** (field names as in ``openai.types.responses.ResponseCreateParams``):

* ``input``: a string (one user message) or a list of items: messages (``role`` ``user``, ``system``,
  ``developer`` or ``assistant``; ``content`` a string or ``input_text``/``output_text`` parts), an
  assistant's ``function_call`` items (``call_id``, ``name``, ``arguments``; those that follow an
  assistant message, or each other, make one chat message with its ``tool_calls``) and
  ``function_call_output`` items (``call_id``, ``output``: a tool message);
* ``instructions``: a system message before everything else (not carried to a later response, as
  OpenAI does);
* ``previous_response_id``: the conversation of that response (its input items and its output, kept by
  the session for each response it answered with ``store`` not false) comes before ``input``; or the
  agent sends the full conversation as ``input`` instead;
* ``tools``: function tools in the Responses' flat form (``{"type": "function", "name",
  "description", "parameters", "strict"}``); ``tool_choice`` ``"auto"``, ``"none"``, ``"required"`` or
  ``{"type": "function", "name"}``, and ``parallel_tool_calls``, as the chat request's;
* ``max_output_tokens`` (the chat request's ``max_completion_tokens``), ``temperature``, ``top_p``:
  checked as the chat request's;
* ``text.format`` ``{"type": "json_schema", ...}`` becomes the chat request's ``response_format``,
  checked as there;
* accepted whatever their value: ``metadata``, ``user``, ``store``, ``service_tier``,
  ``prompt_cache_key``, ``prompt_cache_retention``, ``safety_identifier``; at their neutral value only:
  ``truncation`` (``"disabled"``), ``include`` (empty), ``reasoning``, ``top_logprobs``,
  ``background``, ``max_tool_calls``, ``prompt``, ``conversation``; any other field goes to the
  chat request's checks as it is;
* ``stream``: the finished ``Response`` sent as the Responses API's stream events
  (:func:`flashrl.agents.streaming.response_events`), recorded as the plain call.

**The reply** is a ``Response`` (``openai.types.responses.Response``): a ``message`` item with one
``output_text`` part when the reply has text (or no tool call), then one ``function_call`` item per
tool call (``call_id`` the chat reply's tool call id); ``status`` ``"incomplete"`` (reason
``max_output_tokens``) when the reply was cut by the token limit.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flashrl.agents.protocol import RequestRefused

__all__ = ["ResponsesCall", "assistant_message", "read_responses_request", "response_object", "responses_refusal"]

INFORMATIONAL = frozenset({
    "metadata", "user", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
})
"""Fields accepted whatever their value: they change nothing of the reply."""
NEUTRAL = {
    "truncation": ("disabled",), "include": ([],), "reasoning": ({},), "top_logprobs": (0,), "background": (False,),
    "max_tool_calls": (), "prompt": (), "conversation": (),
}
"""Fields accepted only absent, null or at these values."""
_OWN = frozenset({
    "input", "instructions", "previous_response_id", "tools", "tool_choice", "max_output_tokens", "text", "stream",
    "stream_options",
})
_CHAT_PARAMS = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format"}
"""The chat request's parameter names in a refusal -> the Responses request's."""


@dataclass(frozen=True)
class ResponsesCall:
    """A Responses request read: the chat request it means and what the reply echoes."""

    chat_body: dict[str, Any]
    """The equivalent chat-completions request body."""
    history: tuple[dict[str, Any], ...]
    """The conversation without ``instructions`` (chat messages): what a later ``previous_response_id`` continues."""
    echo: dict[str, Any]
    """Request fields the ``Response`` repeats (``instructions``, ``tools``, ``previous_response_id``, ...)."""
    store: bool
    """Whether a later ``previous_response_id`` may continue this response."""
    stream: bool
    """Whether the response is sent as the Responses API's stream events."""


def read_responses_request(body: Any, previous: Mapping[str, Sequence[dict[str, Any]]]) -> ResponsesCall:
    """Read a Responses request body; ``previous`` maps the ids of this session's stored responses to their
    conversations. Raise :class:`RequestRefused`."""
    if not isinstance(body, dict):
        raise RequestRefused(400, "invalid_request", f"expected a JSON object as the body; got {type(body).__name__}.")
    for name, values in NEUTRAL.items():
        value = body.get(name)
        if value is not None and value not in values:
            raise RequestRefused(400, "unsupported_parameter", f"{name}={value!r:.200} is not supported on "
                                 f"/responses; leave {name} out.", param=name)
    stream = _stream(body)
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _OWN and k not in NEUTRAL}
    for name in INFORMATIONAL - {"metadata", "user", "store"}:  # the chat request knows these three
        chat.pop(name, None)
    history: list[dict[str, Any]] = []
    previous_id = body.get("previous_response_id")
    if previous_id is not None:
        if not isinstance(previous_id, str) or previous_id not in previous:
            raise RequestRefused(400, "previous_response_not_found", f"no stored response {previous_id!r:.100} in "
                                 "this episode (a response is kept for its episode unless sent with store=false); "
                                 "send the full conversation as input instead.", param="previous_response_id")
        history.extend(previous[previous_id])
    history.extend(_input_messages(body.get("input")))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestRefused(400, "invalid_request", "instructions must be a string.", param="instructions")
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + history
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = _chat_tools(tools)
    if "tool_choice" in body:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    echo = {name: body.get(name) for name in ("instructions", "previous_response_id", "max_output_tokens",
                                              "temperature", "top_p", "metadata", "user")}
    echo.update(tools=[t for t in tools or () if isinstance(t, dict)], tool_choice=body.get("tool_choice") or "auto",
                parallel_tool_calls=body.get("parallel_tool_calls") is not False)
    return ResponsesCall(chat_body=chat, history=tuple(history), echo=echo, store=body.get("store") is not False,
                         stream=stream)


def _stream(body: Mapping[str, Any]) -> bool:
    """Whether the response is streamed (:func:`flashrl.agents.streaming.response_events`)."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise RequestRefused(400, "invalid_request", f"stream must be true or false; got {stream!r:.100}.",
                             param="stream")
    if options is not None:
        if not stream:
            raise RequestRefused(400, "invalid_request", "stream_options can only be given with stream=true.",
                                 param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_obfuscation"}:
            raise RequestRefused(400, "unsupported_parameter", f"stream_options={options!r:.100} is not supported; "
                                 "only include_obfuscation is (and changes nothing here).", param="stream_options")
    return bool(stream)


def responses_refusal(err: RequestRefused) -> RequestRefused:
    """A refusal of the equivalent chat request, its ``param`` named as in the Responses request (a
    message's index counts chat messages: the instructions first, function calls merged)."""
    param = err.param
    if param is None:
        return err
    base = param.split(".", 1)[0].split("[", 1)[0]
    if base == "messages":
        return RequestRefused(err.status, err.code, f"{err.message} (at {param} of the conversation as chat "
                              "messages)", param="input", type=err.type)
    if base == "tools":
        param = param.replace(".function.", ".", 1)
    elif base in _CHAT_PARAMS:
        param = _CHAT_PARAMS[base] + param[len(base):]
    return RequestRefused(err.status, err.code, err.message, param=param, type=err.type)


def response_object(completion: Mapping[str, Any], call: ResponsesCall, *, response_id: str) -> dict[str, Any]:
    """The ``Response`` JSON of a chat completion answered to ``call``."""
    from openai.types.responses import Response

    choice = completion["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        output.append({"type": "message", "id": f"msg_{response_id[5:]}", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": []}]})
    for i, tool_call in enumerate(calls):
        function = tool_call["function"]
        output.append({"type": "function_call", "id": f"fc_{response_id[5:]}_{i}", "call_id": tool_call["id"],
                       "name": function["name"], "arguments": function["arguments"], "status": "completed"})
    usage = completion["usage"]
    cut = choice["finish_reason"] == "length"
    response = Response.model_validate({
        "id": response_id, "object": "response", "created_at": completion["created"], "model": completion["model"],
        "status": "incomplete" if cut else "completed", "completed_at": None if cut else int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None, "output": output,
        **call.echo, "store": call.store,
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                  "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0,
                  "cache_write_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
    })  # fmt: skip
    return response.model_dump(mode="json", by_alias=True)


def assistant_message(completion: Mapping[str, Any]) -> dict[str, Any]:
    """The chat message of a completion's reply (kept in a response's conversation)."""
    message = completion["choices"][0]["message"]
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function", "function": dict(c["function"])}
                             for c in message["tool_calls"]]
    return out


def _input_messages(items: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages (see the module doc)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if items is None:
        return []
    if not isinstance(items, list):
        raise RequestRefused(400, "invalid_request", f"input must be a string or a list of items; got "
                             f"{type(items).__name__}.", param="input")
    messages: list[dict[str, Any]] = []
    open_assistant = False  # whether the last message is an assistant message that function_call items join
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise RequestRefused(400, "invalid_request", f"input[{i}] must be an object; got {type(item).__name__}.",
                                 param=f"input[{i}]")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestRefused(400, "invalid_request", f"input[{i}].role must be user, system, developer or "
                                     f"assistant; got {role!r:.50}.", param=f"input[{i}].role")
            messages.append({"role": role, "content": _content(item.get("content"), f"input[{i}].content")})
            open_assistant = role == "assistant"
        elif kind == "function_call":
            tool_call = {"id": _text(item, "call_id", i), "type": "function",
                         "function": {"name": _text(item, "name", i), "arguments": _text(item, "arguments", i)}}
            if not open_assistant:
                messages.append({"role": "assistant", "content": None})
                open_assistant = True
            messages[-1].setdefault("tool_calls", []).append(tool_call)
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _content(output, f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", i), "content": content})
            open_assistant = False
        else:
            raise RequestRefused(400, "unsupported_content", f"input[{i}]: items of type {kind!r:.50} are not "
                                 "supported; send messages, function_call and function_call_output items.",
                                 param=f"input[{i}].type")
    return messages


def _content(content: Any, where: str) -> str | list[dict[str, str]]:
    """A message's content as the chat request's: a string, or its text parts as chat text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestRefused(400, "invalid_request", f"{where} must be a string or a list of parts.", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise RequestRefused(400, "unsupported_content", f"{where}[{j}]: only text parts (input_text, "
                                 f"output_text) are supported; got a {kind!r:.50} part.", param=f"{where}[{j}]")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _text(item: Mapping[str, Any], name: str, index: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise RequestRefused(400, "invalid_request", f"input[{index}].{name} must be a string; got {value!r:.100}.",
                             param=f"input[{index}].{name}")
    return value


def _chat_tools(tools: Any) -> Any:
    """Flat function tools -> the chat request's ``{"type": "function", "function": {...}}``; other tools
    (web search, file search, ...) are refused."""
    if not isinstance(tools, list):
        return tools  # the chat request's checks refuse it
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RequestRefused(400, "invalid_tools", f"tools[{i}]: only function tools are supported; got "
                                 f"{kind!r:.50}.", param=f"tools[{i}]")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict):
        raise RequestRefused(400, "unsupported_value", f"tool_choice {choice!r:.100} is not supported: only "
                             '"auto" and "none".', param="tool_choice")
    return choice


def _response_format(text: Any) -> dict[str, Any] | None:
    """``text`` -> the chat request's ``response_format`` (None for plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or text.get("verbosity") is not None:
        raise RequestRefused(400, "unsupported_parameter", f"text={text!r:.100} is not supported; only "
                             "text.format is.", param="text")
    form = text.get("format")
    if form is None or form == {"type": "text"}:
        return None
    if isinstance(form, dict) and form.get("type") == "json_schema":
        schema = {k: v for k, v in form.items() if k != "type"}
        return {"type": "json_schema", "json_schema": schema}
    return form if isinstance(form, dict) else {"type": form}
