"""The contract every flashrl language environment follows: chat messages in, text actions out.

A :class:`LanguageEnv` is a :class:`gymnasium.Env` whose observations are chat messages and whose
actions are the model's reply text:

* ``reset(*, seed=None, options=None) -> (messages, info)``: picks a task (with ``self.np_random``, so
  a seed makes it reproducible) and returns the initial conversation (system/user messages) and an
  ``info`` dict that always holds ``info["prompt_id"]``, a stable key of the task.
* **Tools.** A tool-using env may put ``info["tools"]`` in the reset info: a list of OpenAI-style
  function schemas (:func:`flashrl.tool_calls.function_schema`). The env runners give it to the chat
  template (``apply_chat_template(tools=...)``; see :class:`flashrl.conversation.TokenizedConversation`),
  the model calls the tools in its template's format (Hermes/Qwen ``<tool_call>`` blocks, parsed by
  :func:`flashrl.tool_calls.parse_tool_calls`), and ``step`` answers with messages of role ``"tool"``.
* ``step(action_text) -> (new_messages, reward, terminated, truncated, info)``: ``new_messages`` are
  only the messages to append to the conversation (the environment's reply turn); it is ``[]`` when
  the episode has ended. Verification details go to ``info``.
* **The success signal.** Every ``step`` info should carry ``info["success"]``, a ``bool``: whether
  the task is solved as of this step (False before the end of a multi-turn task). The info of an
  episode's last step becomes :attr:`flashrl.episode.Episode.success`. It is the explicit failure
  label of the failure-token entropy filter (``negative_token_fraction < 1``), which, as the method's
  reference release does, never infers failure from the reward or the advantage's sign: a reward can
  be positive without a success (a format bonus) and an advantage is negative for half the successes
  of an easy batch. flashrl's choice for an env that reports no ``success``: no label is guessed (not
  from ``reward > 0`` either); such episodes carry ``success=None`` and a learner with the filter on
  refuses their batch with an error naming this key. Everything else works without it. The flashrl
  envs report it: Math (``correct``), PythonTool (``correct`` at the end, False before) and ALFWorld
  (``won``).

Subclasses implement :meth:`LanguageEnv._reset_task` and :meth:`LanguageEnv._step_action`; the base
class owns the bookkeeping every environment needs and gets wrong in the same ways: seeding through
``super().reset``, keeping the conversation for :meth:`render`, raising when ``step`` is called after
the end, copying returned data so callers may mutate it, the optional turn limit, and checking that
what a subclass returns lies in the declared spaces (with an error that says what is wrong).
"""

from __future__ import annotations

import contextlib
import copy
import numbers
from typing import Any, ClassVar, TypedDict

import gymnasium as gym

from flashrl.envs.spaces import DEFAULT_ROLES, ChatMessages, UnicodeText


class ChatMessage(TypedDict):
    """One chat message, as chat templates expect it."""

    role: str
    content: str


Messages = list[dict[str, str]]
StepResult = tuple[Messages, float, bool, bool, dict[str, Any]]


class EpisodeEndedError(RuntimeError):
    """``step`` was called before ``reset`` or after the episode terminated or was truncated."""


class LanguageEnv(gym.Env[Messages, str]):
    """Base class of text environments whose observations are chat messages.

    Spaces:
        * ``observation_space``: :class:`~flashrl.envs.spaces.ChatMessages`, lists of
          ``{"role": str, "content": str}`` dicts (any Unicode content).
        * ``action_space``: :class:`~flashrl.envs.spaces.UnicodeText`, the reply text of the model
          (at most ``max_action_chars`` characters).

    Episode end:
        A subclass sets ``terminated``/``truncated``. With ``max_turns`` set, the base class also
        truncates an episode whose ``max_turns``-th step did not terminate it
        (``info["turn_limit_reached"] = True``). Calling ``step`` after the end (or before the first
        ``reset``) raises :class:`EpisodeEndedError`.

    Rendering:
        ``render_mode="ansi"`` makes :meth:`render` return the conversation so far as text.

    Args:
        max_turns: Steps after which a non-terminated episode is truncated; ``None`` for no limit.
        max_action_chars: Longest accepted action text, in characters.
        roles: Roles the environment's messages may carry.
        render_mode: ``None`` or ``"ansi"``.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 1}
    code_arguments: ClassVar[tuple[str, ...]] = ()
    """Constructor arguments that take user code (a function or its ``"module:name"`` path, e.g. Math's
    ``reward_fn``): the driver imports a path and ships the code to the env runners by value, so its
    module need not import there; ``validate()`` checks it the way the runners receive it."""
    command_arguments: ClassVar[tuple[str, ...]] = ()
    """Constructor arguments that name a program the env runs (e.g. Agent-v0's ``command``): like
    ``code_arguments``, a checkpoint's stored config never brings them back unless passed again or
    trusted (``flashrl.checkpoints.stored_code``)."""

    def __init__(
        self,
        *,
        max_turns: int | None = None,
        max_action_chars: int = 1_000_000,
        roles: tuple[str, ...] = DEFAULT_ROLES,
        render_mode: str | None = None,
    ) -> None:
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"max_turns must be None or >= 1; got {max_turns}.")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(
                f"render_mode must be None or one of {self.metadata['render_modes']}; got {render_mode!r}."
            )
        self.max_turns = max_turns
        self.render_mode = render_mode
        self.observation_space = ChatMessages(roles=roles)
        self.action_space = UnicodeText(max_action_chars)
        self._conversation: Messages = []
        self._turn = 0
        self._done = True
        self._started = False

    # ----------------------------------------------------------------------------- subclass API
    def _reset_task(self, options: dict[str, Any]) -> tuple[Messages, dict[str, Any]]:
        """Pick a task with ``self.np_random`` and return ``(initial_messages, info)``.

        ``info`` must hold ``"prompt_id"`` (a ``str``). ``options`` is ``{}`` when the caller passed none.
        """
        raise NotImplementedError

    def _step_action(self, action: str) -> StepResult:
        """Apply one model reply; return ``(new_messages, reward, terminated, truncated, info)``."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------- Gymnasium API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Messages, dict[str, Any]]:
        super().reset(seed=seed)
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"reset(options=...) expects a dict or None; got {type(options).__name__}.")
        messages, info = self._reset_task(dict(options or {}))
        self._check_messages(messages, "reset")
        if not messages:
            raise ValueError(f"{type(self).__name__}.reset returned no messages; expected at least one.")
        if not isinstance(info, dict) or not isinstance(info.get("prompt_id"), str):
            raise TypeError(
                f"{type(self).__name__}.reset must return info with a str 'prompt_id'; got "
                f"{info.get('prompt_id') if isinstance(info, dict) else info!r}."
            )
        self._conversation = copy.deepcopy(messages)
        self._turn = 0
        self._done = False
        self._started = True
        return copy.deepcopy(messages), copy.deepcopy(info)

    def step(self, action: str) -> StepResult:
        if not self._started:
            raise EpisodeEndedError(
                f"{type(self).__name__}.step() called before reset(); call reset() first."
            )
        if self._done:
            raise EpisodeEndedError(
                f"{type(self).__name__}.step() called after the episode ended (terminated or truncated "
                f"after {self._turn} turns); call reset() to start a new episode."
            )
        if not isinstance(action, str):
            raise TypeError(
                f"{type(self).__name__}.step expects the model's reply text (str); got "
                f"{type(action).__name__}. Decode the sampled tokens first."
            )
        if not self.action_space.contains(action):
            raise ValueError(
                f"{type(self).__name__}.step: action has {len(action)} characters, at most "
                f"{self.action_space.max_length} allowed (max_action_chars)."
            )
        self._conversation.append({"role": "assistant", "content": action})
        new_messages, reward, terminated, truncated, info = self._step_action(action)
        self._turn += 1
        self._check_messages(new_messages, "step")
        terminated, truncated = bool(terminated), bool(truncated)
        if "success" in info and not isinstance(info["success"], bool):
            raise TypeError(
                f"{type(self).__name__}.step returned info['success'] = {info['success']!r} "
                f"({type(info['success']).__name__}); expected a bool (whether the task is solved). Use bool(...)."
            )
        if self.max_turns is not None and self._turn >= self.max_turns and not terminated:
            if not truncated:
                new_messages = []
            truncated = True
            info["turn_limit_reached"] = True
        info["turn"] = self._turn
        self._done = terminated or truncated
        self._conversation.extend(copy.deepcopy(new_messages))
        if isinstance(reward, numbers.Real) and not isinstance(reward, bool):
            with contextlib.suppress(OverflowError):  # an int past float's range is left to the runner
                reward = float(reward)
        # Anything else goes on as it is: the env runner refuses it (bad_reward) rather than float()
        # reading the text "0.5" as 0.5 here.
        return copy.deepcopy(new_messages), reward, terminated, truncated, copy.deepcopy(info)

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        return "\n".join(f"[{m['role']}] {m['content']}" for m in self._conversation)

    # ----------------------------------------------------------------------------- helpers
    @property
    def conversation(self) -> Messages:
        """A copy of the conversation so far: the reset messages, each action and each reply."""
        return copy.deepcopy(self._conversation)

    @property
    def turn(self) -> int:
        """Number of ``step`` calls since the last ``reset``."""
        return self._turn

    @property
    def done(self) -> bool:
        """Whether the current episode has ended (or was never started)."""
        return self._done

    def _check_messages(self, messages: Any, method: str) -> None:
        problem = self.observation_space.explain(messages)
        if problem:
            raise TypeError(
                f"{type(self).__name__}.{method} returned messages outside its observation space: {problem}."
            )
