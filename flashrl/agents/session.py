"""One episode of an agent: its limits, its calls served through the engine, its refusals, its episode.

A session answers the chat-completions requests of one episode: it checks a request
(:mod:`flashrl.agents.protocol`), renders its prompt token-exactly
(:class:`flashrl.agents.recorder.CallRecorder`), samples the reply with the engine (the run's
sampling, the seed of call ``k`` ``stream_seed(seed, k)``, the chat template's stop tokens, as an
env's episode in ``flashrl.env_runners.rollout.play_episode``), records it and answers it. Every
refused request is counted in :attr:`AgentSession.errors` by its code.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from flashrl.agents.protocol import RequestRefused, chat_completion, check_request, reply_dict
from flashrl.agents.recorder import CallRecorder
from flashrl.conversation import ChatTemplateError
from flashrl.engines.types import Engine, RequestError, SamplingConfig
from flashrl.episode import Episode
from flashrl.seeds import stream_seed

__all__ = ["AgentLimits", "AgentSession", "closed_refusal"]

logger = logging.getLogger("flashrl.agents")


@dataclass(frozen=True)
class AgentLimits:
    """Limits of one episode's model calls."""

    max_calls: int = 16
    """Model calls per episode; a call past it gets an OpenAI-style error (HTTP 429, code "call_limit")."""
    max_completion_tokens: int | None = None
    """Tokens the model may generate over the whole episode (None: no limit beyond each call's max)."""

    def __post_init__(self) -> None:
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
        on_close: Callable[[AgentSession], None] | None = None,
    ) -> None:
        self.key = key
        self.base_url = base_url
        """What the agent's ``openai`` client gets as ``base_url``."""
        self.api_key = api_key
        """The per-run token (``Authorization: Bearer ...``)."""
        self.limits = limits
        self.calls = 0
        """Model calls served."""
        self.errors: Counter[str] = Counter()
        """Refused requests of this session, by code."""
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
        self._transcript: list[dict[str, Any]] = []

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
            if self._on_close is not None:
                self._on_close(self)

    def to_episode(
        self, *, reward: float, terminated: bool = True, truncated: bool = False,
        info: dict[str, Any] | None = None,
    ) -> Episode | None:
        """The recorded episode (None when no call was made)."""
        details = {**(info or {}), "tito_mismatches": self.tito_mismatches, "errors": dict(self.errors)}
        return self._recorder.to_episode(reward=reward, terminated=terminated, truncated=truncated, info=details)

    async def chat(self, body: Any) -> dict[str, Any]:
        """Answer one chat-completions request body; raise (and count) :class:`RequestRefused`."""
        try:
            return await self._chat(body)
        except RequestRefused as err:
            self.errors[err.code] += 1
            raise

    async def _chat(self, body: Any) -> dict[str, Any]:
        self._check_open()
        request = check_request(body, sampling=self._sampling, model_name=self._model_name)
        if self._admitted >= self.limits.max_calls:
            raise RequestRefused(429, "call_limit", f"this episode's {self.limits.max_calls} model calls are used "
                                 "up (max_calls); end the episode.", type="rate_limit_error")
        try:
            prompt = self._recorder.prompt(request.messages, request.tools)
        except ChatTemplateError as err:
            raise RequestRefused(400, "template_error", f"the messages cannot be rendered token-exactly: {err}",
                                 param="messages") from None
        room = self._context - len(prompt.ids)
        if room < 1:
            raise RequestRefused(
                400, "context_length_exceeded", f"the prompt has {len(prompt.ids)} tokens, but this endpoint's "
                f"context holds {self._context} (prompt and reply together); shorten or summarise the messages.",
                param="messages",
            )
        budget = min(request.max_tokens, room)
        if self.limits.max_completion_tokens is not None:
            left = self.limits.max_completion_tokens - self._generated - self._reserved
            if left < 1:
                raise RequestRefused(429, "completion_token_limit", f"this episode's {self.limits.max_completion_tokens} "
                                     "completion tokens are used up (max_completion_tokens); end the episode.",
                                     type="rate_limit_error")
            budget = min(budget, left)
        index = self._admitted
        self._admitted += 1
        sampling = replace(self._sampling, max_tokens=budget, seed=stream_seed(self._seed, index),
                           stop_token_ids=self._stop_ids)
        self._reserved += budget
        try:
            completion = await self._engine.generate(prompt.ids, sampling)
        except RequestError as err:
            raise RequestRefused(400, "invalid_request", f"the engine refused the request: {err}") from None
        except Exception as err:  # the engine failed this call: the agent is told, the session counts it
            logger.exception("The engine failed a call of agent session %s.", self.key)
            raise RequestRefused(500, "engine_error", f"the engine failed: {type(err).__name__}: {err}",
                                 type="server_error") from None
        finally:
            self._reserved -= budget
        self._check_open()  # closed while sampling: the episode is over, the call is not recorded
        call = self._recorder.record(prompt, request.messages, completion, parse_tools=request.parse_tools)
        self.calls += 1
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

    def _check_open(self) -> None:
        if self._closed:
            raise closed_refusal()


def closed_refusal() -> RequestRefused:
    """What a call on a closed session gets."""
    return RequestRefused(404, "session_closed", "this episode's session is closed; no more calls are served on it.",
                          type="not_found_error")
