"""The OpenAI chat-completions protocol of the agent endpoint: what a request may ask, and the reply.

A request is read with vLLM's own OpenAI request class (``ChatCompletionRequest``, which validates
the body: message shapes, tool schemas, ``tool_choice``) and checked against the run. The reply is
the ``openai`` package's ``ChatCompletion``. Refusals are OpenAI-style error bodies
(``{"error": {"message", "type", "param", "code"}}``), raised as :class:`RequestRefused`.

**What a request may ask, by what it does to the method.** The episode is trained as sampled by the
run's policy: the same sampling for every call, log-probs of the distribution actually sampled from, the
run's chat template. So (docs/agents.md, "Sampling settings"):

* honoured, since they leave the distribution sampled from unchanged: ``stop`` (up to ``MAX_STOP``
  strings; the engine stops at the token whose text completes one, as vLLM does; that token is recorded
  and trained, and the reply's text ends before the stop string, as OpenAI's does), ``seed`` (accepted;
  the run's seed governs every call: call ``k`` of an episode samples with ``stream_seed(seed, k)``, so a
  run is reproducible, and a seed an agent repeats in every call or episode does not make every episode
  sample with the same random numbers), ``parallel_tool_calls`` (true or false: the reply holds the calls
  the model wrote; forcing at most one would need constrained decoding), and ``temperature``, ``top_p``,
  ``top_k`` equal to the run's (``top_k`` 0 and -1 both mean "all tokens");
* settings that would change the distribution sampled from (`DISTRIBUTION_SETTINGS`: another
  ``temperature``, ``top_p`` or ``top_k``, constrained decoding by ``response_format`` or
  ``structured_outputs`` or a ``tool_choice`` of ``"required"`` or a named function, ``logit_bias``,
  penalties, ``min_p``, ``min_tokens``, ``ignore_eos``, ``bad_words``, ``allowed_token_ids``) follow the
  run's policy ``overrides`` (the ``agent_sampling_overrides`` setting): ``"refuse"`` (the default: HTTP
  400, code ``unsupported_value`` for the checked fields and ``tool_choice``, ``unsupported_parameter``
  for the others) or ``"ignore"`` (served with the run's sampling as if the setting were absent, named in
  `ChatCall.ignored`; ``tool_choice`` is then ``"auto"``);
* always refused (HTTP 400): ``max_tokens``/``max_completion_tokens`` above the run's ``max_tokens`` or
  below 1, ``n`` other than 1 (one rollout per prompt) (``unsupported_value``); and at a value other than its neutral one every other field of
  vLLM's request class, which would change what is returned or rendered rather than how the policy
  samples: ``logprobs``/``top_logprobs`` (the log-probs are recorded, not returned), ``stop_token_ids``,
  ``use_beam_search``, ``echo``, ``continue_final_message``/``add_generation_prompt``,
  ``chat_template``/``chat_template_kwargs``, ``documents``, ``skip_special_tokens``, ...
  (``unsupported_parameter``);
* a field neither OpenAI's nor vLLM's request knows: ``unsupported_parameter``. Accepted whatever
  their value, since they change nothing of the reply: ``user``, ``metadata``, ``store`` and vLLM's
  ``request_id`` and ``session_id``.

``stream`` and ``stream_options`` are the session's: it takes them off the body before these checks
and streams the recorded reply (:mod:`flashrl.agents.streaming`).

A ``model`` other than the served one is refused with HTTP 404 ``model_not_found`` (the agent asks
``GET .../models`` for the name). A malformed body gives ``invalid_request`` (or ``invalid_json``),
and so does one nested deeper than ``MAX_JSON_DEPTH`` (a tool schema included) or a string holding a
lone surrogate (which no text encoding can tokenise): both are refused before any other check;
a malformed ``tools`` list ``invalid_tools``; message content other than text (images, audio)
``unsupported_content``. Roles are ``system``, ``user``, ``assistant`` and ``tool``; ``developer``
(the newer clients' name for instructions) is rendered as ``system``. A message's ``name`` and a tool
message's ``tool_call_id`` are accepted and not rendered (the chat templates ignore them).

**Tool calls in replies** are read with :func:`flashrl.tool_calls.parse_tool_calls`, which follows
the conventions of vLLM's Hermes parser (``vllm/tool_parsers/hermes_tool_parser.py``: closed or
unclosed ``<tool_call>`` blocks holding JSON with ``name`` and ``arguments``). As vLLM's parser does,
a reply with a block that does not parse gets no ``tool_calls`` and its whole text as the content, so
the agent sees what the model wrote. flashrl's parser is used rather than vLLM's class because vLLM's
logs a stack trace for every malformed call (frequent early in RL), encodes arguments the model wrote
as a JSON string as a quoted string instead of the object, and has no guard against deeply nested
JSON; the replies are otherwise the same. Only a request with ``tools`` and ``tool_choice`` ``"auto"``
gets its reply parsed; the content is the prose outside the blocks (None when blank), and the tool
call ids are ``call_<call index>_<i>`` (the same on a rerun).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flashrl.engines.types import SamplingConfig
from flashrl.tool_calls import TOOL_CALL_END, TOOL_CALL_START, parse_tool_calls

__all__ = [
    "DISTRIBUTION_SETTINGS",
    "SAMPLING_OVERRIDES",
    "ChatCall",
    "Message",
    "RequestRefused",
    "ToolCallText",
    "chat_completion",
    "check_request",
    "models_list",
    "reply_dict",
    "reply_message",
    "request_class",
]

ALLOWED = frozenset({
    "messages", "model", "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "n",
    "stream", "tools", "tool_choice", "parallel_tool_calls", "stop", "seed",
})
"""Request fields checked one by one (the rest must be neutral)."""
DISTRIBUTION_SETTINGS = frozenset({
    "temperature", "top_p", "top_k", "tool_choice", "response_format", "structured_outputs", "logit_bias",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "min_tokens", "ignore_eos",
    "bad_words", "allowed_token_ids",
})
"""Request fields that, away from the run's or their neutral value, change the distribution the policy samples
from: refused or ignored by the run's policy (`SAMPLING_OVERRIDES`)."""
SAMPLING_OVERRIDES = ("refuse", "ignore")
"""What the endpoint does with a request's `DISTRIBUTION_SETTINGS` (the ``agent_sampling_overrides`` setting)."""
MAX_STOP = 4
"""Most stop strings a request may give (OpenAI's limit, which vLLM's request class checks too)."""
INFORMATIONAL = frozenset({"user", "metadata", "store"})
"""Fields accepted whatever their value: they change nothing of the reply."""
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
"""Accepted message roles -> the role rendered."""
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_JSON_DEPTH = 64
"""Deepest nesting of a request body (objects and arrays): a tool schema nested deeper is no schema a model
is prompted with, and the validator and the chat template recurse over it."""


class RequestRefused(Exception):
    """A request the endpoint does not serve, as the OpenAI-style error answered to the client."""

    def __init__(self, status: int, code: str, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.type = type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ToolCallText:
    """One tool call of an assistant message: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str | None = field(default=None, compare=False)

    def key(self) -> tuple[str, str]:
        """The call as compared with a recorded one: the arguments as canonical JSON when they parse."""
        try:
            arguments = json.dumps(json.loads(self.arguments), sort_keys=True, ensure_ascii=False)
        except (ValueError, RecursionError):
            arguments = self.arguments
        return self.name, arguments


@dataclass(frozen=True)
class Message:
    """One chat message as rendered: its role, its text and (assistant) its tool calls."""

    role: str
    content: str
    tool_calls: tuple[ToolCallText, ...] = ()

    def key(self) -> tuple[Any, ...]:
        return self.role, self.content, tuple(call.key() for call in self.tool_calls)

    def text(self) -> str:
        """The message as the model writes it: the content, then one Hermes block per tool call (as
        Qwen2.5's chat template renders an assistant message's ``tool_calls``)."""
        blocks = [
            f'{TOOL_CALL_START}\n{{"name": {json.dumps(c.name, ensure_ascii=False)}, "arguments": {c.arguments}}}'
            f"\n{TOOL_CALL_END}"
            for c in self.tool_calls
        ]
        return "\n".join(([self.content] if self.content else []) + blocks)


@dataclass(frozen=True)
class ChatCall:
    """A checked request: what is rendered and how much may be sampled."""

    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...]
    """The tool schemas (``{"type": "function", "function": {...}}``), empty without tools."""
    parse_tools: bool
    """Whether the reply is read for tool calls (tools given and ``tool_choice`` ``"auto"``)."""
    max_tokens: int
    """The most tokens this call may sample (before the context budget)."""
    raw_messages: tuple[dict[str, Any], ...]
    """The request's messages as the client sent them (for the transcript)."""
    stop: tuple[str, ...] = ()
    """The request's stop strings (the engine stops at the first; the reply's text ends before it)."""
    ignored: tuple[str, ...] = ()
    """The `DISTRIBUTION_SETTINGS` the request set and the run's ``"ignore"`` policy left out."""


def check_request(body: Any, *, sampling: SamplingConfig, model_name: str, overrides: str = "refuse") -> ChatCall:
    """Read a chat-completions request body and check it against the run's ``sampling``; raise
    :class:`RequestRefused`. ``overrides`` (one of `SAMPLING_OVERRIDES`) says what a setting that would change
    the distribution sampled from gets: refused, or ignored and named in `ChatCall.ignored`."""
    if overrides not in SAMPLING_OVERRIDES:
        raise ValueError(f"overrides must be one of {SAMPLING_OVERRIDES}; got {overrides!r}.")
    if not isinstance(body, dict):
        raise RequestRefused(400, "invalid_request", f"expected a JSON object as the body; got {type(body).__name__}.")
    _check_plain_json(body)
    _check_tools_shape(body.get("tools"))
    try:
        request = request_class().model_validate(body)
    except ValueError as err:  # pydantic's ValidationError and vLLM's checks are ValueErrors
        param = _error_param(err)
        code = "invalid_tools" if (param or "").startswith("tools") else "invalid_request"
        raise RequestRefused(400, code, f"invalid request: {err}", param=param) from None
    if request.model is not None and request.model != model_name:
        raise RequestRefused(
            404, "model_not_found", f"the model {request.model!r} is not served here; this endpoint serves "
            f"{model_name!r} (GET .../models lists it).", param="model",
        )
    ignored: list[str] = []

    def changes(refusal: RequestRefused) -> None:
        """A setting that would change the distribution sampled from: refused, or ignored (the run's policy)."""
        if overrides == "refuse":
            refusal.message += _IGNORE_HINT
            refusal.args = (refusal.message,)
            raise refusal
        ignored.append(str(refusal.param))

    _check_sampling(body, request, sampling, changes)
    _check_neutral(body, request, changes)
    tools = tuple(_tool_schema(t) for t in request.tools or ())
    tool_choice = request.tool_choice if "tool_choice" in body or tools else "none"
    if tool_choice not in ("auto", "none", None):
        changes(RequestRefused(
            400, "unsupported_value", f"tool_choice {tool_choice!r} is not supported: only \"auto\" and \"none\" "
            "(forcing a call needs constrained decoding, which changes the distribution the policy samples from).",
            param="tool_choice",
        ))
        tool_choice = "auto" if tools else "none"
    stop = _stop_strings(request.stop)
    raw = tuple(dict(m) for m in body["messages"])
    messages = tuple(_message(m, i) for i, m in enumerate(request.messages))
    if not messages:
        raise RequestRefused(400, "invalid_request", "messages is empty; send at least one message.", param="messages")
    if messages[-1].role == "assistant":
        raise RequestRefused(
            400, "invalid_request", "the last message is the assistant's; continuing a final message is not "
            "supported (end with a user or tool message).", param=f"messages[{len(messages) - 1}]",
        )
    limits = [v for v in (request.max_completion_tokens, body.get("max_tokens")) if v is not None]
    return ChatCall(
        messages=messages, tools=tools, parse_tools=bool(tools) and tool_choice == "auto",
        max_tokens=min([sampling.max_tokens, *limits]), raw_messages=raw, stop=stop, ignored=tuple(ignored),
    )


def request_class() -> type[Any]:
    """vLLM's ``ChatCompletionRequest`` (importing vLLM takes seconds: ``AgentServer.start`` does it first)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest


_IGNORE_HINT = (" (To serve such requests with the run's sampling instead, counted in the episode info's "
                "ignored_settings: .env_runners(agent_sampling_overrides=\"ignore\").)")


def _stop_strings(stop: Any) -> tuple[str, ...]:
    """The request's ``stop`` as a tuple of non-empty strings; at most `MAX_STOP`."""
    strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(strings) > MAX_STOP or any(not isinstance(s, str) or not s for s in strings):
        raise RequestRefused(400, "invalid_request", f"stop must be a string or a list of at most {MAX_STOP} "
                             f"non-empty strings; got {stop!r:.200}.", param="stop")
    return strings


def _check_sampling(
    body: Mapping[str, Any], request: Any, run: SamplingConfig, changes: Callable[[RequestRefused], None],
) -> None:
    def refuse(param: str, why: str) -> RequestRefused:
        return RequestRefused(400, "unsupported_value", f"{param}={body.get(param)!r} is refused: {why}", param=param)

    if request.temperature is not None and not math.isclose(request.temperature, run.temperature, abs_tol=1e-9):
        changes(refuse("temperature", f"the run samples at temperature {run.temperature}; leave it out or send that."))
    if request.top_p is not None and not math.isclose(request.top_p, run.top_p, abs_tol=1e-9):
        changes(refuse("top_p", f"the run samples with top_p {run.top_p}; leave it out or send that."))
    if request.top_k is not None and max(request.top_k, 0) != max(run.top_k, 0):
        changes(refuse("top_k", f"the run samples with top_k {run.top_k}; leave it out or send that."))
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and not (isinstance(value, int) and 1 <= value <= run.max_tokens):
            raise refuse(name, f"it must be an integer from 1 to the run's max_tokens, {run.max_tokens}.")
    if request.n not in (None, 1):
        raise refuse("n", "one completion per call (n=1): FlashREINFORCE samples one rollout per prompt.")


def _check_neutral(body: Mapping[str, Any], request: Any, changes: Callable[[RequestRefused], None]) -> None:
    fields = type(request).model_fields
    for name in sorted(set(body) - ALLOWED - INFORMATIONAL):
        if name not in fields:
            raise RequestRefused(
                400, "unsupported_parameter", f"the parameter {name!r} is not supported by this endpoint (it could "
                "change how the policy samples or what it sees); leave it out.", param=name,
            )
        value = getattr(request, name)
        default = fields[name].get_default(call_default_factory=True)
        if name in ("request_id", "session_id") or value == default or (value in (None, [], {}) and not default):
            continue
        if name == "response_format" and getattr(value, "type", None) == "text":
            continue  # plain text: what every reply is
        if name in ("frequency_penalty", "presence_penalty", "min_p") and value == 0:
            continue
        if name == "repetition_penalty" and value == 1:
            continue
        refusal = RequestRefused(
            400, "unsupported_parameter", f"{name}={body[name]!r} is refused: the run's policy samples every call "
            f"the same way (see the endpoint's list of refused parameters); leave {name} out.", param=name,
        )
        if name not in DISTRIBUTION_SETTINGS:
            raise refusal
        changes(refusal)


def _check_plain_json(body: Any) -> None:
    """Refuse a body nested past ``MAX_JSON_DEPTH`` or with a string that is not valid Unicode (a lone
    surrogate, which ``json`` reads from ``\\ud800``); walked without recursion."""
    stack: list[tuple[Any, int, str]] = [(body, 0, "")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestRefused(400, "invalid_request", f"the string at {where or 'the top'} holds a lone "
                                     "surrogate (not valid Unicode); send UTF-8 text.", param=where or None) from None
            continue
        if not isinstance(value, dict | list):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise RequestRefused(400, "invalid_request", f"the request nests deeper than {MAX_JSON_DEPTH} objects or "
                                 f"arrays (at {where}); flatten it.", param=where.split(".", 1)[0].split("[", 1)[0])
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                stack.append((key, depth, where))
            stack.append((item, depth + 1, (f"{where}.{key}" if where else key) if isinstance(key, str) else f"{where}[{key}]"))


def _check_tools_shape(tools: Any) -> None:
    """``tools`` must be a list of ``{"type": "function", "function": {"name", ...}}`` objects."""
    if tools is None:
        return
    if not isinstance(tools, list) or not tools:
        raise RequestRefused(400, "invalid_tools", "tools must be a non-empty list of function tools.", param="tools")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise RequestRefused(400, "invalid_tools", f'tools[{i}] must be {{"type": "function", "function": '
                                 f"{{...}}}}; got {tool!r:.200}.", param=f"tools[{i}]")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise RequestRefused(400, "invalid_tools", f"tools[{i}].function.name must be 1 to 64 letters, digits, "
                                 f"'_' or '-'; got {name!r:.100}.", param=f"tools[{i}].function.name")
        if name in names:
            raise RequestRefused(400, "invalid_tools", f"tools[{i}]: the function {name!r} is given twice.",
                                 param=f"tools[{i}].function.name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise RequestRefused(400, "invalid_tools", f"tools[{i}].function.parameters must be a JSON schema "
                                 f"object; got {parameters!r:.100}.", param=f"tools[{i}].function.parameters")


def _tool_schema(tool: Any) -> dict[str, Any]:
    return tool.model_dump(exclude_none=True)


def _error_param(err: Exception) -> str | None:
    errors = getattr(err, "errors", None)
    if callable(errors):
        try:
            loc = errors()[0].get("loc", ())
        except (IndexError, TypeError):
            return None
        return ".".join(str(p) for p in loc) or None
    return getattr(err, "parameter", None)


def _message(message: Mapping[str, Any], index: int) -> Message:
    role = message.get("role")
    if role not in ROLES:
        raise RequestRefused(400, "invalid_request", f"messages[{index}].role must be one of {sorted(ROLES)}; "
                             f"got {role!r}.", param=f"messages[{index}].role")
    calls = tuple(_tool_call(c, index) for c in message.get("tool_calls") or ()) if role == "assistant" else ()
    return Message(role=ROLES[role], content=_content(message.get("content"), index), tool_calls=calls)


def _content(content: Any, index: int) -> str:
    """A message's text: a string, or its text parts joined by newlines (as vLLM joins them)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise RequestRefused(400, "unsupported_content", f"messages[{index}].content: only text parts are "
                                 f"supported; got a {kind!r} part.", param=f"messages[{index}].content")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_call(call: Mapping[str, Any], index: int) -> ToolCallText:
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, Mapping):
        raise RequestRefused(400, "invalid_request", f"messages[{index}].tool_calls: only function calls are "
                             f"supported; got {call!r:.200}.", param=f"messages[{index}].tool_calls")
    return ToolCallText(name=str(function.get("name")), arguments=str(function.get("arguments")), id=call.get("id"))


def reply_message(text: str, *, parse_tools: bool, call_index: int) -> Message:
    """The assistant message a reply's text becomes (tool calls read out when ``parse_tools``)."""
    if not parse_tools or TOOL_CALL_START not in text:
        return Message(role="assistant", content=text)
    parsed = parse_tool_calls(text)
    if any(call.error is not None for call in parsed.calls):
        return Message(role="assistant", content=text)  # as vLLM's Hermes parser: the agent sees the raw text
    calls = tuple(
        ToolCallText(name=str(c.name), arguments=json.dumps(c.arguments, ensure_ascii=False), id=f"call_{call_index}_{i}")
        for i, c in enumerate(parsed.calls)
    )
    return Message(role="assistant", content=parsed.content if parsed.content.strip() else "", tool_calls=calls)


def chat_completion(
    reply: Message, *, completion_id: str, model_name: str, finish_reason: str, prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """The ``ChatCompletion`` JSON of one reply (``finish_reason`` "tool_calls" when it has calls)."""
    from openai.types.chat import ChatCompletion

    message = reply_dict(reply)
    completion = ChatCompletion.model_validate({
        "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": model_name,
        "choices": [{
            "index": 0, "message": message, "logprobs": None,
            "finish_reason": "tool_calls" if reply.tool_calls else finish_reason,
        }],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    })  # fmt: skip
    return completion.model_dump(mode="json")


def reply_dict(reply: Message) -> dict[str, Any]:
    """The reply as an OpenAI message dict (for the transcript)."""
    out: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
    if reply.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in reply.tool_calls
        ]
    return out


def models_list(model_name: str, created: int) -> dict[str, Any]:
    """``GET /models``: the one served model, as the ``openai`` package's ``Model``."""
    from openai.types import Model

    model = Model(id=model_name, created=created, object="model", owned_by="flashrl")
    return {"object": "list", "data": [model.model_dump(mode="json", exclude_none=True)]}
