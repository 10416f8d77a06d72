"""What an EnvRunner does with an environment that raises: count it, name it, and stop a deterministic one.

An episode whose ``env.reset`` / ``env.step`` raises is dropped and counted (``env_error``); the env
is closed off the event loop. One error is bad luck (a flaky tool, a network blip); the same error
(type and message) ending `ENV_ERROR_LIMIT` episodes in a row is in the env's code or its data and
will not go away, so the runner stops the run with `EnvErrorStreak`: the user's traceback of the
first of them, the env id and the episode's prompt id. Any episode that gets through the env in
between starts the count again.

An agent episode with no model call (``empty``: nothing to train on) is not a success either: it
neither restarts the env-error count nor is an env error; `ENV_ERROR_LIMIT` of them in a row (with no
episode through in between) are an agent that never calls the model (a bug, a cached answer) and stop
the run with `EmptyEpisodeStreak`, naming the agent and the last prompt id, within seconds instead of
after ``sample_timeout_s``.

Each kind of env error (its type and message) is logged with its traceback once per runner, the user's
frames first (`user_traceback`); a repeat is one counted line.

`EnvBoundary` wraps every env a runner makes: it records the prompt id of the last reset (an episode
carries it as ``info["prompt_id"]``) and refuses text the tokenizer cannot encode (a lone surrogate
such as ``"\\ud800"`` from a dataset row or a tool's output) inside the env's own call, so such text
is an env error, counted like any other, not a crash of the runner.
"""

from __future__ import annotations

import logging
import os
import sysconfig
import traceback
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import gymnasium as gym

logger = logging.getLogger("flashrl.env_runners")

ENV_ERROR_LIMIT = 20
"""The same env error in this many episodes in a row of one runner stops the run (`EnvErrorStreak`).

flashrl's choice: a flaky tool or verifier fails now and then, not 20 times in a row with the same
message; a wrong reward function or a broken data file fails every episode, and 20 episodes cost
seconds, where a run that kept dropping them would wait out ``sample_timeout_s``."""
TRACEBACK_FRAMES = 6
"""Frames of the user's traceback quoted in errors (the innermost ones: the env's own code)."""


class EnvErrorStreak(RuntimeError):
    """The same env error ended `ENV_ERROR_LIMIT` episodes in a row: it is deterministic; the run stops."""


class EmptyEpisodeStreak(EnvErrorStreak):
    """`ENV_ERROR_LIMIT` agent episodes in a row made no model call: the agent never calls it; the run stops."""


_LIBRARY_DIRS = tuple(
    os.path.normcase(os.path.realpath(path)) + os.sep
    for path in {
        sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # flashrl itself
    }
)
"""Where frames that are not the user's live: the standard library, installed packages and flashrl."""


def is_user_frame(filename: str) -> bool:
    """Whether a traceback frame is in the user's code (not the standard library, a package or flashrl)."""
    if filename.startswith("<"):
        return not filename.startswith("<frozen")  # "<string>" (python -c), "<stdin>": the user's
    return not os.path.normcase(os.path.realpath(filename)).startswith(_LIBRARY_DIRS)


def user_traceback(err: BaseException, frames: int = TRACEBACK_FRAMES) -> str:
    """``err``'s traceback, its innermost ``frames`` frames only, ending with its type and message.

    The user's frames come first: when library frames (an HTTP client's, flashrl's) follow the user's
    innermost one, the quote ends at the user's frame and one line counts the library frames below it.
    What it was raised from is named on a last line (``Caused by httpx2.ReadTimeout: ...``): a library's
    wrapper error (``openai.APITimeoutError: Request timed out.``) often says which case only there.
    """
    summary = traceback.TracebackException.from_exception(err)
    stack = full = list(summary.stack)
    users = [k for k, frame in enumerate(stack) if is_user_frame(frame.filename)]
    below = 0
    if users and users[-1] < len(stack) - 1:
        below = len(stack) - 1 - users[-1]
        stack = stack[: users[-1] + 1]
    summary.stack = traceback.StackSummary.from_list(stack[-frames:])
    lines = list(summary.format(chain=False))
    if below:
        modules = sorted({_top_module(frame.filename) for frame in full[-below:]})
        message = len(list(summary.format_exception_only()))  # the exception's own lines, last
        lines.insert(len(lines) - message, f"  ... then {below} frame(s) in {', '.join(modules)}\n")
    text = "".join(lines).rstrip()
    cause = err.__cause__
    if cause is not None:
        kind = type(cause)
        module = ".".join(part for part in kind.__module__.split(".") if not part.startswith("_"))  # httpx2._exceptions
        name = kind.__qualname__ if module in ("", "builtins") else f"{module}.{kind.__qualname__}"
        text += f"\nCaused by {name}: {str(cause).splitlines()[0] if str(cause) else '(no message)'}"
    return text


def _top_module(filename: str) -> str:
    """A library frame's package, e.g. ``openai`` for ``.../site-packages/openai/_base_client.py``."""
    path = os.path.normcase(os.path.realpath(filename))
    for root in _LIBRARY_DIRS:
        if path.startswith(root):
            return path[len(root):].split(os.sep)[0].removesuffix(".py") or "?"
    return os.path.basename(filename)


def error_signature(err: BaseException) -> str:
    """``Type: message`` (first line): what makes two env errors the same."""
    return f"{type(err).__name__}: {err}".split("\n")[0]


@dataclass(frozen=True)
class EnvErrorRecord:
    """One episode's env error, as quoted in logs and in `EnvErrorStreak`."""

    env_id: str
    episode_index: int
    prompt_id: str | None
    signature: str
    traceback: str
    agent: str | None = None
    """The agent env's agent (`agent_name`); None for a stepped env."""

    def where(self) -> str:
        prompt = "unknown (the reset itself raised)" if self.prompt_id is None else repr(self.prompt_id)
        agent = "" if self.agent is None else f", agent {self.agent}"
        return f"env {self.env_id!r}, episode {self.episode_index}, prompt id {prompt}{agent}"

    def describe(self) -> str:
        return f"{self.where()}:\n{self.traceback}"


def agent_name(env: gym.Env) -> str | None:
    """The agent an agent env runs, as a user named it: ``module.function`` or the command line; None for
    a stepped env (one without ``run_agent``)."""
    inner = env.unwrapped
    if not callable(getattr(inner, "run_agent", None)):
        return None
    agent, command = getattr(inner, "agent", None), getattr(inner, "command", None)
    if command:
        return "command " + repr(" ".join(command))[:200]
    if agent is not None:
        target = agent if hasattr(agent, "__qualname__") else type(agent)
        return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
    return type(inner).__name__


def try_by_hand(agent: str | None, prompt_id: str | None) -> str:
    """How to reproduce an episode's failure by hand, for the env's kind (an agent, or a stepped env)."""
    prompt = "" if prompt_id is None else f" on prompt id {prompt_id!r}"
    if agent is not None:
        return (f"run the agent ({agent}) by hand{prompt}: env.reset(options=...) to that task, then "
                "asyncio.run(env.unwrapped.run_agent(base_url, api_key, model_name=..., wall_time_s=...)) "
                "against any OpenAI-compatible server")
    return f"run one env by hand{prompt}: env.reset(seed=...) to that task, then env.step('0')"


class EnvErrorBooks:
    """One runner's streaks of identical env errors and of agent episodes without a model call (see the
    module docstring), and how often it saw each kind of env error (its log lines)."""

    def __init__(self, limit: int = ENV_ERROR_LIMIT) -> None:
        self.limit = limit
        self.first: EnvErrorRecord | None = None
        """The first error of the current streak."""
        self.count = 0
        self.last: EnvErrorRecord | None = None
        """The latest env error of this runner (kept across streaks)."""
        self.seen: Counter[str] = Counter()
        """Env errors of this runner by signature (a kind's traceback is logged the first time only)."""
        self.empty_count = 0
        """Agent episodes without a model call since the last episode that got through."""

    def error(self, record: EnvErrorRecord) -> EnvErrorStreak | None:
        """Book one env error; returns the error that stops the run once the streak reaches the limit."""
        if self.first is not None and self.first.signature == record.signature:
            self.count += 1
        else:
            self.first, self.count = record, 1
        self.last = record
        self.seen[record.signature] += 1
        if self.seen[record.signature] == 1:
            logger.warning("Environment error (episode dropped, counted as env_error) in %s\n(Logged once; "
                           "repeats of it are one line each.)", record.describe())
        else:
            logger.warning("Environment error again (%d times, %d in a row) in %s: %s",
                           self.seen[record.signature], self.count, record.where(), record.signature)
        if self.count < self.limit:
            return None
        raises = ("an agent that raises every time, so the error is in the agent's code (its tools, its parsing) "
                  if record.agent is not None else
                  "an env that raises every time, so the error is in the env's code (its reward function, its tools) ")
        return EnvErrorStreak(
            f"the same environment error ended {self.count} episodes in a row (ENV_ERROR_LIMIT={self.limit}): "
            f"expected an env whose episodes get through, got {raises}or its data, and retrying cannot help. The "
            f"first of them, in {self.first.describe()}\nFix: correct the "
            f"{'agent' if record.agent is not None else 'env'} or its data ("
            f"{try_by_hand(self.first.agent, self.first.prompt_id)})."
        )

    def empty(self, record: EnvErrorRecord) -> EmptyEpisodeStreak | None:
        """Book one agent episode without a model call (``record.signature`` says so); returns the error that
        stops the run once `limit` of them came in a row."""
        self.empty_count += 1
        if self.empty_count == 1:
            logger.warning("No model call in %s (episode dropped, counted as empty): the agent returned without "
                           "calling the model; %d in a row stop the run.", record.where(), self.limit)
        if self.empty_count < self.limit:
            return None
        return EmptyEpisodeStreak(
            f"the agent {record.agent} made no model call in {self.empty_count} episodes in a row (ENV_ERROR_LIMIT="
            f"{self.limit}), the last in {record.where()}: expected an agent that calls the model at the "
            f"base_url it is given at least once per episode (an episode without one has nothing to train "
            f"on), got one that returns without calling it (a bug, a cached answer, a client built with its own "
            f"base_url). Fix: call the model through the client the runner passes (a command agent: "
            f"OPENAI_BASE_URL and OPENAI_API_KEY), then {try_by_hand(record.agent, record.prompt_id)}."
        )

    def success(self) -> None:
        """An episode got through the env: the streaks start again."""
        self.first, self.count, self.empty_count = None, 0, 0


class EnvBoundary(gym.Wrapper):
    """Records the prompt id of the last reset; refuses env text that the tokenizer cannot encode."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.prompt_id: str | None = None

    def reset(self, **kwargs: Any) -> Any:
        self.prompt_id = None
        messages, info = self.env.reset(**kwargs)
        if isinstance(info, Mapping) and info.get("prompt_id") is not None:
            self.prompt_id = str(info["prompt_id"])
        check_text(messages, "reset")
        return messages, info

    def step(self, action: Any) -> Any:
        result = self.env.step(action)
        check_text(result[0], "step")
        return result


def check_text(value: Any, where: str, path: str = "messages") -> None:
    """Raise ``ValueError`` if a string in ``value`` (messages: lists and dicts of text) is not valid
    Unicode (a lone surrogate cannot be encoded as UTF-8), ``TypeError`` if text came as bytes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(
                f"env.{where} returned {path} with text that is not valid Unicode: expected UTF-8-encodable "
                f"text, got {value[err.start:err.end]!r} at position {err.start} ({err.reason}), which no "
                "tokenizer can encode. Fix: clean the data row or tool output, e.g. "
                "text.encode('utf-8', 'replace').decode('utf-8')"
            ) from None
    elif isinstance(value, bytes | bytearray):
        raise TypeError(f"env.{where} returned {path} as bytes: expected str. Fix: decode it, e.g. "
                         "data.decode('utf-8', 'replace')")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            check_text(item, where, f"{path}[{key!r}]")
    elif isinstance(value, list | tuple):
        for k, item in enumerate(value):
            check_text(item, where, f"{path}[{k}]")
