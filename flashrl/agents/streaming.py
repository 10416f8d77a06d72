"""Streamed replies: a chat call's ``stream=true`` answered as server-sent events of OpenAI's
``chat.completion.chunk`` objects, and a Responses call's as the Responses API's stream events.

**Recorded as a plain call.** A streamed request is the same request without ``stream`` and
``stream_options``: it is checked, rendered, sampled (the same seed) and recorded by the very path of a
non-streamed call, so the episode holds exactly the tokens and log-probs that call would record. Only
then is the reply, the finished ``ChatCompletion``, cut into chunks: the role first, the content in
pieces, each tool call (its id and name, then its arguments in pieces), a last chunk with the
``finish_reason``, and, with ``stream_options={"include_usage": true}``, a chunk with no choices and
the usage (every earlier chunk then has ``"usage": null``), as OpenAI sends them; then
``data: [DONE]``. The chunks arrive together once the reply is sampled: an engine could stream tokens
as it samples (vLLM's ``AsyncLLM.generate`` yields partial outputs), but the tool calls are parsed from
the whole reply (a ``<tool_call>`` block's prose and calls are told apart only at its end), the
episode's recording does not depend on it, and an agent's framework waits for the end of the stream
before it acts on a reply. A refused request is an ordinary HTTP error before any chunk.

A streamed Responses call (:mod:`flashrl.agents.responses_api`) is likewise the plain call's
``Response``, sent as ``response.created``, ``response.in_progress``, for each output item its
``added`` event, its text or arguments in ``delta`` events and its ``done`` events, then
``response.completed`` (``response.incomplete`` when the reply was cut by the token limit).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from flashrl.agents.protocol import RequestRefused

__all__ = ["StreamOptions", "chunks", "response_events", "server_sent_events", "split_stream"]

_PIECE = re.compile(r"\S*\s*")  # a word and the spaces after it: the pieces of a streamed text


@dataclass(frozen=True)
class StreamOptions:
    """How a streamed reply is sent."""

    include_usage: bool = False
    """Whether a last chunk carries the usage (``stream_options={"include_usage": true}``)."""


def split_stream(body: Any) -> tuple[Any, StreamOptions | None]:
    """A chat request's body without ``stream`` and ``stream_options``, and how to stream its reply (None:
    answer it as one ``ChatCompletion``); raise :class:`RequestRefused` for a malformed setting."""
    if not isinstance(body, dict) or ("stream" not in body and "stream_options" not in body):
        return body, None
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestRefused(400, "invalid_request", f"stream must be true or false; got {stream!r:.100}.",
                             param="stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise RequestRefused(400, "invalid_request", "stream_options can only be given with stream=true; "
                                 "leave it out or send stream=true.", param="stream_options")
        _check_options(options)
    rest = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    if not stream:
        return rest, None
    return rest, StreamOptions(include_usage=bool((options or {}).get("include_usage")))


def _check_options(options: Any) -> None:
    if not isinstance(options, dict):
        raise RequestRefused(400, "invalid_request", f"stream_options must be an object; got {options!r:.100}.",
                             param="stream_options")
    for name, value in options.items():
        if name not in ("include_usage", "include_obfuscation", "continuous_usage_stats"):
            raise RequestRefused(400, "unsupported_parameter", f"stream_options {name!r:.60} is not supported; "
                                 "only include_usage is.", param="stream_options")
        if value is not None and not isinstance(value, bool):
            raise RequestRefused(400, "invalid_request", f"stream_options.{name} must be true or false; got "
                                 f"{value!r:.100}.", param=f"stream_options.{name}")
    if options.get("continuous_usage_stats"):
        raise RequestRefused(400, "unsupported_parameter", "stream_options.continuous_usage_stats=true is not "
                             "supported (the usage comes once, in the last chunk); send include_usage instead.",
                             param="stream_options.continuous_usage_stats")


def chunks(completion: Mapping[str, Any], options: StreamOptions) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of a ``ChatCompletion`` (its JSON), in order."""
    from openai.types.chat import ChatCompletionChunk

    choice = completion["choices"][0]
    message = choice["message"]
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    deltas += [{"content": piece} for piece in _pieces(message.get("content") or "")]
    for index, call in enumerate(message.get("tool_calls") or ()):
        function = call["function"]
        deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                       "function": {"name": function["name"], "arguments": ""}}]})
        deltas += [{"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
                   for piece in _pieces(function["arguments"])]
    head = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
            "model": completion["model"]}
    if options.include_usage:
        head["usage"] = None
    out = [{**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
           for delta in deltas]
    out.append({**head, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                     "finish_reason": choice["finish_reason"]}]})
    if options.include_usage:
        out.append({**head, "choices": [], "usage": completion["usage"]})
    # validated as the openai package reads them; dumped without the fields OpenAI leaves out of a chunk
    return [ChatCompletionChunk.model_validate(chunk).model_dump(mode="json", exclude_unset=True) for chunk in out]


def response_events(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The Responses API's stream events of a finished ``Response`` (its JSON), in order: created, in
    progress, each output item (added; a message's text part and its text in pieces, or a function
    call's arguments in pieces; done), then completed (``response.incomplete`` for a reply cut short)."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    start = {**response, "status": "in_progress", "output": [], "usage": None, "completed_at": None,
             "incomplete_details": None}
    events: list[dict[str, Any]] = [{"type": "response.created", "response": start},
                                    {"type": "response.in_progress", "response": start}]
    for index, item in enumerate(response["output"]):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": {**item, "status": "in_progress", "content": []}})
            events.append({"type": "response.content_part.added", **where, "content_index": 0,
                           "part": {**part, "text": ""}})
            events += [{"type": "response.output_text.delta", **where, "content_index": 0, "delta": piece,
                        "logprobs": []} for piece in _pieces(part["text"])]
            events.append({"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"],
                           "logprobs": []})
            events.append({"type": "response.content_part.done", **where, "content_index": 0, "part": part})
        else:
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": {**item, "status": "in_progress", "arguments": ""}})
            events += [{"type": "response.function_call_arguments.delta", **where, "delta": piece}
                       for piece in _pieces(item["arguments"])]
            events.append({"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    end = "response.completed" if response["status"] == "completed" else "response.incomplete"
    events.append({"type": end, "response": response})
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    return [adapter.validate_python({**event, "sequence_number": number}).model_dump(mode="json", by_alias=True)
            for number, event in enumerate(events)]


def server_sent_events(objects: list[dict[str, Any]], *, named: bool = False) -> Iterator[bytes]:
    """Each object as one ``data:`` event, then ``data: [DONE]`` (what the ``openai`` client reads); with
    ``named``, each event carries its object's ``type`` as its name and no ``[DONE]`` follows (the Responses
    API's stream)."""
    for item in objects:
        name = f"event: {item['type']}\n" if named else ""
        yield f"{name}data: {json.dumps(item, ensure_ascii=False)}\n\n".encode()
    if not named:
        yield b"data: [DONE]\n\n"


def _pieces(text: str) -> list[str]:
    """``text`` in pieces (a word and its trailing spaces each) that join back to it exactly."""
    return [piece for piece in _PIECE.findall(text) if piece]
