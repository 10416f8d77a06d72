"""The ``"agent"`` rollout: env.reset -> an endpoint session -> the user's agent -> a token-exact `Episode`.

An agent env (``flashrl/Agent-v0``, any env with the `AgentPlayable` methods) is not stepped: its
agent program makes model calls through an OpenAI-compatible endpoint (`flashrl.agents`), which
serves them with the policy and records them token-exactly in a per-episode session. `AgentRollout`
is the EnvRunner's side of it: it keeps the runner's endpoints (one per sampling setting, started on
first use, on the host, port and model name of the runner's spec: ``agent_host``, ``agent_port``,
``agent_model_name``) and, each episode, opens a session with the runner's limits (``agent_max_calls``,
``agent_max_completion_tokens``), runs the agent within ``agent_wall_time_s``, closes the session,
computes the reward and builds the episode. How it ends:

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
  (``env_timeout``, `AgentTimeout`). flashrl's choice, not a truncated episode: the time an agent takes
  depends on the machine's load (episodes in flight, weight updates pausing generation), not on the
  policy alone, so a reward given for running out of it would train against the load; and an agent
  stopped mid-way gives no reward of its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

from flashrl.env_runners.env_errors import error_signature
from flashrl.env_runners.rollout import REWARD_ERROR, reward_value
from flashrl.env_runners.rollout_protocol import (
    EnvError,
    EnvTimeout,
    Rollout,
    RolloutContext,
    in_thread,
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
    """The agent ran past the runner's ``agent_wall_time_s``; it was cancelled (a command killed), the episode
    dropped (``env_timeout``).

    Unlike a hung env call, nothing is left running in a thread: the env may be reused.
    """

    env_reusable = True


@runtime_checkable
class AgentPlayable(Protocol):
    """What the runner needs of an agent env (``flashrl.envs.agent_env.AgentEnv`` has it): its tasks, its
    agent and its reward. The endpoint and the limits are the runner's (`AgentRollout`)."""

    reward_fn: Callable[..., Any] | None

    async def run_agent(self, base_url: str, api_key: str, *, model_name: str, wall_time_s: float) -> Any: ...

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


class AgentRollout(Rollout):
    """The ``"agent"`` rollout kind: the env's agent run against the runner's endpoint; see the module docstring."""

    def __init__(self, spec: Any, runner_index: int = 0) -> None:
        super().__init__(spec, runner_index)
        self.servers: dict[tuple[Any, ...], Any] = {}
        """The endpoints (`flashrl.agents.AgentServer`), started on first use: one per sampling setting
        (training, evaluation)."""
        self._servers_lock = asyncio.Lock()
        self._widened_loop: asyncio.AbstractEventLoop | None = None
        """The event loop whose default thread pool this rollout sized for its agent episodes."""

    async def play(self, ctx: RolloutContext) -> Episode | None:
        return await play_agent_episode(ctx, await self._server(ctx), model_name=self.spec.agent_model_name)

    async def close(self) -> None:
        """Stop the endpoints. The runner cancelled its episodes first (`EnvRunner.stop`); model calls still
        being served are cancelled by the stopping server, which is expected, so it is not logged as an error
        (`quiet_expected_cancellation`)."""
        servers = list(self.servers.values())
        self.servers.clear()
        if servers:
            quiet_expected_cancellation()
        for server in servers:
            await server.stop()

    async def _server(self, ctx: RolloutContext) -> Any:
        """The started endpoint for ``ctx.sampling`` (started in this event loop on first use)."""
        from flashrl.agents import AgentServer, ConnectionLimits

        key = tuple(sorted(ctx.sampling.items()))
        loop = asyncio.get_running_loop()
        if self._widened_loop is not loop:  # before any agent of this loop runs (see widen_default_pool)
            widen_default_pool(loop, self.spec.episodes_in_flight_per_env_runner)
            self._widened_loop = loop
        async with self._servers_lock:
            if key not in self.servers:
                spec = self.spec
                server = AgentServer(
                    ctx.engine, sampling=dict(ctx.sampling), max_episode_tokens=ctx.limits.max_episode_tokens,
                    model_name=spec.agent_model_name, host=spec.agent_host, port=spec.agent_port,
                    max_observation_tokens=ctx.limits.max_observation_tokens,
                    sampling_overrides=spec.agent_sampling_overrides,
                    # room for every episode in flight to hold a few connections; a flood evicts idle ones
                    connections=ConnectionLimits(
                        max_connections=max(128, 4 * spec.episodes_in_flight_per_env_runner)
                    ),
                )
                await server.start()
                self.servers[key] = server
                logger.info("EnvRunner %d: agent endpoint at %s", self.runner_index, server.url)
            return self.servers[key]


CANCEL_LINE = re.compile(r"Cancel (\d+|%s) running task\(s\)")
"""uvicorn's line for the calls a stopping server cancels ("Cancel 2 running task(s), timeout graceful shutdown ...")."""


class _ExpectedCancellation(logging.Filter):
    """Drops uvicorn's records of the calls a stopping endpoint cancels: its "Cancel N running task(s)"
    line and the "Exception in ASGI application" traceback of each cancelled call (a ``CancelledError``).
    The runner is stopping and cancelled those calls' episodes first: nothing failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        # the formatted text, not ``record.msg``: a filter installed before this one may already have merged the
        # arguments into the message (LiteLLM's secret redaction does so on uvicorn's loggers when imported)
        try:
            text = record.getMessage()
        except (TypeError, ValueError):  # arguments that do not fit the message: not the line this filter drops
            text = str(record.msg)
        if CANCEL_LINE.match(text):
            return False
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, asyncio.CancelledError)


QUIETED_LOGGERS = ("uvicorn.error", "uvicorn.error.flashrl_agents")
"""uvicorn's error logger and the child the endpoint's guarded connections log to (`flashrl.agents.connections`):
a logger's filter does not see records its children propagate, so each gets its own."""


def quiet_expected_cancellation() -> None:
    """Install `_ExpectedCancellation` on uvicorn's error loggers (once per process)."""
    for name in QUIETED_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(item, _ExpectedCancellation) for item in log.filters):
            log.addFilter(_ExpectedCancellation())


async def play_agent_episode(ctx: RolloutContext, server: Any, *, model_name: str) -> Episode | None:
    """Run ``ctx.env``'s agent once against ``server`` (a started `flashrl.agents.AgentServer`); see the module docstring.

    Args:
        ctx: the episode's context; ``ctx.env.unwrapped`` is `AgentPlayable`. Its limits: the session's
            (``max_calls``, ``max_completion_tokens``), the agent's ``wall_time_s``, ``env_timeout_s`` of
            ``env.reset`` and ``reward_fn``.
        server: the runner's endpoint for ``ctx.sampling``.
        model_name: the model name the endpoint serves (a command agent gets it in ``FLASHRL_MODEL``).

    Returns:
        The episode, or None when the agent made no model call (counted ``empty``).

    Raises:
        AgentTimeout: past ``wall_time_s``. EnvError: the agent raised (its error is the cause), or
        ``reward_fn`` did. EnvTimeout: ``env.reset`` or ``reward_fn`` ran past ``env_timeout_s``.
    """
    from flashrl.agents import AgentLimits

    env, executor, limits = ctx.env, ctx.executor, ctx.limits
    agent: AgentPlayable = env.unwrapped  # type: ignore[assignment]
    _, reset_info = await in_thread(
        executor, limits.env_timeout_s, env.reset, seed=ctx.reset_seed, options=ctx.reset_options
    )
    session_limits = AgentLimits(max_calls=limits.max_calls, max_completion_tokens=limits.max_completion_tokens)
    prompt_id = str(reset_info["prompt_id"])
    session = server.open_session(prompt_id=prompt_id, seed=ctx.session_seed, limits=session_limits)
    info: dict[str, Any] = {key: reset_info[key] for key in ctx.keep_reset_info if key in reset_info}
    deadline = asyncio.timeout(limits.wall_time_s)
    try:
        async with deadline:
            result = await agent.run_agent(
                session.base_url, session.api_key, model_name=model_name, wall_time_s=limits.wall_time_s
            )
        truncated = False
    except Exception as err:  # noqa: BLE001 - the agent's own failure, any type: re-raised unless a limit ended it
        limit = _refusal_behind(err, deadline, session, limits.wall_time_s, prompt_id)
        info.update(agent_limit=limit, agent_error=error_signature(err))
        result, truncated = None, True
    finally:
        session.close()
    if session.calls == 0:
        return None
    reward, source = getattr(result, "reward", None), "the agent (its result's reward)"
    if reward is None:
        transcript = getattr(result, "transcript", None)
        if truncated and agent.reward_fn is None:
            reward = 0.0  # the agent gave no reward before it stopped, and nothing grades its transcript
        else:
            graded = session.transcript if transcript is None else transcript
            reward, source = await in_thread(executor, limits.env_timeout_s, agent.grade, graded), "reward_fn"
    value, problem = reward_value(reward, source)
    if problem is not None:
        logger.warning("%s: the agent's reward was refused (prompt id %r): %s.", type(agent).__name__, prompt_id,
                       problem)
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
