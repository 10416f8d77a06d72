"""What an EnvRunner does with an environment that raises: count it, name it, and stop a deterministic one.

An episode whose ``env.reset`` / ``env.step`` raises is dropped and counted (``env_error``); the env
is closed off the event loop. One error is bad luck (a flaky tool, a network blip); the same error
(type and message) ending `ENV_ERROR_LIMIT` episodes in a row is in the env's code or its data and
will not go away, so the runner stops the run with `EnvErrorStreak`: the user's traceback of the
first of them, the env id and the episode's prompt id. Any episode that gets through the env in
between starts the count again.

`EnvBoundary` wraps every env a runner makes: it records the prompt id of the last reset (an episode
carries it as ``info["prompt_id"]``) and refuses text the tokenizer cannot encode (a lone surrogate
such as ``"\\ud800"`` from a dataset row or a tool's output) inside the env's own call, so such text
is an env error, counted like any other, not a crash of the runner.
"""

from __future__ import annotations

import logging
import traceback
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


def user_traceback(err: BaseException, frames: int = TRACEBACK_FRAMES) -> str:
    """``err``'s traceback, its innermost ``frames`` frames only, ending with its type and message.

    What it was raised from is named on a last line (``Caused by httpx2.ReadTimeout: ...``): a library's
    wrapper error (``openai.APITimeoutError: Request timed out.``) often says which case only there.
    """
    summary = traceback.TracebackException.from_exception(err)
    summary.stack = traceback.StackSummary.from_list(list(summary.stack)[-frames:])
    text = "".join(summary.format(chain=False)).rstrip()
    cause = err.__cause__
    if cause is not None:
        kind = type(cause)
        module = ".".join(part for part in kind.__module__.split(".") if not part.startswith("_"))  # httpx2._exceptions
        name = kind.__qualname__ if module in ("", "builtins") else f"{module}.{kind.__qualname__}"
        text += f"\nCaused by {name}: {str(cause).splitlines()[0] if str(cause) else '(no message)'}"
    return text


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

    def describe(self) -> str:
        prompt = "unknown (the reset itself raised)" if self.prompt_id is None else repr(self.prompt_id)
        return f"env {self.env_id!r}, episode {self.episode_index}, prompt id {prompt}:\n{self.traceback}"


class EnvErrorBooks:
    """One runner's streak of identical env errors (see the module docstring)."""

    def __init__(self, limit: int = ENV_ERROR_LIMIT) -> None:
        self.limit = limit
        self.first: EnvErrorRecord | None = None
        """The first error of the current streak."""
        self.count = 0
        self.last: EnvErrorRecord | None = None
        """The latest env error of this runner (kept across streaks)."""

    def error(self, record: EnvErrorRecord) -> EnvErrorStreak | None:
        """Book one env error; returns the error that stops the run once the streak reaches the limit."""
        if self.first is not None and self.first.signature == record.signature:
            self.count += 1
        else:
            self.first, self.count = record, 1
            logger.warning("Environment error (episode dropped, counted as env_error) in %s", record.describe())
        self.last = record
        if self.count > 1:
            logger.warning("Environment error again in episode %d (%d in a row): %s",
                           record.episode_index, self.count, record.signature)
        if self.count < self.limit:
            return None
        return EnvErrorStreak(
            f"the same environment error ended {self.count} episodes in a row (ENV_ERROR_LIMIT={self.limit}): "
            f"expected an env that steps, got one that raises every time, so the error is in the env's code "
            f"(its reward function, its tools) or its data, and retrying cannot help. The first of them, in "
            f"{self.first.describe()}\nFix: correct the env or its data (run one env by hand: "
            f"env.reset(seed=0); env.step('0'))."
        )

    def success(self) -> None:
        """An episode got through the env: the streak starts again."""
        self.first, self.count = None, 0


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
