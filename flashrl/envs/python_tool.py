r"""``flashrl/PythonTool-v0``: multi-turn math with a Python interpreter the model can call.

The model runs code either in fenced ```python blocks (``tool_format="fenced"``, the default: any chat
model can) or through its chat template's native tool calls (``tool_format="hermes"``: the ``python``
tool's schema goes to ``apply_chat_template(tools=...)``, the model answers
``<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>`` as Qwen2.5/Qwen3/Hermes
models are trained to, and each result comes back as a ``tool`` message). The environment runs the
code in the sandbox (:mod:`flashrl.envs.sandbox`) and answers with what it printed. The episode ends
when the model gives a final answer in ``\boxed{}`` or at the turn limit; the reward comes from the
math verifier.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from flashrl.envs.base import Messages, StepResult
from flashrl.envs.math.env import MathEnv, Order
from flashrl.envs.math.tasks import AnswerFormat, MathTask, TaskSource
from flashrl.envs.math.templates import PromptTemplate
from flashrl.envs.math.verifier import extract_boxed
from flashrl.envs.sandbox import Sandbox, SandboxConfig, SandboxResult
from flashrl.envs.tool_env import Tool, answer_tool_calls
from flashrl.tool_calls import parse_tool_calls

TOOL_SYSTEM_PROMPT = (
    "You can run Python code. To run code, write it in a fenced block that starts with ```python and "
    "ends with ```; you will get back what it printed (use print). Each block runs in a fresh "
    "interpreter without network access, so print everything you need. When you know the answer, "
    "reply with the final answer in \\boxed{}."
)
TOOL_TEMPLATE = PromptTemplate(
    "{question}\nYou may run Python code to compute it. Put your final answer in \\boxed{{}}.",
    TOOL_SYSTEM_PROMPT,
)
#: The system prompt of ``tool_format="hermes"``: the chat template describes the tool and its call format.
TOOL_CALL_SYSTEM_PROMPT = (
    "You can call a python tool that runs code in a fresh interpreter without network access and "
    "returns what it printed (use print). When you know the answer, reply with the final answer in "
    "\\boxed{} and no tool call."
)
TOOL_CALL_TEMPLATE = PromptTemplate(TOOL_TEMPLATE.user, TOOL_CALL_SYSTEM_PROMPT)
ToolFormat = Literal["fenced", "hermes"]
TOOL_FORMATS: tuple[str, ...] = ("fenced", "hermes")
PYTHON_TOOL_DESCRIPTION = (
    "Run a Python program in a fresh sandboxed interpreter (no network, no state kept between calls) "
    "and return its exit status, stdout and stderr."
)
PYTHON_TOOL_PARAMETERS = {"code": {"type": "string", "description": "The program; print what you need to see."}}

DEFAULT_SANDBOX = SandboxConfig(wall_time_s=5.0, cpu_time_s=5, memory_bytes=1 << 30, max_output_bytes=4096)

# An opening fence (```python / ```py / ```python3, optional trailing text) at the start of a line,
# then everything up to a closing fence at the start of a line, or to the end of the reply (a reply
# cut by the token limit still runs).
_CODE_BLOCK_RE = re.compile(r"^[ \t]*```[ \t]*(?:python3?|py)\b[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.DOTALL | re.MULTILINE)


@dataclass(frozen=True)
class ParsedReply:
    """What a model reply asks for."""

    code_blocks: tuple[str, ...]
    """The contents of its ```python blocks, in order."""
    final_answer: str | None
    r"""Content of the last ``\boxed{}`` outside code blocks, if any."""


def parse_reply(text: str) -> ParsedReply:
    r"""Split a reply into its ```python blocks and its ``\boxed{}`` final answer (outside code)."""
    blocks = tuple(m.group(1) for m in _CODE_BLOCK_RE.finditer(text))
    prose = _CODE_BLOCK_RE.sub("", text)
    return ParsedReply(code_blocks=blocks, final_answer=extract_boxed(prose))


def format_observation(result: SandboxResult, *, max_chars: int, wall_time_s: float) -> str:
    """The tool's answer to the model: exit status (or timeout), then stdout and stderr.

    Together they show at most ``max_chars`` characters: stdout keeps its beginning, stderr its end
    (the exception), each cut with a marker saying how much was left out.
    """
    if result.timed_out:
        status = f"Timed out after {wall_time_s:g} s; the program was stopped."
    elif result.killed_by == "output_limit":
        status = "Output limit exceeded; the program was stopped."
    elif result.killed_by == "workdir_limit":
        status = "Disk limit of the work dir exceeded; the program was stopped."
    elif result.exit_code is not None and result.exit_code < 0:
        status = f"Killed by signal {-result.exit_code} (a CPU or memory limit)."
    else:
        status = f"Exit status: {result.exit_code}"
    parts = [status]
    budget = max_chars
    for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if not text:
            continue
        shown = _truncate(text, budget, keep_end=name == "stderr")
        budget = max(budget - len(shown), 0)
        parts.append(f"{name}:\n```\n{shown.rstrip(chr(10))}\n```")
    if not result.stdout and not result.stderr:
        parts.append("(no output; use print() to see values)")
    return "\n".join(parts)


def _truncate(text: str, max_chars: int, *, keep_end: bool) -> str:
    """At most ``max_chars`` of ``text`` plus a marker; stderr keeps its end (where errors are)."""
    if len(text) <= max_chars:
        return text
    if keep_end:
        return f"[... {len(text) - max_chars} earlier characters truncated]\n" + text[len(text) - max_chars:]
    return text[:max_chars] + f"\n[... {len(text) - max_chars} more characters truncated]"


class PythonToolEnv(MathEnv):
    r"""Multi-turn math where the model may run Python code before answering.

    ## Description
    Tasks are those of :class:`~flashrl.envs.math.MathEnv` (same ``tasks``/``preset``/``difficulty``
    arguments and reset options; default preset ``"arithmetic"``: multi-step integer expressions,
    where computing beats guessing). Each turn the model replies; the environment then

    * ends the episode if the reply has a final answer in ``\boxed{}`` outside code blocks;
    * otherwise runs the reply's ```python blocks (joined in order, as one program, in a fresh
      sandboxed interpreter: no state carries over between turns) and answers with the exit status,
      stdout and stderr (each truncated with a marker), or that the run timed out;
    * otherwise (no code, no answer) reminds the model of the protocol.

    With ``tool_format="hermes"`` the code comes in the reply's ``<tool_call>`` blocks instead (the
    ``python`` tool, schema in ``reset`` info ``"tools"``; the env runners pass it to the chat template,
    or to the system message for a template without tool support). Each call runs as its own program
    and gets its own ``tool`` message (the same text as above); a call that does not parse, names
    another tool or lacks ``code`` is answered with an error saying so; at most
    ``max_calls_per_turn`` calls of one reply run. The final answer is a ``\\boxed{}`` outside the calls.

    The sandbox (:class:`~flashrl.envs.sandbox.Sandbox`) is real: bubblewrap where available, else
    Landlock + seccomp; it refuses to start without isolation unless
    ``SandboxConfig(allow_unconfined=True)`` is passed.

    ## Observation space
    :class:`~flashrl.envs.spaces.ChatMessages`. ``reset``: system message (the tool protocol) and the
    question. ``step``: one message with role ``observation_role`` (default ``"user"``), or ``[]``
    when the episode ended; with ``tool_format="hermes"``, one ``tool`` message per call (a reply
    without calls or answer gets the reminder as ``observation_role``).

    ## Action space
    :class:`~flashrl.envs.spaces.UnicodeText`: the model's reply.

    ## Reward
    At the end, :func:`~flashrl.envs.math.verifier.verify_answer` on the final reply: ``1.0`` if its
    answer (last ``\boxed{}``, else last number) equals the reference, else ``0.0``; plus
    ``format_reward`` for a boxed answer. Intermediate steps give ``0.0``.

    ## Threads
    Thread-safe across instances: every code block runs in a fresh sandboxed process and the answer in
    the math verifier's shared worker pool, so many envs may step from many threads at once (checked by
    ``benchmarks/env_concurrency.py``: 16 threads, every run printed its output); one instance serves
    one thread at a time.

    ## Episode end
    Terminated when a reply carries a ``\boxed{}`` answer. Truncated after ``max_turns`` replies
    (``info["turn_limit_reached"]``); the last reply is then verified as it is and its code is not run.

    ## Info
    As :class:`MathEnv` at the end (``correct``, ``success``, ``extracted``, ``reason``, ...); every
    step also has ``success`` (False before the final answer), ``tool_calls`` (runs so far),
    ``sandbox_backend`` and, after a run, ``exit_code``, ``timed_out``, ``output_truncated``.

    ## Arguments
    ``max_turns`` (default 4), ``sandbox`` (a :class:`SandboxConfig` or a ready
    :class:`Sandbox`), ``max_observation_chars`` (stdout + stderr shown per run),
    ``observation_role``, ``tool_format`` (``"fenced"`` or ``"hermes"``), ``max_calls_per_turn``
    (hermes; default 4), ``observation_suffix`` (default ``""``: text appended, after a blank line, to
    every tool observation, e.g. ``"Now give the final answer in \boxed{}."``: a standing instruction
    that small models need to turn a printed result into an answer; with ``"hermes"`` it goes after
    the last ``tool`` message of the turn), and every :class:`MathEnv` argument.

    ## Version history
    * v0: initial version; ``tool_format="hermes"`` added (the default, fenced, is unchanged);
      ``observation_suffix`` added (the default, empty, is unchanged).
    """

    def __init__(
        self,
        tasks: str | os.PathLike[str] | TaskSource | Sequence[MathTask] | Any | None = None,
        *,
        preset: str | None = None,
        difficulty: int | None = None,
        max_turns: int = 4,
        sandbox: SandboxConfig | Sandbox | None = None,
        max_observation_chars: int = 2000,
        observation_role: str = "user",
        tool_format: ToolFormat = "fenced",
        max_calls_per_turn: int = 4,
        observation_suffix: str = "",
        question_field: str = "question",
        answer_field: str = "answer",
        id_field: str | None = None,
        answer_format: AnswerFormat = "plain",
        template: PromptTemplate | str | None = None,
        system_prompt: str | None = None,
        format_reward: float = 0.0,
        verify_timeout_s: float = 5.0,
        order: Order = "shuffle",
        render_mode: str | None = None,
        prompt_probs: Sequence[float] | None = None,
        blend_seed: int = 42,
        max_samples_per_source: int | None = None,
    ) -> None:
        if tasks is None and preset is None and difficulty is None:
            preset = "arithmetic"
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format must be one of {TOOL_FORMATS}; got {tool_format!r}.")
        if not isinstance(observation_suffix, str):
            raise TypeError(f"observation_suffix must be a string; got {type(observation_suffix).__name__}.")
        if not isinstance(max_calls_per_turn, int) or max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn must be an int >= 1; got {max_calls_per_turn!r}.")
        default_template = TOOL_CALL_TEMPLATE if tool_format == "hermes" else TOOL_TEMPLATE
        super().__init__(
            tasks, preset=preset, difficulty=difficulty, question_field=question_field,
            answer_field=answer_field, id_field=id_field, answer_format=answer_format,
            template=template or default_template, system_prompt=system_prompt, format_reward=format_reward,
            verify_timeout_s=verify_timeout_s, order=order, render_mode=render_mode,
            prompt_probs=prompt_probs, blend_seed=blend_seed, max_samples_per_source=max_samples_per_source,
        )
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1; got {max_turns!r}.")
        if max_observation_chars < 1:
            raise ValueError(f"max_observation_chars must be >= 1; got {max_observation_chars}.")
        if observation_role not in self.observation_space.roles:
            raise ValueError(
                f"observation_role must be one of {self.observation_space.roles}; got {observation_role!r}."
            )
        self.max_turns = max_turns
        self.max_observation_chars = max_observation_chars
        self.observation_role = observation_role
        self.sandbox = sandbox if isinstance(sandbox, Sandbox) else Sandbox(sandbox or DEFAULT_SANDBOX)
        self.tool_format = tool_format
        self.max_calls_per_turn = max_calls_per_turn
        self.observation_suffix = observation_suffix
        self.tool = Tool("python", PYTHON_TOOL_DESCRIPTION, self._run_code, PYTHON_TOOL_PARAMETERS, ("code",))
        """The ``python`` tool of ``tool_format="hermes"`` (its schema goes to the chat template)."""
        self._tool_calls = 0
        self._last_run: dict[str, Any] = {}

    def _reset_task(self, options: dict[str, Any]) -> tuple[Messages, dict[str, Any]]:
        self._tool_calls = 0
        messages, info = super()._reset_task(options)
        info["sandbox_backend"] = self.sandbox.backend
        if self.tool_format == "hermes":
            info["tools"] = [self.tool.schema()]
        return messages, info

    def _run_code(self, code: str) -> str:
        """The ``python`` tool: run ``code`` in the sandbox; the observation text."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a string, got {type(code).__name__}")
        result = self.sandbox.run(code)
        self._last_run = {"exit_code": result.exit_code, "timed_out": result.timed_out,
                          "output_truncated": result.output_truncated}
        return format_observation(
            result, max_chars=self.max_observation_chars, wall_time_s=self.sandbox.config.wall_time_s
        )

    def _with_suffix(self, content: str) -> str:
        """A tool observation followed by ``observation_suffix`` (after a blank line), if one is set."""
        return f"{content}\n\n{self.observation_suffix}" if self.observation_suffix else content

    def _step_action(self, action: str) -> StepResult:
        if self.tool_format == "hermes":
            return self._step_tool_calls(action)
        reply = parse_reply(action)
        last_turn = self.turn + 1 >= self.max_turns
        if reply.final_answer is not None or last_turn:
            _, reward, _, _, info = super()._step_action(action)
            info.update(tool_calls=self._tool_calls, sandbox_backend=self.sandbox.backend)
            answered = reply.final_answer is not None
            return [], reward, answered, not answered, info
        info: dict[str, Any] = {"sandbox_backend": self.sandbox.backend}
        if reply.code_blocks:
            content = self._with_suffix(self._run_code("\n".join(reply.code_blocks)))
            self._tool_calls += 1
            info.update(self._last_run)
        else:
            content = (
                "No ```python code block and no final answer found. Write code in a ```python block "
                "to run it, or give the final answer in \\boxed{}."
            )
        info["tool_calls"] = self._tool_calls
        info["success"] = False  # no final answer yet (the env contract's success signal)
        assert self.task is not None
        info["prompt_id"] = self.task.prompt_id
        return [{"role": self.observation_role, "content": content}], 0.0, False, False, info

    def _step_tool_calls(self, action: str) -> StepResult:
        """``tool_format="hermes"``: run the reply's ``python`` calls, or grade its final answer."""
        parsed = parse_tool_calls(action)
        if extract_boxed(parsed.content) is not None or self.turn + 1 >= self.max_turns:
            _, reward, _, _, info = MathEnv._step_action(self, action)
            info.update(tool_calls=self._tool_calls, sandbox_backend=self.sandbox.backend)
            answered = extract_boxed(parsed.content) is not None
            return [], reward, answered, not answered, info
        info: dict[str, Any] = {"sandbox_backend": self.sandbox.backend}
        if parsed.calls:
            self._last_run = {}
            messages, run, refused = answer_tool_calls(
                parsed.calls, {"python": self.tool}, max_calls=self.max_calls_per_turn,
                max_chars=self.max_observation_chars + 200,  # the run's text is cut already; room for its status
            )
            self._tool_calls += run
            info.update(self._last_run, tool_calls_refused=refused)
            last = messages[-1]
            messages[-1] = {**last, "content": self._with_suffix(last["content"])}
        else:
            messages = [{"role": self.observation_role, "content": (
                "No tool call and no final answer found. Call the python tool to run code, or give the "
                "final answer in \\boxed{}."
            )}]
        info["tool_calls"] = self._tool_calls
        info["success"] = False
        assert self.task is not None
        info["prompt_id"] = self.task.prompt_id
        return messages, 0.0, False, False, info
