r"""``flashrl/Tool-v0``: tasks solved with Python functions the model calls in its chat template's format.

The model gets the tools as JSON schemas through the chat template (``reset`` info ``"tools"``, which
the env runners pass to ``apply_chat_template(tools=...)``), calls them the Hermes/Qwen way
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, parsed by
:func:`flashrl.tool_calls.parse_tool_calls`) and reads each result in a message with role ``"tool"``.
:func:`answer_tool_calls` (shared with ``flashrl/PythonTool-v0``) runs the calls of one reply.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flashrl.envs.base import LanguageEnv, Messages, StepResult
from flashrl.tool_calls import ToolCall, function_schema, parse_tool_calls

__all__ = ["Tool", "ToolEnv", "answer_tool_calls"]


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its schema (what the template shows) and its implementation."""

    name: str
    description: str
    fn: Callable[..., Any]
    """Called with the call's arguments as keywords; its result (``str``, or JSON-serialisable) is the
    tool message's content. An exception becomes an error message to the model."""
    parameters: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Argument name -> JSON schema (``{"type": "string", "description": ...}``)."""
    required: tuple[str, ...] = ()

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema (:func:`flashrl.tool_calls.function_schema`)."""
        return function_schema(self.name, self.description, self.parameters, self.required)


def answer_tool_calls(
    calls: Sequence[ToolCall], tools: Mapping[str, Tool], *, max_calls: int, max_chars: int
) -> tuple[Messages, int, int]:
    """Run the calls of one reply; return ``(tool messages, calls run, calls refused)``.

    One ``{"role": "tool"}`` message per call, in order. A call that did not parse, names an unknown
    tool, lacks a required argument, passes an unknown one, raises, or comes after the first
    ``max_calls`` of the reply is not run (or its exception is caught) and answered with an error that
    says what was wrong. Results longer than ``max_chars`` characters are cut with a marker.
    """
    messages: Messages = []
    run = refused = 0
    for index, call in enumerate(calls):
        error = _call_problem(call, tools) if index < max_calls else (
            f"at most {max_calls} tool calls are run per turn; this one was not run"
        )
        if error is None:
            assert call.name is not None
            try:
                result = tools[call.name].fn(**call.arguments)
                content = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
                run += 1
            except Exception as err:  # noqa: BLE001 - the tool's failure is the model's feedback
                error = f"{call.name} raised {type(err).__name__}: {err}"
        if error is not None:
            refused += 1
            content = f"Error: {error}."
        if len(content) > max_chars:
            content = content[:max_chars] + f"\n[... {len(content) - max_chars} more characters cut]"
        messages.append({"role": "tool", "content": content})
    return messages, run, refused


def _call_problem(call: ToolCall, tools: Mapping[str, Tool]) -> str | None:
    if call.error is not None:
        return call.error
    tool = tools.get(call.name or "")
    if tool is None:
        return f"there is no tool {call.name!r}; the tools are {sorted(tools)}"
    missing = [name for name in tool.required if name not in call.arguments]
    if missing:
        return f"{tool.name} needs the arguments {missing}"
    unknown = sorted(set(call.arguments) - set(tool.parameters))
    if unknown:
        return f"{tool.name} has no arguments {unknown}; it takes {sorted(tool.parameters)}"
    return None


def _exact_answer(answer: str, reference: str) -> float:
    return float(answer.strip() == reference.strip())


class ToolEnv(LanguageEnv):
    r"""Generic multi-turn tool use: the model calls ``tools`` until it answers without a call.

    ## Description
    ``tasks`` is a sequence of dicts with ``"question"`` (or ``"messages"``: the whole initial
    conversation), ``"answer"`` (the reference) and optionally ``"id"``; ``reset`` draws one with the
    seeded RNG (``options={"task_index": i}`` plays task ``i``). Each turn, a reply with tool calls gets
    one ``tool`` message per call (:func:`answer_tool_calls`); a reply without any is the final answer.

    ## Observation space
    :class:`~flashrl.envs.spaces.ChatMessages`: ``reset`` gives the system prompt (if any) and the
    question; ``step`` gives the tool messages, or ``[]`` at the end. ``reset`` info has ``"tools"``
    (the schemas for the chat template; a template that ignores them gets them in the system message,
    see :class:`flashrl.conversation.TokenizedConversation`).

    ## Reward
    ``reward_fn(final_reply_content, reference) -> float`` at the end (default: 1.0 when the reply's
    prose, tool calls removed, equals the answer after stripping, else 0.0); ``info["success"]`` is
    ``reward >= success_threshold``. Intermediate steps give 0.0.

    ## Episode end
    Terminated by a reply without tool calls. Truncated after ``max_turns`` replies
    (``info["turn_limit_reached"]``): the last reply is graded as the final answer, its calls not run.

    ## Arguments
    ``tasks``, ``tools`` (:class:`Tool` objects), ``system_prompt``, ``max_turns`` (default 4),
    ``max_calls_per_turn`` (default 4), ``max_observation_chars`` (default 4000), ``reward_fn``,
    ``success_threshold`` (default 1.0), ``render_mode``.

    ## Version history
    * v0: initial version.
    """

    finite = True
    """The task list is finite: evaluation walks it in order (``task_index``)."""

    def __init__(
        self,
        tasks: Sequence[Mapping[str, Any]],
        tools: Sequence[Tool],
        *,
        system_prompt: str | None = None,
        max_turns: int = 4,
        max_calls_per_turn: int = 4,
        max_observation_chars: int = 4000,
        reward_fn: Callable[[str, str], float] | None = None,
        success_threshold: float = 1.0,
        render_mode: str | None = None,
    ) -> None:
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1; got {max_turns!r}.")
        super().__init__(render_mode=render_mode)
        if not tasks:
            raise ValueError("ToolEnv needs at least one task ({'question': ..., 'answer': ...}).")
        for i, task in enumerate(tasks):
            if not isinstance(task.get("answer"), str) or not (
                isinstance(task.get("question"), str) or isinstance(task.get("messages"), list)
            ):
                raise TypeError(
                    f"task {i} must have a str 'answer' and a str 'question' (or a 'messages' list); got "
                    f"{dict(task)!r:.200}."
                )
        if not tools or not all(isinstance(t, Tool) for t in tools):
            raise TypeError("ToolEnv needs a non-empty sequence of Tool objects (flashrl.envs.tool_env.Tool).")
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be distinct; got {names}.")
        if max_calls_per_turn < 1 or max_observation_chars < 1:
            raise ValueError(
                f"max_calls_per_turn and max_observation_chars must be >= 1; got {max_calls_per_turn} and "
                f"{max_observation_chars}."
            )
        self.tasks = [dict(t) for t in tasks]
        self.tools = {t.name: t for t in tools}
        self.system_prompt = system_prompt
        self.max_agent_turns = max_turns
        self.max_calls_per_turn = max_calls_per_turn
        self.max_observation_chars = max_observation_chars
        self.reward_fn = reward_fn or _exact_answer
        self.success_threshold = success_threshold
        self.task: dict[str, Any] | None = None
        self._index = 0
        self._tool_calls = 0

    def _reset_task(self, options: dict[str, Any]) -> tuple[Messages, dict[str, Any]]:
        unknown = set(options) - {"task_index"}
        if unknown:
            raise ValueError(f"Unknown reset options {sorted(unknown)}; ToolEnv accepts 'task_index'.")
        index = int(options["task_index"]) if "task_index" in options else int(self.np_random.integers(len(self.tasks)))
        if not 0 <= index < len(self.tasks):
            raise IndexError(f"task_index {index} is out of range for {len(self.tasks)} tasks.")
        self.task, self._index = self.tasks[index], index
        self._tool_calls = 0
        if "messages" in self.task:
            messages = [dict(m) for m in self.task["messages"]]
        else:
            messages = [{"role": "user", "content": self.task["question"]}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
        info = {
            "prompt_id": str(self.task.get("id", index)),
            "tools": [t.schema() for t in self.tools.values()],
        }
        return messages, info

    def _step_action(self, action: str) -> StepResult:
        assert self.task is not None
        parsed = parse_tool_calls(action)
        info: dict[str, Any] = {"prompt_id": str(self.task.get("id", self._index))}
        if not parsed.calls or self.turn + 1 >= self.max_agent_turns:
            # As returned, not float(): a reward_fn returning text or None is refused by the env runner
            # (bad_reward) rather than read here ("0.5" as 0.5).
            reward = self.reward_fn(parsed.content, self.task["answer"])
            real = isinstance(reward, numbers.Real) and not isinstance(reward, bool)
            info.update(tool_calls=self._tool_calls, success=bool(real and reward >= self.success_threshold))
            answered = not parsed.calls
            if not answered:
                info["turn_limit_reached"] = True
            return [], reward, answered, not answered, info
        messages, run, refused = answer_tool_calls(
            parsed.calls, self.tools, max_calls=self.max_calls_per_turn, max_chars=self.max_observation_chars
        )
        self._tool_calls += run
        info.update(tool_calls=self._tool_calls, tool_calls_refused=refused, success=False)
        return messages, 0.0, False, False, info
