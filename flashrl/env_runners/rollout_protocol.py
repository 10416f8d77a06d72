"""The one rollout protocol: `Rollout.play(ctx) -> Episode | None`, its typed `RolloutContext`, the limits
and the failure kinds.

Every episode an EnvRunner plays goes through one `Rollout`, chosen once per runner from the env's
declared kind (`declared_kind`) and looked up in the registry (`flashrl.env_runners.rollouts`):
``"gym"``, stepped with the engine (`flashrl.env_runners.rollout.GymRollout`), or ``"agent"``, the
env's agent program run against the runner's OpenAI-compatible endpoint
(`flashrl.env_runners.agent_rollout.AgentRollout`). A rollout gets everything it may use in its
context (the env, the engine, the seeds, the sampling, the runner's limits, the thread pool, the
reset options) and returns the episode, or None when it produced none (counted ``empty``).

A rollout ends an episode it cannot finish by raising one of the failure kinds below; the runner maps
each to its outcome in one place (`failure_kind`, ``EnvRunner._play``): `EnvTimeout` ->
``env_timeout``, `EnvError` -> ``env_error``, the engine's ``RequestError`` -> ``request_error``; any
other exception is fatal to the runner (an engine failure). See docs/design.md, "Layout".
"""

from __future__ import annotations

import abc
import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import gymnasium as gym

from flashrl.episode import Episode
from flashrl.seeds import stream_seed

if TYPE_CHECKING:  # the engines import torch: not at import time of the specs that read this module
    from flashrl.engines.types import Engine

__all__ = [
    "DEFAULT_ENV_TIMEOUT_S",
    "EnvError",
    "EnvTimeout",
    "Rollout",
    "RolloutContext",
    "RolloutLimits",
    "declared_kind",
    "failure_kind",
    "in_thread",
]

DEFAULT_ENV_TIMEOUT_S = 300.0
"""Default time limit of one ``env.reset`` or ``env.step`` call (a sandboxed tool run, a verifier
call and a game step all take seconds; a call still running after five minutes is hung)."""


class EnvError(RuntimeError):
    """The environment raised during reset or step; the episode is dropped and counted (``env_error``)."""


class EnvTimeout(EnvError):
    """``env.reset``/``env.step`` did not return within the time limit; the episode is dropped and counted
    (``env_timeout``).

    A Python thread cannot be killed: the call goes on in its worker thread until it returns (if ever),
    and the env it holds must never be used again (it is not returned to the pool).
    """

    env_reusable: ClassVar[bool] = False
    """Whether the env may be played again: not while a hung call still holds it in a thread."""


def failure_kind(err: BaseException) -> str | None:
    """The outcome an episode that raised ``err`` is counted as (one of `RUNNER_SKIP_REASONS`), or None
    when ``err`` is fatal to the runner (the engine failed: the group restarts the runner)."""
    from flashrl.engines import RequestError

    if isinstance(err, EnvTimeout):
        return "env_timeout"
    if isinstance(err, EnvError):
        return "env_error"
    if isinstance(err, RequestError):
        return "request_error"
    return None


async def in_thread(
    executor: Executor, timeout_s: float | None, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)`` in ``executor`` within ``timeout_s``: the one place an env call's time limit
    (``env_timeout_s``) is enforced. Raises `EnvTimeout` past it, `EnvError` (the cause attached) when
    ``fn`` raises."""
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(executor, lambda: fn(*args, **kwargs))
    try:
        # shield: on timeout wait_for would cancel the future, which cannot stop a running thread anyway.
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)
    except TimeoutError:
        # Whatever the hung call ends with later is nobody's to handle: retrieve it so asyncio does not log it.
        future.add_done_callback(lambda done: done.cancelled() or done.exception())
        raise EnvTimeout(
            f"{getattr(fn, '__name__', fn)} did not return within {timeout_s} s (env_timeout_s); the call "
            "goes on in its thread and the env is discarded."
        ) from None
    except Exception as err:  # the env's own failure: reported as such, not as an engine failure
        raise EnvError(f"{type(err).__name__}: {err}") from err


@dataclass(frozen=True)
class RolloutLimits:
    """The runner's limits of one episode, read from its spec (`EnvRunnerSpec`, which holds their defaults).

    Each is enforced in one place: the context budget and turn limits by the conversation or the endpoint,
    the env calls' time by `in_thread`, the agent's calls and tokens by its endpoint session, its wall time
    by `AgentRollout`."""

    max_episode_tokens: int
    """Context budget of an episode (the spec's, capped by the engine's ``max_model_len``)."""
    max_turns: int | None
    """Model turns of a stepped episode on top of the env's own limit (None: none)."""
    max_observation_tokens: int | None
    """Longest env message (or agent message added to a segment) in tokens, cut past it (None: no limit)."""
    env_timeout_s: float | None
    """Time limit of one env call (reset, step, an agent env's reward_fn); None: none."""
    max_calls: int
    """An agent's model calls per episode (the endpoint refuses more)."""
    max_completion_tokens: int | None
    """An agent's completion tokens per episode (None: each call's ``max_tokens`` only)."""
    wall_time_s: float
    """An agent's wall time per episode (past it the agent is cancelled and the episode dropped)."""


@dataclass(frozen=True)
class RolloutContext:
    """Everything one episode's rollout may use, built by the runner for each episode."""

    env: gym.Env
    """The env instance (wrapped; ``env.unwrapped`` is the env's class)."""
    engine: Engine
    """The runner's engine (the policy)."""
    run_seed: int
    """The run's seed (`EnvRunnerSpec.seed`)."""
    stream: int
    """The seed stream (`TRAIN_STREAM`, `EVAL_STREAM`)."""
    index: int
    """The episode's prompt index in its stream."""
    replica: int
    """Which replica of the prompt (sync_group's groups, evaluation's samples per prompt)."""
    sampling: Mapping[str, Any]
    """`SamplingConfig` fields except the seed (temperature, top_p, top_k, max_tokens)."""
    limits: RolloutLimits
    """The runner's limits."""
    executor: Executor
    """Where the env's blocking calls run."""
    reset_options: Mapping[str, Any] | None = None
    """Options of ``env.reset`` (a task index for training passes and evaluation), None: by seed only."""
    keep_reset_info: Sequence[str] = field(default_factory=tuple)
    """Fields of the reset info copied into the episode's info (e.g. the benchmark name)."""

    @property
    def reset_seed(self) -> int:
        """Seed of ``env.reset`` (picks the task: the same for every replica)."""
        return stream_seed(self.run_seed, self.stream, self.index)

    @property
    def session_seed(self) -> int:
        """Seed of the episode's sampling (an agent session's call k samples with ``stream_seed(it, k)``)."""
        return stream_seed(self.run_seed, self.stream, self.index, self.replica)

    def turn_seed(self, turn: int) -> int:
        """Seed of a stepped episode's model turn ``turn``."""
        return stream_seed(self.run_seed, self.stream, self.index, self.replica, turn)


class Rollout(abc.ABC):
    """How an EnvRunner plays one episode; one instance per runner, shared by its concurrent episodes.

    A subclass is registered under a kind name (`flashrl.env_runners.rollouts`) and chosen for an env
    whose class declares that kind (`declared_kind`). Its constructor takes the runner's spec and index.
    """

    def __init__(self, spec: Any, runner_index: int = 0) -> None:
        self.spec = spec
        """The runner's `EnvRunnerSpec` (settings a kind reads besides the limits, e.g. its endpoint's)."""
        self.runner_index = runner_index
        """The runner's index (for its log lines)."""

    @abc.abstractmethod
    async def play(self, ctx: RolloutContext) -> Episode | None:
        """Play one episode; None when it produced no episode (counted ``empty``).

        Raises one of the failure kinds (`failure_kind`) for an episode to drop; anything else stops the runner.
        """

    async def close(self) -> None:
        """Release what the rollout started (the runner stops); nothing by default."""


def declared_kind(env_class: type) -> str | type[Rollout]:
    """The rollout kind an env class declares: its ``rollout_kind`` (a registered name, or a `Rollout` subclass,
    which then travels with the env class to the runners), else ``"agent"`` when it has the agent env's
    methods (`flashrl.env_runners.agent_rollout.AgentPlayable`), else ``"gym"`` (stepped)."""
    kind = getattr(env_class, "rollout_kind", None)
    if isinstance(kind, str) or (isinstance(kind, type) and issubclass(kind, Rollout)):
        return kind
    if all(inspect.isfunction(getattr(env_class, name, None)) for name in AGENT_METHODS):
        return "agent"
    return "gym"


AGENT_METHODS = ("run_agent", "grade", "success_info")
"""The methods that make an env an agent env (`flashrl.env_runners.agent_rollout.AgentPlayable`)."""
