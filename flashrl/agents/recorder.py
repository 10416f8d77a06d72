"""Token-exact recording of an agent's model calls, and the episode they make.

**The prompt of a call** is the chat template's rendering of the request's messages, built by
:class:`flashrl.conversation.TokenizedConversation`, so the template's control tokens are inserted
by id and every other text (contents, roles, tool schemas) is tokenised as plain text: a tool output
holding ``<|im_start|>`` stays characters, exactly as in an env's conversation. The request's
``tools`` go to the template (or, for a template that ignores them, into the system message) as
there.

**Token-in, token-out.** An assistant message the agent sends back is matched with the replies
recorded earlier in the episode: it matches one when its content and tool calls equal those of the
reply the agent got (tool-call arguments compared as parsed JSON). A matched message is not
tokenised again: the conversation gets the recorded ids (``add_model_turn``), so the prompt holds
exactly the tokens the model sampled, and the template's closing of that turn after them. A message
that matches no recorded reply (altered by the agent, or written by it) is counted in
``tito_mismatches`` (once per distinct message) and rendered from its text: the content, then its
tool calls as Hermes ``<tool_call>`` blocks (:meth:`flashrl.agents.protocol.Message.text`). The
assistant messages of an episode's first call are the agent's own context (worked examples, a
restored transcript), never replies of this episode: they are rendered from their text and not
counted, in that call or when later calls send them again.

**Segments.** A call whose prompt ids extend the previous call's full ids (its prompt, its sampled
ids and the template's closing of the turn) continues the same segment: only the new tail is
appended (``loss_mask`` False), then the sampled ids (``loss_mask`` True, with the engine's
log-probs). Any other call (the agent dropped, edited or summarised earlier messages) starts a new
segment with its whole prompt (:attr:`flashrl.episode.Episode.segment_starts`). Each segment ends
with the closing of its last turn when that fits in ``max_episode_tokens``, so a segment's ids are
the tokenisation of its last call's conversation with the reply, as :meth:`TokenizedConversation.to_episode`
gives for one conversation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flashrl.agents.protocol import Message, reply_message
from flashrl.conversation import TokenizedConversation, chat_stop_token_ids
from flashrl.engines.types import Completion
from flashrl.episode import Episode

__all__ = ["CallRecorder", "Prompt", "RecordedCall"]


@dataclass(frozen=True)
class RecordedCall:
    """One model call as recorded."""

    messages: tuple[Message, ...]
    """The request's messages."""
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    """What the engine sampled (a final stop token included)."""
    logprobs: tuple[float, ...]
    """The engine's behavior log-prob of each sampled id."""
    version: int
    finish_reason: str
    closing_ids: tuple[int, ...]
    """The template's end of the turn that the model did not sample (``<|im_end|>\\n`` or ``\\n``)."""
    reply: Message
    """The assistant message the agent got."""
    continues: bool
    """Whether the prompt extends the previous call's full ids (same segment)."""

    @property
    def full_ids(self) -> tuple[int, ...]:
        return self.prompt_ids + self.completion_ids + self.closing_ids


@dataclass
class Prompt:
    """A call's prompt ids and the conversation that rendered them (the reply is added to it)."""

    ids: list[int]
    conversation: TokenizedConversation
    mismatches: list[tuple[Any, ...]]
    """The keys of assistant messages that matched no recorded reply."""


def before_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the stop string that ends first in it (vLLM's choice when several match), or all of it."""
    ends = [(i + len(s), i) for s in stop if (i := text.find(s)) != -1]
    return text[: min(ends)[1]] if ends else text


class CallRecorder:
    """The calls of one episode: their prompts (token-in, token-out), replies and segments.

    Args:
        tokenizer: The engine's tokenizer (with its chat template).
        prompt_id: The episode's task key.
        max_episode_tokens: Context budget of a segment (a closing that does not fit is left out).
        max_observation_tokens: Longest non-assistant message after a recorded reply, cut with a
            marker as in an env's conversation (None: no limit).
        stop_token_ids: Token ids that end a model turn; default: the tokenizer's EOS and end of turn.
    """

    def __init__(
        self, tokenizer: Any, *, prompt_id: str, max_episode_tokens: int,
        max_observation_tokens: int | None = None, stop_token_ids: Iterable[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_id = prompt_id
        self.max_episode_tokens = max_episode_tokens
        self.max_observation_tokens = max_observation_tokens
        self.stop_token_ids = (
            frozenset(stop_token_ids) if stop_token_ids is not None else chat_stop_token_ids(tokenizer)
        )
        self.calls: list[RecordedCall] = []
        self.mismatched: set[tuple[Any, ...]] = set()
        """Distinct assistant messages sent back that matched no recorded reply."""
        self.agent_context: set[tuple[Any, ...]] = set()
        """The assistant messages of the first call (the agent's own context): never mismatches."""

    @property
    def num_segments(self) -> int:
        return sum(1 for call in self.calls if not call.continues)

    def prompt(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] = ()) -> Prompt:
        """The prompt ids of a request (see the module doc); raises ``ChatTemplateError``."""
        conversation: TokenizedConversation | None = None
        pending: list[dict[str, str]] = []
        mismatches: list[tuple[Any, ...]] = []
        for i, message in enumerate(messages):
            recorded = self._match(message, messages[:i]) if message.role == "assistant" else None
            if recorded is not None and pending and pending[-1]["role"] != "assistant":
                conversation = self._extend(conversation, pending, tools)
                pending = []
                conversation.add_model_turn(
                    recorded.completion_ids, recorded.logprobs, version=recorded.version,
                    finish_reason=recorded.finish_reason,
                )
                continue
            if message.role == "assistant" and recorded is None and self.calls and message.key() not in self.agent_context:
                mismatches.append(message.key())
            pending.append({"role": message.role, "content": message.text()})
        conversation = self._extend(conversation, pending, tools)
        return Prompt(ids=conversation.token_ids, conversation=conversation, mismatches=mismatches)

    def record(
        self, prompt: Prompt, messages: Sequence[Message], completion: Completion, *, parse_tools: bool,
        stop: Sequence[str] = (),
    ) -> RecordedCall:
        """Add the engine's completion of ``prompt`` as the next call; return it (with the reply). With ``stop``
        strings, a reply that ended on one has the text before it, as OpenAI's and vLLM's replies (the recorded
        ids keep the token that completed it: the agent sends back the text, which matches this reply)."""
        n = len(prompt.ids)
        text = prompt.conversation.add_model_turn(
            completion.token_ids, completion.logprobs, version=completion.version,
            finish_reason=completion.finish_reason,
        )
        if stop and completion.finish_reason == "stop":
            text = before_stop(text, stop)
        full = prompt.conversation.to_episode(reward=0.0, prompt_id=self.prompt_id).token_ids
        completion_ids = tuple(int(t) for t in completion.token_ids)
        previous = self.calls[-1].full_ids if self.calls else None
        call = RecordedCall(
            messages=tuple(messages), prompt_ids=tuple(prompt.ids), completion_ids=completion_ids,
            logprobs=tuple(float(x) for x in completion.logprobs), version=int(completion.version),
            finish_reason=completion.finish_reason, closing_ids=tuple(full[n + len(completion_ids):]),
            reply=reply_message(text, parse_tools=parse_tools, call_index=len(self.calls)),
            continues=previous is not None and len(prompt.ids) > len(previous)
            and tuple(prompt.ids[: len(previous)]) == previous,
        )
        if not self.calls:
            self.agent_context = {m.key() for m in messages if m.role == "assistant"}
        self.calls.append(call)
        self.mismatched.update(prompt.mismatches)
        return call

    def to_episode(
        self, *, reward: float, terminated: bool, truncated: bool, info: Mapping[str, Any],
    ) -> Episode | None:
        """The episode of the recorded calls (None without any)."""
        if not self.calls:
            return None
        ids: list[int] = []
        mask: list[bool] = []
        logprobs: list[float] = []
        starts: list[int] = []
        segment_start = 0

        def append(tokens: Sequence[int], sampled: Sequence[float] | None = None) -> None:
            ids.extend(tokens)
            mask.extend([sampled is not None] * len(tokens))
            logprobs.extend(sampled if sampled is not None else [0.0] * len(tokens))

        for index, call in enumerate(self.calls):
            if call.continues:
                append(call.prompt_ids[len(ids) - segment_start:])
            else:
                if index:
                    self._close(append, ids, segment_start, self.calls[index - 1])
                segment_start = len(ids)
                starts.append(segment_start)
                append(call.prompt_ids)
            append(call.completion_ids, call.logprobs)
        self._close(append, ids, segment_start, self.calls[-1])
        details = dict(info)
        details.update(
            calls=len(self.calls), segments=len(starts), num_model_turns=len(self.calls),
            tool_calls=sum(len(call.reply.tool_calls) for call in self.calls),
            finish_reasons=[call.finish_reason for call in self.calls],
        )
        return Episode(
            prompt_id=self.prompt_id, token_ids=ids, loss_mask=mask, behavior_logprobs=logprobs,
            reward=float(reward), policy_versions=[call.version for call in self.calls],
            terminated=terminated, truncated=truncated, info=details,
            segment_starts=starts if len(starts) > 1 else None,
        )

    def _close(self, append: Any, ids: list[int], segment_start: int, call: RecordedCall) -> None:
        """End a segment with its last turn's closing, when it fits the context budget."""
        if len(ids) - segment_start + len(call.closing_ids) <= self.max_episode_tokens:
            append(call.closing_ids)

    def _extend(
        self, conversation: TokenizedConversation | None, messages: list[dict[str, str]],
        tools: Sequence[Mapping[str, Any]],
    ) -> TokenizedConversation:
        if conversation is None:
            return TokenizedConversation(
                self.tokenizer, messages, prompt_id=self.prompt_id, stop_token_ids=self.stop_token_ids,
                tools=list(tools) or None, max_observation_tokens=self.max_observation_tokens,
            )
        conversation.add_env_messages(messages)
        return conversation

    def _match(self, message: Message, before: Sequence[Message]) -> RecordedCall | None:
        """The recorded reply ``message`` is (see the module doc): among equal replies, the one whose
        call had the same messages before it, else the latest."""
        key = message.key()
        found = [call for call in self.calls if call.reply.key() == key]
        if not found:
            return None
        history = [m.key() for m in before]
        return next((call for call in reversed(found) if [m.key() for m in call.messages] == history), found[-1])
