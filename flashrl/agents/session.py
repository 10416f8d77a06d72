"""One episode of an agent: its limits, its calls served through the engine, its refusals, its episode.

A session answers the chat-completions requests of one episode (streamed ones as the plain call,
then cut into chunks: :mod:`flashrl.agents.streaming`; Responses requests as the chat request they
mean: :mod:`flashrl.agents.responses_api`): it checks a request (:mod:`flashrl.agents.protocol`),
renders its prompt token-exactly (:class:`flashrl.agents.recorder.CallRecorder`), samples the
reply with the engine (the run's sampling, the seed of call ``k`` ``stream_seed(seed, k)``, the chat
template's stop tokens, as an env's episode in ``flashrl.env_runners.rollout.play_episode``),
records it and answers it. Every
refused request is counted in :attr:`AgentSession.errors` by its code, and past
``AgentLimits.max_refused`` of them (a wrong key and a closed session aside: those say nothing of
the agent) every further request is refused before it is read.

A body is parsed, checked and rendered in the server's rendering thread (``executor``), off the
event loop. Completion tokens are reserved per call (what the call may sample) and what it did not
sample is released when it ends; a call that would fit once the calls in flight release their
reservations waits for them instead of being refused, so concurrent calls are refused for
``max_completion_tokens`` only when the tokens sampled have used it up.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any

from flashrl.agents.protocol import RequestRefused, chat_completion, check_request, reply_dict
from flashrl.agents.recorder import CallRecorder
from flashrl.agents.responses_api import (
    assistant_message,
    read_responses_request,
    response_object,
    responses_refusal,
)
from flashrl.agents.streaming import chunks, response_events, split_stream
from flashrl.conversation import ChatTemplateError
from flashrl.engines.types import Engine, RequestError, SamplingConfig
from flashrl.episode import Episode
from flashrl.seeds import stream_seed

__all__ = ["AgentLimits", "AgentSession", "closed_refusal"]

logger = logging.getLogger("flashrl.agents")

NOT_THE_AGENTS = frozenset({"invalid_api_key", "session_closed", "refusal_limit"})
"""Refusals that do not count toward ``max_refused``: a wrong key may come from anyone who read the URL."""


@dataclass(frozen=True)
class AgentLimits:
    """Limits of one episode's model calls."""

    max_calls: int = 16
    """Model calls per episode; a call past it gets an OpenAI-style error (HTTP 429, code "call_limit")."""
    max_completion_tokens: int | None = None
    """Tokens the model may generate over the whole episode (None: no limit beyond each call's max)."""
    max_refused: int = 64
    """Refused requests per episode (bad JSON, refused parameters, limits; not a wrong key); past it every
    request is refused before its body is read (HTTP 429, code "refusal_limit")."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_refused, int) or self.max_refused < 1:
            raise ValueError(f"AgentLimits.max_refused must be an int >= 1; got {self.max_refused!r}.")
        if not isinstance(self.max_calls, int) or self.max_calls < 1:
            raise ValueError(f"AgentLimits.max_calls must be an int >= 1; got {self.max_calls!r}.")
        if self.max_completion_tokens is not None and (
            not isinstance(self.max_completion_tokens, int) or self.max_completion_tokens < 1
        ):
            raise ValueError(
                f"AgentLimits.max_completion_tokens must be None or an int >= 1; got {self.max_completion_tokens!r}."
            )


class AgentSession:
    """The endpoint's state for one episode (made by ``AgentServer.open_session``)."""

    def __init__(
        self, *, key: str, base_url: str, api_key: str, prompt_id: str, seed: int, limits: AgentLimits,
        engine: Engine, sampling: SamplingConfig, model_name: str, max_episode_tokens: int,
        max_observation_tokens: int | None, stop_token_ids: frozenset[int],
        on_close: Callable[[AgentSession], None] | None = None, executor: Executor | None = None,
        sampling_overrides: str = "refuse",
    ) -> None:
        self.key = key
        self.base_url = base_url
        """What the agent's ``openai`` client gets as ``base_url``."""
        self.api_key = api_key
        """This episode's own key (``Authorization: Bearer ...``), refused once the session is closed."""
        self.limits = limits
        self.calls = 0
        """Model calls served."""
        self.errors: Counter[str] = Counter()
        """Refused requests of this session, by code."""
        self.ignored: Counter[str] = Counter()
        """Settings the run's ``"ignore"`` policy left out of this session's calls, by name (`DISTRIBUTION_SETTINGS`)."""
        self._overrides = sampling_overrides
        self._engine = engine
        self._sampling = sampling
        self._model_name = model_name
        self._seed = int(seed)
        self._context = min(max_episode_tokens, engine.max_model_len)
        self._stop_ids = tuple(sorted(stop_token_ids))
        self._recorder = CallRecorder(
            engine.tokenizer, prompt_id=prompt_id, max_episode_tokens=max_episode_tokens,
            max_observation_tokens=max_observation_tokens, stop_token_ids=stop_token_ids,
        )
        self._admitted = 0  # calls let through to the engine: call k samples with stream_seed(seed, k)
        self._reserved = 0  # tokens the calls in flight may still sample
        self._generated = 0
        self._closed = False
        self._on_close = on_close
        self._executor = executor
        self._released = asyncio.Event()  # set (and replaced) when a call gives back its reservation
        self._transcript: list[dict[str, Any]] = []
        self._responses: dict[str, tuple[dict[str, Any], ...]] = {}  # response id -> its conversation (chat messages)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def tito_mismatches(self) -> int:
        """Assistant messages sent back whose text did not match the recorded ids (distinct messages)."""
        return len(self._recorder.mismatched)

    @property
    def num_segments(self) -> int:
        return self._recorder.num_segments

    @property
    def transcript(self) -> list[dict[str, Any]]:
        """The last call's messages and its reply (OpenAI message dicts)."""
        return [dict(m) for m in self._transcript]

    def close(self) -> None:
        """Refuse later calls (HTTP 404); a call in flight is answered with a refusal and not recorded."""
        if not self._closed:
            self._closed = True
            self._release()
            if self._on_close is not None:
                self._on_close(self)

    def to_episode(
        self, *, reward: float, terminated: bool = True, truncated: bool = False,
        info: dict[str, Any] | None = None,
    ) -> Episode | None:
        """The recorded episode (None when no call was made)."""
        details = {**(info or {}), "tito_mismatches": self.tito_mismatches, "errors": dict(self.errors),
                   "ignored_settings": sum(self.ignored.values())}
        return self._recorder.to_episode(reward=reward, terminated=terminated, truncated=truncated, info=details)

    def check_refusals(self) -> None:
        """Refuse (and count) a request once this episode's ``max_refused`` refusals are spent."""
        refused = sum(n for code, n in self.errors.items() if code not in NOT_THE_AGENTS)
        if refused >= self.limits.max_refused:
            self.errors["refusal_limit"] += 1
            raise RequestRefused(429, "refusal_limit", f"this episode's requests were refused {refused} times "
                                 f"(max_refused {self.limits.max_refused}); no more requests are read. Fix the "
                                 "agent's requests (each refusal's message says what was wrong).",
                                 type="rate_limit_error")

    async def chat(self, body: Any) -> dict[str, Any] | list[dict[str, Any]]:
        """Answer one chat-completions request (its body: JSON bytes or text, or parsed): the
        ``ChatCompletion``, or with ``stream=true`` its chunks (:mod:`flashrl.agents.streaming`); raise
        (and count) :class:`RequestRefused`."""
        self.check_refusals()
        try:
            return await self._chat(body)
        except RequestRefused as err:
            self.errors[err.code] += 1
            raise

    async def respond(self, body: Any) -> dict[str, Any] | list[dict[str, Any]]:
        """Answer one Responses request (:mod:`flashrl.agents.responses_api`) through the chat path: the
        ``Response``, or with ``stream=true`` its stream events; raise (and count) :class:`RequestRefused`."""
        self.check_refusals()
        try:
            self._check_open()
            if isinstance(body, bytes | bytearray | str):
                body = await self._offload(_parse_json, body)
            request = await self._offload(read_responses_request, body, self._responses)
            try:
                completion = await self._complete(request.chat_body)
            except RequestRefused as err:
                raise responses_refusal(err) from None
            response_id = "resp_" + completion["id"].removeprefix("chatcmpl-")
            if request.store:  # what a later previous_response_id continues (this episode's calls only)
                self._responses[response_id] = (*request.history, assistant_message(completion))
            response = response_object(completion, request, response_id=response_id)
            return response_events(response) if request.stream else response
        except RequestRefused as err:
            self.errors[err.code] += 1
            raise

    async def _offload(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in the rendering thread (here without one); too deep a nesting is a 400."""
        try:
            if self._executor is None:
                return fn(*args, **kwargs)
            return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))
        except RecursionError:
            raise RequestRefused(400, "invalid_request", "the request is nested too deeply to be read.") from None

    async def _chat(self, body: Any) -> dict[str, Any] | list[dict[str, Any]]:
        self._check_open()
        if isinstance(body, bytes | bytearray | str):
            body = await self._offload(_parse_json, body)
        body, stream = split_stream(body)  # a streamed call is sampled and recorded as the plain call
        completion = await self._complete(body)
        return completion if stream is None else chunks(completion, stream)

    async def _complete(self, body: Any) -> dict[str, Any]:
        """Check, render, sample and record one chat request (parsed); its ``ChatCompletion``."""
        self._check_open()
        request = await self._offload(check_request, body, sampling=self._sampling, model_name=self._model_name,
                                      overrides=self._overrides)
        self._check_calls_left()
        try:
            prompt = await self._offload(self._recorder.prompt, request.messages, request.tools)
        except ChatTemplateError as err:
            raise RequestRefused(400, "template_error", f"the messages cannot be rendered token-exactly: {err}",
                                 param="messages") from None
        self._check_open()
        room = self._context - len(prompt.ids)
        if room < 1:
            raise RequestRefused(
                400, "context_length_exceeded", f"the prompt has {len(prompt.ids)} tokens, but this endpoint's "
                f"context holds {self._context} (prompt and reply together); shorten or summarise the messages.",
                param="messages",
            )
        budget = await self._reserve(min(request.max_tokens, room))
        try:
            self._check_calls_left()
        except RequestRefused:
            self._reserved -= budget
            self._release()
            raise
        index = self._admitted
        self._admitted += 1
        sampling = replace(self._sampling, max_tokens=budget, seed=stream_seed(self._seed, index),
                           stop_token_ids=self._stop_ids, stop=request.stop)
        try:
            completion = await self._engine.generate(prompt.ids, sampling)
        except RequestError as err:
            raise RequestRefused(400, "invalid_request", f"the engine refused the request: {err}") from None
        except Exception as err:  # the engine failed this call: the agent is told, the session counts it
            logger.exception("The engine failed a call of agent session %s.", self.key)
            raise RequestRefused(500, "engine_error", f"the engine failed: {type(err).__name__}: {err}",
                                 type="server_error") from None
        finally:
            self._reserved -= budget  # what it did not sample goes back; what it did is counted below
            self._release()
        self._check_open()  # closed while sampling: the episode is over, the call is not recorded
        call = self._recorder.record(prompt, request.messages, completion, parse_tools=request.parse_tools,
                                     stop=request.stop)
        self.calls += 1
        _count_ignored(self.ignored, request.ignored)
        self._generated += len(call.completion_ids)
        self._transcript = [*request.raw_messages, reply_dict(call.reply)]
        if completion.finish_reason == "abort":  # recorded: the episode is dropped as "aborted"
            raise RequestRefused(503, "engine_aborted", "the engine aborted this call; the reply is incomplete.",
                                 type="server_error")
        return chat_completion(
            call.reply, completion_id=f"chatcmpl-{self.key[:12]}-{index}", model_name=self._model_name,
            finish_reason=completion.finish_reason, prompt_tokens=len(prompt.ids),
            completion_tokens=len(call.completion_ids),
        )

    async def _reserve(self, budget: int) -> int:
        """Reserve the tokens a call of up to ``budget`` tokens may sample under ``max_completion_tokens``;
        wait while the calls in flight hold what it could use; refuse when the episode's tokens are spent."""
        limit = self.limits.max_completion_tokens
        while limit is not None:
            self._check_open()
            self._check_calls_left()
            unused = limit - self._generated
            if unused < 1:
                raise RequestRefused(429, "completion_token_limit", f"this episode's {limit} completion tokens are "
                                     "used up (max_completion_tokens); end the episode.", type="rate_limit_error")
            budget = min(budget, unused)
            if self._reserved == 0 or unused - self._reserved >= budget:
                break
            await self._released.wait()
        self._reserved += budget
        return budget

    def _release(self) -> None:
        """Wake the calls waiting for a reservation (a call ended, or the session closed)."""
        self._released.set()
        self._released = asyncio.Event()

    def _check_calls_left(self) -> None:
        if self._admitted >= self.limits.max_calls:
            raise RequestRefused(429, "call_limit", f"this episode's {self.limits.max_calls} model calls are used "
                                 "up (max_calls); end the episode.", type="rate_limit_error")

    def _check_open(self) -> None:
        if self._closed:
            raise closed_refusal()


_warned_ignored: set[str] = set()


def _count_ignored(counts: Counter[str], names: tuple[str, ...]) -> None:
    """Count the settings a served call's request set and the run ignored; warn once per setting and process."""
    counts.update(names)
    for name in sorted(set(names) - _warned_ignored):
        _warned_ignored.add(name)
        logger.warning("An agent's request set %r, which would change the distribution the policy samples from; it is "
                       "ignored (agent_sampling_overrides=\"ignore\"): the call samples with the run's settings. Each "
                       "episode counts such settings in its info's ignored_settings (further ones are not logged).", name)


def _parse_json(raw: bytes | bytearray | str) -> Any:
    """A request body as JSON; HTTP 400 ``invalid_json`` when it is not (or nests past Python's recursion limit)."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise RequestRefused(400, "invalid_json", f"the body is not JSON: {type(err).__name__}: {err!s:.200}") from None


def closed_refusal() -> RequestRefused:
    """What a call on a closed session gets."""
    return RequestRefused(404, "session_closed", "this episode's session is closed; no more calls are served on it.",
                          type="not_found_error")
