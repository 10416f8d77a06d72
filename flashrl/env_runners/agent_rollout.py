"""Play one agent episode: env.reset -> an endpoint session -> the user's agent -> a token-exact `Episode`.

An agent env (``flashrl/Agent-v0``, any env with the `AgentPlayable` methods) is not stepped: its
agent program makes model calls through an OpenAI-compatible endpoint (`flashrl.agents`), which
serves them with the policy and records them token-exactly in a per-episode session. This module is
the EnvRunner's side of it: it opens the session, runs the agent within its wall time, closes the
session, computes the reward and builds the episode. How it ends:

* **Returned**: the reward is the agent's own, else ``reward_fn(task, transcript)`` (in a worker
  thread, within ``env_timeout_s``); the episode is terminated. A reward that is not a real number
  drops the episode (``bad_reward``, `flashrl.env_runners.rollout.reward_value`).
* **No model call** (the agent returned or failed before calling the model): no episode (``empty``).
* **Raised** (a command that exits non-zero, or prints no result): an env error (``env_error``) with
  the agent's traceback (a command's stderr), booked in the runner's streak of identical env errors
  (`flashrl.env_runners.env_errors`). Except after the endpoint refused a call for a limit
  (``max_calls``, ``max_completion_tokens``, the context budget; `LIMIT_CODES`): an agent that does
  not handle that refusal has used up what the episode allows, which the policy decided, as in a turn
  limit of `play_episode`; the episode ends truncated with the reward so far (``reward_fn`` on the
  endpoint's transcript, else 0). After a call the engine failed (``engine_error``) the runner fails,
  as `play_episode` does when the engine raises.
* **Past wall_time_s**: the agent is cancelled (a command is killed) and the episode dropped
  (``env_timeout``). flashrl's choice, not a truncated episode: the time an agent takes depends on
  the machine's load (episodes in flight, weight updates pausing generation), not on the policy
  alone, so a reward given for running out of it would train against the load; and an agent
  stopped mid-way gives no reward of its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

import gymnasium as gym

from flashrl.env_runners.env_errors import error_signature
from flashrl.env_runners.rollout import (
    DEFAULT_ENV_TIMEOUT_S,
    REWARD_ERROR,
    EnvError,
    EnvTimeout,
    _in_thread,
    reward_value,
)
from flashrl.episode import Episode

logger = logging.getLogger("flashrl.env_runners")

LIMIT_CODES = ("call_limit", "completion_token_limit", "context_length_exceeded", "engine_aborted")
"""The endpoint's refusals after which an agent that raises ends its episode truncated, not as an env error:
its limits (`flashrl.agents.AgentLimits`: ``max_calls``, ``max_completion_tokens``), the context budget
(``max_episode_tokens``, as `play_episode` truncates), and a call the engine aborted (the episode is
then dropped as ``aborted``, as `play_episode` drops one)."""
ENGINE_ERROR_CODE = "engine_error"
"""The endpoint's refusal of a call the engine failed: fatal to the runner, as in `play_episode`."""


class AgentTimeout(EnvTimeout):
    """The agent ran past its env's ``wall_time_s``; it was cancelled (a command killed), the episode dropped.

    Unlike a hung env call, nothing is left running in a thread: the env may be reused.
    """


@runtime_checkable
class AgentPlayable(Protocol):
    """What the runner needs of an agent env (``flashrl.envs.agent_env.AgentEnv`` has it)."""

    max_calls: int
    max_completion_tokens: int | None
    wall_time_s: float
    host: str
    port: int
    model_name: str
    reward_fn: Callable[..., Any] | None

    async def run_agent(self, base_url: str, api_key: str) -> Any: ...

    def grade(self, transcript: list[Any]) -> Any: ...

    def success_info(self, reward: Any, success: bool | None) -> dict[str, bool]: ...


def default_pool_size(episodes_in_flight: int) -> int:
    """Threads of the default pool of an event loop that plays ``episodes_in_flight`` agent episodes.

    Two an episode, and never fewer than Python's own default: a function agent's blocking work goes to
    this pool (``asyncio.to_thread``), and so does the first request of each episode's ``openai`` client
    (it looks up the platform there). With Python's default (the CPU count + 4, at most 32) more episodes
    than threads, each holding a thread through a model call, wait for each other until their wall time.
    """
    return max(min(32, (os.cpu_count() or 1) + 4), 2 * episodes_in_flight + 4)


def widen_default_pool(loop: asyncio.AbstractEventLoop, episodes_in_flight: int) -> None:
    """Give ``loop`` a default thread pool of `default_pool_size` threads (the old pool finishes what it runs)."""
    loop.set_default_executor(
        ThreadPoolExecutor(max_workers=default_pool_size(episodes_in_flight), thread_name_prefix="agent-default")
    )


def is_agent_env(env: gym.Env) -> bool:
    """Whether the runner plays ``env`` with `play_agent_episode` (its unwrapped env is `AgentPlayable`)."""
    return isinstance(env.unwrapped, AgentPlayable)


async def play_agent_episode(
    env: gym.Env,
    server: Any,
    *,
    reset_seed: int,
    session_seed: int,
    executor: Executor,
    reset_options: Mapping[str, Any] | None = None,
    keep_reset_info: Sequence[str] = (),
    env_timeout_s: float | None = DEFAULT_ENV_TIMEOUT_S,
) -> Episode | None:
    """Run ``env``'s agent once against ``server`` (a started `flashrl.agents.AgentServer`); see the module docstring.

    Args:
        env: an env whose unwrapped env is `AgentPlayable`.
        server: the runner's endpoint.
        reset_seed: seed of `env.reset` (picks the task).
        session_seed: the session's seed (call k samples with ``stream_seed(session_seed, k)``).
        executor: where ``env.reset`` and ``reward_fn`` run.
        reset_options: options of `env.reset` (e.g. ``{"task_index": i}``).
        keep_reset_info: fields of the reset info copied into the episode's info.
        env_timeout_s: time limit of ``env.reset`` and of ``reward_fn`` (None: none).

    Returns:
        The episode, or None when the agent made no model call (counted ``empty``).

    Raises:
        AgentTimeout: past ``wall_time_s``. EnvError: the agent raised (its error is the cause), or
        ``reward_fn`` did. EnvTimeout: ``env.reset`` or ``reward_fn`` ran past ``env_timeout_s``.
    """
    from flashrl.agents import AgentLimits

    agent: AgentPlayable = env.unwrapped  # type: ignore[assignment]
    _, reset_info = await _in_thread(executor, env_timeout_s, env.reset, seed=reset_seed, options=reset_options)
    limits = AgentLimits(max_calls=agent.max_calls, max_completion_tokens=agent.max_completion_tokens)
    prompt_id = str(reset_info["prompt_id"])
    session = server.open_session(prompt_id=prompt_id, seed=session_seed, limits=limits)
    info: dict[str, Any] = {key: reset_info[key] for key in keep_reset_info if key in reset_info}
    deadline = asyncio.timeout(agent.wall_time_s)
    try:
        async with deadline:
            result = await agent.run_agent(session.base_url, session.api_key)
        truncated = False
    except Exception as err:  # noqa: BLE001 - the agent's own failure, any type: re-raised unless a limit ended it
        limit = _refusal_behind(err, deadline, session, agent.wall_time_s, prompt_id)
        info.update(agent_limit=limit, agent_error=error_signature(err))
        result, truncated = None, True
    finally:
        session.close()
    if session.calls == 0:
        return None
    reward = getattr(result, "reward", None)
    if reward is None:
        transcript = getattr(result, "transcript", None)
        if truncated and agent.reward_fn is None:
            reward = 0.0  # the agent gave no reward before it stopped, and nothing grades its transcript
        else:
            graded = session.transcript if transcript is None else transcript
            reward = await _in_thread(executor, env_timeout_s, agent.grade, graded)
    value, problem = reward_value(reward)
    if problem is not None:
        logger.warning("%s: the agent's reward was refused: %s.", type(agent).__name__, problem)
        info[REWARD_ERROR] = problem
        value = 0.0
    # the session adds what it recorded (its calls, segments, refused requests by code)
    info.update(agent.success_info(value if problem is None else None, getattr(result, "success", None)))
    return session.to_episode(reward=value, terminated=not truncated, truncated=truncated, info=info)


def _refusal_behind(err: Exception, deadline: asyncio.Timeout, session: Any, wall_time_s: float, prompt_id: str) -> str:
    """The limit refusal (one of `LIMIT_CODES`) that ended an agent which raised ``err``; else raise what it was."""
    if isinstance(err, TimeoutError) and deadline.expired():
        raise AgentTimeout(
            f"the agent did not return within wall_time_s={wall_time_s} s ({session.calls} model calls made); it "
            "was cancelled and the episode dropped."
        ) from None
    if session.errors.get(ENGINE_ERROR_CODE):
        raise RuntimeError(f"the engine failed a model call of an agent episode ({prompt_id!r}); the agent then "
                           "raised") from err
    limit = next((code for code in LIMIT_CODES if session.errors.get(code)), None)
    if limit is None:
        raise EnvError(f"{type(err).__name__}: {err}") from err
    return limit
