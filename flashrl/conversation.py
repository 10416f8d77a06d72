"""Token-exact episodes: one token sequence with a loss mask, built through the chat template.

:class:`TokenizedConversation` follows one interaction and turns it into a
:class:`flashrl.episode.Episode`:

* The **prompt** (the messages ``env.reset`` returned) is rendered with the tokenizer's chat template
  and the generation prompt, then tokenised (``loss_mask`` False).
* A **model turn** is appended exactly as sampled: the engine's token ids and their behavior
  log-probs (``loss_mask`` True). They are never decoded and re-encoded; they are decoded only to
  give the environment the reply text and to keep the message list for the template.
* An **environment turn** is tokenised as a *template delta*: the conversation is rendered without
  and with the new messages (the latter with the generation prompt for the next model turn), the
  former must be a prefix of the latter (else :class:`ChatTemplateError`), and the suffix is
  tokenised and appended (``loss_mask`` False).

**Control tokens come from the template only.** Text from the environment, its tools and its
dataset is data: a tool's output that contains ``<|im_start|>`` must not become a real turn marker
(it would let the model forge turns for itself through the tool, or a dataset forge them in a prompt).
Every special token of the tokenizer that the chat template itself emits is inserted by id; all other
text is tokenised with ``split_special_tokens=True``, so a control token's text in it is ordinary
characters. That holds for every string that enters the template: message contents (system prompts
included), roles, the tool schemas (names, descriptions, parameters: every key and value) and the
other ``chat_template_kwargs``. To tell the template's control tokens from such text, the conversation
is rendered once more as a *skeleton*: contents replaced by placeholders, and every other string that
holds a control token's text (or starts with the end of one, or ends with the start of one) written
with each character of a control token's text swapped for a private-use character of its own. What
the skeleton still holds of control tokens is the template's; the skeleton with the contents and the
characters put back must equal the real rendering, else :class:`ChatTemplateError` (a template that
rewrites such text cannot be told apart from its own tokens). Where no string holds such text, the
result equals tokenising the rendered conversation (the tokenizer splits at control tokens first
either way).

**The end of a model turn.** The template closes an assistant message with its end-of-turn text
(SmolLM2: ``<|im_end|>\\n``). What the model sampled is kept as is and only the missing rest is
added, with ``loss_mask`` False, in front of the next delta:

* the model stopped on the end-of-turn token (``<|im_end|>``, sampled and trained on): only the
  rest (``\\n``) is added;
* the model stopped on length (or was cut by the context budget, or stopped on another stop token
  such as ``<|endoftext|>``): the whole closing (``<|im_end|>\\n``) is added. The model is never
  trained on an end token it did not sample.

After the last model turn, :meth:`TokenizedConversation.to_episode` adds that closing too (when it
fits), so that for templates that render message content verbatim, decoding the episode's tokens
gives exactly ``apply_chat_template(conversation.messages)``.

**Tools.** With ``tools`` (OpenAI-style function schemas, :func:`flashrl.tool_calls.function_schema`), a
chat template that renders them gets them as ``apply_chat_template(..., tools=tools)`` on every render
(Qwen2.5, Qwen3, Hermes: the schemas go into the system turn); for a template that ignores them
(SmolLM2's) the same description, in the words of Qwen2.5's template
(:func:`flashrl.tool_calls.hermes_tools_prompt`), is put into the system message instead
(:attr:`TokenizedConversation.tools_rendered_by` says which). Tool results are messages with role
``"tool"``, rendered by the template like any other environment turn. The model's tool calls stay in
its reply text (``<tool_call>...</tool_call>``, its sampled tokens); they are not moved into a
structured ``tool_calls`` field, which templates re-render differently (Qwen2.5 adds a newline and
re-serialises the JSON), so the template delta stays a suffix of what the model saw.

**Observation limit.** With ``max_observation_tokens``, each environment message longer than that
(its content tokenised alone) keeps its first ``max_observation_tokens`` tokens (backing off to a
whole character) and ends with the marker ``"\n[... N more tokens cut]"``; the message list keeps the
cut text, and ``info["observations_cut"]`` counts the messages cut.

**Context budget.** With ``max_tokens`` (the engine's context length, typically), the sequence never
grows past it: a model turn longer than the room left is cut to fit (its kept tokens are still the
sampled ones), an environment turn that does not fit with room for one more model token is not
appended, and in both cases :attr:`TokenizedConversation.truncated` becomes True and the episode is
returned with ``truncated=True`` instead of an error. A prompt that alone fills the budget gives a
truncated conversation with no room to generate (``max_new_tokens() == 0``).

Typical use in an env runner::

    messages, info = env.reset(seed=seed)
    conv = TokenizedConversation(tokenizer, messages, prompt_id=info["prompt_id"], max_tokens=4096)
    reward, terminated, truncated, step_info = 0.0, False, False, {}
    while conv.max_new_tokens(256) > 0:
        out = await engine.generate(conv.token_ids, replace(sampling, max_tokens=conv.max_new_tokens(256)))
        text = conv.add_model_turn(out.token_ids, out.logprobs, version=out.version,
                                   finish_reason=out.finish_reason)
        new_messages, r, terminated, truncated, step_info = env.step(text)
        reward += r
        if terminated or truncated or not conv.add_env_messages(new_messages):
            break
    episode = conv.to_episode(reward=reward, terminated=terminated, truncated=truncated, info=step_info)
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flashrl.episode import Episode
from flashrl.tool_calls import hermes_tools_prompt, template_renders_tools


class ChatTemplateError(ValueError):
    """The chat template does not render the conversation in a way that can be extended token-exactly."""


def _message_list(messages: Any, what: str) -> list[dict[str, str]]:
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"{what}: expected a list of messages, got {type(messages).__name__}.")
    out = []
    for i, m in enumerate(messages):
        if (
            not isinstance(m, Mapping)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise TypeError(
                f"{what}: message {i} must be a dict with str 'role' and 'content'; got {m!r:.200}."
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out


class TokenizedConversation:
    """A growing token sequence with its loss mask, behavior log-probs and chat messages.

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template (the engine's ``tokenizer``).
        messages: The initial messages (what ``env.reset`` returned).
        prompt_id: The task key (``info["prompt_id"]`` from ``env.reset``); may instead be given to
            :meth:`to_episode`.
        max_tokens: Context budget in tokens for the whole sequence; ``None`` for no limit.
        chat_template_kwargs: Extra keyword arguments for ``tokenizer.apply_chat_template``.
        stop_token_ids: Token ids that end a model turn; by default the tokenizer's EOS token and the
            template's end-of-turn token (see :attr:`stop_token_ids`; pass them to the sampler).
        tools: Tool schemas for the chat template (see "Tools" in the module doc); ``None`` for none.
        max_observation_tokens: Longest environment message, in tokens of its content; longer ones are
            cut with a marker (see "Observation limit"); ``None`` for no limit.
    """

    def __init__(
        self,
        tokenizer: Any,
        messages: Sequence[Mapping[str, str]],
        *,
        prompt_id: str | None = None,
        max_tokens: int | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        stop_token_ids: Iterable[int] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        max_observation_tokens: int | None = None,
    ) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ChatTemplateError(
                f"{type(tokenizer).__name__} has no chat_template; TokenizedConversation needs one "
                "(load an instruct/chat model's tokenizer or set tokenizer.chat_template)."
            )
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be None or >= 1; got {max_tokens}.")
        if max_observation_tokens is not None and max_observation_tokens < 1:
            raise ValueError(f"max_observation_tokens must be None or >= 1; got {max_observation_tokens}.")
        self.tokenizer = tokenizer
        self.max_observation_tokens = max_observation_tokens
        self.prompt_id = prompt_id
        self.max_tokens = max_tokens
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._messages = _message_list(messages, "TokenizedConversation(messages=...)")
        if not self._messages:
            raise ValueError("TokenizedConversation needs at least one initial message.")
        self.tools: list[dict[str, Any]] = [copy.deepcopy(dict(t)) for t in tools or ()]
        """The tool schemas of this conversation (empty without tools)."""
        self.tools_rendered_by: str | None = None
        """``"template"`` (the chat template renders ``tools``), ``"system_prompt"`` (it does not; the
        description is in the system message) or None without tools."""
        if self.tools:
            self._install_tools()
        self.stop_token_ids: frozenset[int] = (
            frozenset(stop_token_ids)
            if stop_token_ids is not None
            else chat_stop_token_ids(tokenizer, self.chat_template_kwargs)
        )
        """Token ids that end a model turn (pass them to the sampler as stop tokens)."""
        self._ids: list[int] = []
        self._mask: list[bool] = []
        self._logprobs: list[float] = []
        self._versions: list[int] = []
        self._finish_reasons: list[str] = []
        self._routing: list[np.ndarray] = []  # the routed experts of positions 0 .. routed_positions - 1
        self._routed = 0
        self._pending_close = ""
        self._sampled_stop = ""  # the text of the stop token that ended the last model turn, if any
        self._truncated = False
        self._observations_cut = 0
        self._verbatim = True
        self._controls = _control_tokens(tokenizer)
        prompt = self._tokenize(*self._render_marked(self._messages, generation_prompt=True))
        self._append(prompt, mask=False)
        self.prompt_length = len(prompt)
        """Number of prompt tokens (the start of the first model turn)."""
        if self.max_tokens is not None and len(prompt) >= self.max_tokens:
            self._truncated = True

    # ----------------------------------------------------------------------------- read access
    @property
    def token_ids(self) -> list[int]:
        """The whole sequence so far; after an env turn, the prompt for the next model turn."""
        return list(self._ids)

    def prompt_token_ids(self) -> list[int]:
        """The prompt for the next model turn (the whole sequence so far)."""
        return list(self._ids)

    @property
    def loss_mask(self) -> list[bool]:
        return list(self._mask)

    @property
    def behavior_logprobs(self) -> list[float]:
        return list(self._logprobs)

    @property
    def messages(self) -> list[dict[str, str]]:
        """The conversation as chat messages (model turns as decoded text)."""
        return copy.deepcopy(self._messages)

    @property
    def truncated(self) -> bool:
        """Whether the context budget was reached (no further turn can be added)."""
        return self._truncated

    @property
    def routed_positions(self) -> int:
        """Positions whose routed experts are recorded (from 0): the next turn's ``routed_experts_start``."""
        return self._routed

    @property
    def num_model_turns(self) -> int:
        return len(self._versions)

    def __len__(self) -> int:
        return len(self._ids)

    def max_new_tokens(self, limit: int) -> int:
        """How many tokens the next model turn may sample: ``limit`` capped by the budget left."""
        if self._truncated:
            return 0
        if self.max_tokens is None:
            return limit
        return max(0, min(limit, self.max_tokens - len(self._ids)))

    # ----------------------------------------------------------------------------- growth
    def add_model_turn(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        version: int,
        finish_reason: str = "stop",
        routed_experts: np.ndarray | None = None,
    ) -> str:
        """Append the sampled tokens as they are; return the reply text to pass to ``env.step``.

        Args:
            token_ids: The ids the engine sampled, including a final stop token if it emitted one.
            logprobs: The behavior log-prob the engine recorded for each sampled id. Kept as reported,
                even NaN, inf or > 0: a bad engine output is the episode's problem, not a reason to
                crash the runner; ``Episode.is_finite`` and the env runners' ``skip_reason`` drop such
                episodes and count them (``non_finite``, ``invalid_logprob``).
            version: Policy version that sampled this turn.
            finish_reason: ``"stop"``, ``"length"`` or ``"abort"``, as the engine reported it (kept in
                ``info["finish_reasons"]``; whether the turn ended on a stop token is read from the
                ids). The env runners drop an episode with an ``"abort"`` turn (``aborted``).
            routed_experts: The engine's ``Completion.routed_experts`` (an MoE engine that records
                routing, asked with ``routed_experts_start=routed_positions``): the rows of positions
                ``routed_positions`` on. A position keeps the routing of the turn that first recorded
                it (as Molt's ``absorb_routing``): the routing its own log-prob was sampled with.
        """
        if self._truncated:
            raise RuntimeError(
                "add_model_turn after the context budget was reached; check max_new_tokens() > 0 "
                "before sampling and end the episode with to_episode()."
            )
        if self._messages[-1]["role"] == "assistant":
            raise RuntimeError("add_model_turn twice in a row; add the environment's reply in between.")
        ids = [int(t) for t in token_ids]
        lps = [float(x) for x in logprobs]
        if len(ids) != len(lps):
            raise ValueError(
                f"add_model_turn: {len(ids)} token ids but {len(lps)} logprobs; they must align."
            )
        room = self.max_new_tokens(len(ids))
        if room < len(ids):
            ids, lps = ids[:room], lps[:room]
            self._truncated = True
            if finish_reason != "abort":  # an aborted turn stays aborted (the runners drop it)
                finish_reason = "length"
        stopped = bool(ids) and ids[-1] in self.stop_token_ids
        content_ids = ids[:-1] if stopped else ids
        content = self._decode(content_ids)
        before = self._render(self._messages, generation_prompt=True)
        self._messages.append({"role": "assistant", "content": content})
        closing = self._closing_text(before, content)
        self._sampled_stop = self._decode(ids[-1:]) if stopped else ""
        closing = closing.removeprefix(self._sampled_stop)
        self._pending_close = closing
        self._ids.extend(ids)
        self._mask.extend([True] * len(ids))
        self._logprobs.extend(lps)
        self._versions.append(int(version))
        self._finish_reasons.append(finish_reason)
        if routed_experts is not None:
            rows = np.asarray(routed_experts)[: len(self._ids) - self._routed]  # a truncated turn keeps less
            self._routing.append(rows)
            self._routed += len(rows)
        return content

    def add_env_messages(self, messages: Sequence[Mapping[str, str]]) -> bool:
        """Append the environment's reply turn as a template delta (``loss_mask`` False).

        Returns False (and marks the conversation truncated, appending nothing) when the delta would
        leave no room for another model token within ``max_tokens``.
        """
        if self._truncated:
            return False
        if self._messages[-1]["role"] != "assistant":
            raise RuntimeError(
                "add_env_messages before a model turn: the sequence ends with the generation prompt, "
                "so the environment's reply must follow add_model_turn."
            )
        new = _message_list(messages, "add_env_messages")
        if not new:
            raise ValueError(
                "add_env_messages got no messages; an environment returns [] only when the episode "
                "ended, and then the conversation is finished with to_episode()."
            )
        if self.max_observation_tokens is not None:
            new = [self._cut_observation(m) for m in new]
        before = self._render(self._messages, generation_prompt=False)
        after = self._render(self._messages + new, generation_prompt=True)
        if after.startswith(before):
            _, after_controls = self._render_marked(self._messages + new, generation_prompt=True, text=after)
            delta = self._tokenize(*self._delta(before, after, after_controls))
        else:  # the template renders earlier turns differently once more follow (Qwen3 and reasoning)
            delta = self._tokenize(*self._delta_after_reply(self._messages + new, after))
            self._verbatim = False
        if self.max_tokens is not None and len(self._ids) + len(delta) >= self.max_tokens:
            self._truncated = True
            return False
        self._append(delta, mask=False)
        self._messages.extend(new)
        self._pending_close = ""
        return True

    def to_episode(
        self,
        *,
        reward: float,
        terminated: bool = True,
        truncated: bool = False,
        info: Mapping[str, Any] | None = None,
        prompt_id: str | None = None,
        close_last_turn: bool = True,
    ) -> Episode:
        """The finished :class:`~flashrl.episode.Episode`.

        ``truncated`` is forced True when the context budget was reached. With ``close_last_turn``
        the end-of-turn text the model did not sample is appended (``loss_mask`` False) when it fits.
        ``prompt_id`` defaults to the one given at construction.
        """
        prompt_id = prompt_id if prompt_id is not None else self.prompt_id
        if prompt_id is None:
            raise ValueError("to_episode needs a prompt_id (give it here or to TokenizedConversation).")
        ids, mask, lps = list(self._ids), list(self._mask), list(self._logprobs)
        if close_last_turn and self._pending_close:
            tail = self._tokenize(self._pending_close, self._controls.spans(self._pending_close))
            if self.max_tokens is None or len(ids) + len(tail) <= self.max_tokens:
                ids += tail
                mask += [False] * len(tail)
                lps += [0.0] * len(tail)
        details = dict(info or {})
        details.update(
            num_model_turns=len(self._versions),
            finish_reasons=list(self._finish_reasons),
            context_budget_exceeded=self._truncated,
            template_verbatim=self._verbatim,
            observations_cut=self._observations_cut,
        )
        routed = None
        if self._routing:
            recorded = np.concatenate(self._routing)  # [routed_positions, layers, k]
            routed = np.full((len(ids), *recorded.shape[1:]), -1, dtype=np.int16)  # -1: not recorded
            routed[: len(recorded)] = recorded
        return Episode(
            prompt_id=str(prompt_id),
            token_ids=ids,
            loss_mask=mask,
            behavior_logprobs=lps,
            reward=float(reward),
            policy_versions=list(self._versions),
            terminated=bool(terminated) and not self._truncated,
            truncated=bool(truncated) or self._truncated,
            info=details,
            routed_experts=routed,
        )

    # ----------------------------------------------------------------------------- internals
    def _install_tools(self) -> None:
        """Give the tools to the template, or (a template that ignores them) to the system message."""
        if "tools" in self.chat_template_kwargs:
            raise ValueError("Give the tools once: as tools=..., not also in chat_template_kwargs.")
        if template_renders_tools(self.tokenizer, self.tools, **self.chat_template_kwargs):
            self.chat_template_kwargs["tools"] = self.tools
            self.tools_rendered_by = "template"
            return
        prompt = hermes_tools_prompt(self.tools)
        if self._messages[0]["role"] == "system":
            self._messages[0]["content"] = self._messages[0]["content"] + "\n\n" + prompt
        else:
            self._messages.insert(0, {"role": "system", "content": prompt})
        self.tools_rendered_by = "system_prompt"

    def _cut_observation(self, message: dict[str, str]) -> dict[str, str]:
        """``message`` with its content cut to ``max_observation_tokens`` tokens and a marker."""
        limit = self.max_observation_tokens
        assert limit is not None
        ids = self._plain_ids(message["content"])
        if len(ids) <= limit:
            return message
        keep = ids[:limit]
        text = self._decode(keep)
        while keep and text.endswith("\ufffd"):  # a character split across tokens: whole or not at all
            keep = keep[:-1]
            text = self._decode(keep)
        self._observations_cut += 1
        return {"role": message["role"], "content": f"{text}\n[... {len(ids) - len(keep)} more tokens cut]"}

    def _append(self, ids: list[int], *, mask: bool) -> None:
        self._ids.extend(ids)
        self._mask.extend([mask] * len(ids))
        self._logprobs.extend([0.0] * len(ids))

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        return render_chat(
            self.tokenizer, messages, generation_prompt=generation_prompt, **self.chat_template_kwargs
        )

    def _render_marked(
        self, messages: list[dict[str, str]], *, generation_prompt: bool, text: str | None = None
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text (``text`` if already rendered) and the spans of the control tokens the
        template (not a content) put there."""
        if text is None:
            text = self._render(messages, generation_prompt=generation_prompt)
        exposed = self._controls.exposed
        if not any(exposed(m["content"]) or exposed(m["role"]) for m in messages) and not any(
            exposed(piece) for piece in _strings(self.chat_template_kwargs)
        ):
            return text, self._controls.spans(text)  # every control token's text is the template's
        # Render a skeleton (see the module doc); its control tokens are the template's.
        holders, skeleton = self._skeleton(messages, generation_prompt=generation_prompt)
        filled = self._fill(skeleton, holders, messages, lambda rebuilt: rebuilt == text)
        if filled is not None:
            return filled
        raise ChatTemplateError(
            "A message's content, a role, a tool schema or a chat template argument holds the text of a "
            "control token (one of the tokenizer's special tokens) and the chat template does not render it "
            "as given, so the template's own control tokens cannot be told apart from that text. Use a "
            "template that renders contents as given (or only trims them) and other strings unchanged "
            f"(or as JSON), or remove the control token's text; rendered: {text[:300]!r}."
        )

    def _skeleton(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> tuple[list[str], str]:
        """Placeholders for the contents, and the conversation rendered with them and with every other
        string marked (:meth:`_ControlTokens.mark`): the template's text."""
        # Private-use characters: no tokenizer has them in a special token, no content sensibly holds them.
        holders = [f"\ue000flashrl-content-{i}\ue001" for i in range(len(messages))]
        mark = self._controls.mark
        skeleton = render_chat(
            self.tokenizer,
            [{"role": mark(m["role"]), "content": h} for m, h in zip(messages, holders)],
            generation_prompt=generation_prompt,
            **_mapped(self.chat_template_kwargs, mark),
        )
        return holders, skeleton

    def _fill(
        self, skeleton: str, holders: list[str], messages: list[dict[str, str]], accept: Any
    ) -> tuple[str, list[tuple[int, int]]] | None:
        """``skeleton`` with the contents put back (verbatim, else trimmed) and the marked characters
        restored, if ``accept`` takes it, and the spans of the template's control tokens in it; None if
        neither is accepted. Marking swaps characters one for one, so a span in a marked piece is the
        same span in the restored one."""
        pieces = re.split("(" + "|".join(map(re.escape, holders)) + ")", skeleton)
        for rendered_content in (lambda c: c, str.strip):  # verbatim, or a template that trims
            rebuilt, spans = "", []
            for piece in pieces:
                if piece in holders:
                    rebuilt += rendered_content(messages[holders.index(piece)]["content"])
                else:
                    spans += [(len(rebuilt) + a, len(rebuilt) + b) for a, b in self._controls.spans(piece)]
                    rebuilt += self._controls.unmark(piece)
            if accept(rebuilt):
                return rebuilt, spans
        return None

    def _delta_after_reply(
        self, messages: list[dict[str, str]], after: str
    ) -> tuple[str, list[tuple[int, int]]]:
        """What the template renders after the last model reply's content, less the stop token it sampled.

        For a template that renders an earlier turn differently once later messages follow (Qwen3 drops
        a reply's empty or past reasoning block), the whole conversation is not a prefix of its
        extension; the model's tokens stay as sampled, and the new turn is the template's text from
        the end of the reply's content on: its closing, the new messages and the generation prompt.
        """
        holders, skeleton = self._skeleton(messages, generation_prompt=True)
        reply = holders[len(self._messages) - 1]
        if skeleton.count(reply) != 1:
            raise ChatTemplateError(
                "The chat template does not render the conversation as a prefix of the conversation with "
                "the new messages, and does not render the last reply's content once either, so the new "
                f"turn cannot be appended token-exactly. Rendered after: {after[-400:]!r}."
            )
        tail_skeleton = skeleton[skeleton.index(reply) + len(reply) :]
        filled = self._fill(tail_skeleton, holders, messages, after.endswith)
        if filled is None:
            raise ChatTemplateError(
                "The chat template does not render the conversation as a prefix of the conversation with "
                "the new messages (it rewrites earlier turns), and the text after the last reply could not "
                f"be told apart from the contents, so the new turn cannot be appended token-exactly. "
                f"Rendered after: {after[-400:]!r}."
            )
        tail, spans = filled
        cut = len(self._sampled_stop) if self._sampled_stop and tail.startswith(self._sampled_stop) else 0
        return tail[cut:], [(a - cut, b - cut) for a, b in spans if a >= cut]

    def _delta(
        self, before: str, after: str, after_controls: list[tuple[int, int]]
    ) -> tuple[str, list[tuple[int, int]]]:
        """The text appended after ``before`` (closing of the last model turn first), with its control spans."""
        close = self._pending_close
        spans = self._controls.spans(close)  # the template's closing text: its control tokens are real
        for start, end in after_controls:
            if start < len(before) < end:
                raise ChatTemplateError(
                    f"The chat template renders a control token across the end of the previous turn "
                    f"({after[start:end]!r} at {start}), so the new turn cannot be appended token-exactly."
                )
            if start >= len(before):
                spans.append((start - len(before) + len(close), end - len(before) + len(close)))
        return close + after[len(before) :], spans

    def _tokenize(self, text: str, controls: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Token ids of ``text``: ``controls`` (spans) become their control tokens, all else plain text."""
        ids: list[int] = []
        pos = 0
        for start, end in controls:
            ids += self._plain_ids(text[pos:start])
            ids.append(self._controls.ids[text[start:end]])
            pos = end
        return ids + self._plain_ids(text[pos:])

    def _plain_ids(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _closing_text(self, before: str, content: str) -> str:
        """The text the template puts after an assistant message's content (its end of turn)."""
        full = self._render(self._messages, generation_prompt=False)
        if not full.startswith(before):
            raise ChatTemplateError(
                "The chat template's generation prompt is not a prefix of the rendered assistant "
                f"message, so sampled tokens cannot be appended verbatim. Prompt end: {before[-120:]!r}; "
                f"with the reply: {full[len(before) - 120 : len(before) + 120]!r}."
            )
        body = full[len(before) :]
        if body.startswith(content):
            return body[len(content) :]
        stripped = content.strip()
        if stripped and stripped in body:
            # The template trims the content: the tokens stay as sampled, but the decoded sequence
            # will differ from the rendered conversation by that whitespace.
            self._verbatim = False
            return body[body.index(stripped) + len(stripped) :]
        raise ChatTemplateError(
            "The chat template rewrites the assistant's content (rendered "
            f"{body[:200]!r} for content {content[:200]!r}); token-exact episodes need a template "
            "that renders assistant content verbatim (or only trims whitespace)."
        )


_MARKERS = 0xF0000
"""First code point of the characters that stand in for a control token's characters in a skeleton
(Unicode's Supplementary Private Use Area-A: no tokenizer has them in a special token)."""


@dataclass(frozen=True)
class _ControlTokens:
    """The tokenizer's special tokens: their ids, and where their text occurs in a string."""

    ids: dict[str, int]
    pattern: re.Pattern[str] | None
    starts: frozenset[str] = frozenset()
    """Every proper prefix of a control token's text."""
    ends: frozenset[str] = frozenset()
    """Every proper suffix of a control token's text."""
    marks: dict[int, str] = field(default_factory=dict)
    """``str.translate`` table: each character of a control token's text -> its private-use stand-in."""
    unmarks: dict[int, str] = field(default_factory=dict)
    """The inverse table."""

    def spans(self, text: str) -> list[tuple[int, int]]:
        return [] if self.pattern is None else [m.span() for m in self.pattern.finditer(text)]

    def exposed(self, text: str) -> bool:
        """Whether ``text`` holds a control token's text, or could make one with the text around it (it
        ends with the start of one, or starts with the end of one)."""
        if self.pattern is None or not text:
            return False
        if self.pattern.search(text):
            return True
        longest = max(map(len, self.ids)) - 1
        return any(text[-k:] in self.starts or text[:k] in self.ends for k in range(1, min(longest, len(text)) + 1))

    def mark(self, text: str) -> str:
        """``text`` as it is, or, if :meth:`exposed`, with every character of a control token's text
        swapped for its stand-in (one for one), so no control token can be read in it or across its ends."""
        return text.translate(self.marks) if self.exposed(text) else text

    def unmark(self, text: str) -> str:
        """The inverse of :meth:`mark` (stand-ins back to the characters they stand for)."""
        return text.translate(self.unmarks)


def _control_tokens(tokenizer: Any) -> _ControlTokens:
    """Every special token (``all_special_tokens`` and added tokens marked special) of ``tokenizer``."""
    names = set(getattr(tokenizer, "all_special_tokens", []))
    names |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    ids = {name: int(tokenizer.convert_tokens_to_ids(name)) for name in names if name}
    # Longest first, so that a token whose text contains another's is matched whole.
    ordered = sorted(ids, key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None
    chars = sorted(set("".join(ids)))
    return _ControlTokens(
        ids=ids,
        pattern=pattern,
        starts=frozenset(name[:k] for name in ids for k in range(1, len(name))),
        ends=frozenset(name[k:] for name in ids for k in range(1, len(name))),
        marks={ord(c): chr(_MARKERS + i) for i, c in enumerate(chars)},
        unmarks={_MARKERS + i: c for i, c in enumerate(chars)},
    )


def _strings(value: Any) -> Iterator[str]:
    """Every string in ``value`` (a template argument: a str, or dicts, lists and tuples of them; dict keys too)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _mapped(value: Any, fn: Any) -> Any:
    """``value`` with ``fn`` applied to every string in it (see :func:`_strings`); other values as they are."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {_mapped(key, fn): _mapped(item, fn) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_mapped(item, fn) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def render_chat(
    tokenizer: Any, messages: list[dict[str, str]], *, generation_prompt: bool, **kwargs: Any
) -> str:
    """``apply_chat_template`` as text (transformers 5 returns a dict when tokenising)."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
    )


def chat_stop_token_ids(
    tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None
) -> frozenset[int]:
    """The EOS token id plus the template's end-of-turn token (the first token after a reply)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    kwargs = dict(chat_template_kwargs or {})
    probe = "flashrl-probe-reply"
    prompt = [{"role": "user", "content": "hi"}]
    before = render_chat(tokenizer, prompt, generation_prompt=True, **kwargs)
    full = render_chat(
        tokenizer, prompt + [{"role": "assistant", "content": probe}], generation_prompt=False, **kwargs
    )
    if full.startswith(before) and probe in full:
        closing = full[full.index(probe) + len(probe) :]
        closing_ids = tokenizer(closing, add_special_tokens=False)["input_ids"] if closing else []
        if closing_ids and closing_ids[0] in set(tokenizer.all_special_ids):
            ids.add(int(closing_ids[0]))
    return frozenset(ids)
