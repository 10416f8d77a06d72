"""The ``"gym"`` rollout: env.reset -> engine.generate -> env.step ... -> a token-exact `Episode`.

`GymRollout` is how an EnvRunner plays a stepped env (`flashrl.env_runners.rollout_protocol`); `play_episode`
is the episode itself.

The conversation is kept token-exact by `flashrl.conversation.TokenizedConversation`: the model's
sampled ids (with the log-probs and the policy version the engine recorded) are appended as sampled,
environment turns are tokenised as chat-template deltas. Environment calls run in a thread pool, so
a slow verifier or tool never blocks the other episodes' generation. Tool schemas an env returns in
its reset info (``info["tools"]``) go to the chat template (`TokenizedConversation(tools=...)`).

Limits (each ends the episode ``truncated``; a truncated episode is trained like any other, with the
reward the env gave so far, as Molt's ``StepEnvRunner.execute`` in ``molt/agents/base.py`` does with
a trajectory that ran out of context, hit a length stop or was truncated by the agent's turn cap):

* ``max_turns``: model turns per episode, on top of the env's own limit; after the last one the env's
  reply is not appended (``info["runner_turn_limit_reached"]``).
* ``max_episode_tokens``: the context budget; the last model turn is cut to fit, an env turn that does
  not fit is not appended (``info["context_budget_exceeded"]``).
* ``max_observation_tokens``: each env message is cut to that many tokens with a marker
  (``info["observations_cut"]``); the episode goes on.
* A model that never answers (never stops on its own, or never gives what the env waits for) is not
  special: a turn that hits ``max_tokens`` is passed to the env as it is (``finish_reason`` "length"),
  the env answers it, and the episode ends at a turn limit or the context budget, truncated, and is
  trained with its reward (0 for an unanswered task). Only an episode with no sampled token at all
  (the prompt filled the budget) is dropped (``empty``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import gymnasium as gym
import numpy as np

from flashrl.env_runners.rollout_protocol import (  # noqa: F401 - EnvError, EnvTimeout: their old home
    DEFAULT_ENV_TIMEOUT_S,
    EnvError,
    EnvTimeout,
    Rollout,
    RolloutContext,
    in_thread,
)
from flashrl.episode import Episode

MAX_LOGPROB = 1e-6
"""Largest behavior log-prob accepted as a log-probability (float rounding above 0 allowed)."""
MAX_REWARD = float(np.finfo(np.float32).max)
"""Largest reward magnitude accepted (about 3.4e38): the learner holds rewards in float32, where a larger
one becomes inf and every batch holding it is skipped."""
REWARD_ERROR = "reward_error"
"""Episode info field that says why the env's reward was refused (the episode is dropped: ``bad_reward``)."""

logger = logging.getLogger("flashrl.env_runners")


def evaluation_reset_options(env: gym.Env, index: int) -> dict[str, Any] | None:
    """Evaluation on a finite task list walks it in order: episode i plays task i mod N.

    Seeded resets would draw tasks at random (with repeats) from a held-out file. An env exposes a
    finite, indexable task list either with ``finite`` and ``tasks`` and accepts
    ``options={"task_index": i}`` (as `MathEnv` does), or with a ``games`` list and
    ``options={"game_index": i}`` (as `ALFWorldEnv` does). Other envs are reset by seed only.
    """
    unwrapped = env.unwrapped
    if getattr(unwrapped, "finite", False) and hasattr(unwrapped, "tasks"):
        return {"task_index": index % len(unwrapped.tasks)}
    games = getattr(unwrapped, "games", None)
    if isinstance(games, Sequence) and games:
        return {"game_index": index % len(games)}
    return None


def finite_task_count(env: gym.Env) -> int | None:
    """How many tasks `evaluation_reset_options` walks through, or None for a seeded (infinite) env."""
    unwrapped = env.unwrapped
    if getattr(unwrapped, "finite", False) and hasattr(unwrapped, "tasks"):
        return len(unwrapped.tasks)
    games = getattr(unwrapped, "games", None)
    if isinstance(games, Sequence) and games:
        return len(games)
    return None


def reward_value(reward: Any, source: str = "step") -> tuple[float, str | None]:
    """An env's reward as a float, or why it is not a reward: ``(value, None)`` or ``(nan, problem)``.

    ``source``: what returned it, named in the fix (``step``; an agent's result or its ``reward_fn``).

    A reward is a real number: a Python ``int`` or ``float``, a NumPy integer or floating scalar, or a
    NumPy array of one such number. Refused: text (``"0.5"`` is not silently read as 0.5), ``bool``
    (the shipped envs return 1.0 and 0.0, and a math ``reward_fn`` returning a bool is refused too: a
    True is more likely a verdict returned by mistake than a reward), complex numbers, None, arrays of
    another size or kind, and magnitudes past float32's finite range (`MAX_REWARD`). NaN and inf pass
    here and are dropped as ``non_finite``, as before.
    """
    value = reward
    if isinstance(value, np.ndarray):
        if value.size != 1:
            return math.nan, f"a reward is one number; got an array of shape {value.shape}"
        value = value.reshape(()).item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return math.nan, (f"a reward is a real number (int or float); got {type(reward).__name__} "
                          f"{_shown(reward)}. Return float(...) from {source}, e.g. 1.0 for a solved task")
    if abs(value) > MAX_REWARD and value not in (math.inf, -math.inf):  # exact for ints of any size
        return math.nan, (f"the reward {_shown(value)} is outside float32's finite range (|reward| <= "
                          f"{MAX_REWARD:.8g}), where the learner holds it; scale the rewards down")
    return float(value), None


def _shown(value: Any) -> str:
    try:
        return f"{value!r:.80}"
    except ValueError:  # an int too long for repr (sys.get_int_max_str_digits)
        return f"(an integer of {int(value).bit_length()} bits)"


def skip_reason(episode: Episode, *, max_episode_tokens: int) -> str | None:
    """Why an episode must not reach the learner (one of `RUNNER_SKIP_REASONS`), or None if it is fine."""
    if REWARD_ERROR in episode.info:
        return "bad_reward"
    if not episode.is_finite:
        return "non_finite"
    if abs(episode.reward) > MAX_REWARD:  # each step's reward fits, but not their sum
        return "bad_reward"
    if any(lp > MAX_LOGPROB for lp, m in zip(episode.behavior_logprobs, episode.loss_mask) if m):
        return "invalid_logprob"
    if "abort" in episode.info.get("finish_reasons", ()):
        return "aborted"
    if episode.num_generated_tokens == 0:
        return "empty"
    # the budget is a context's: each segment of an agent's episode was a context of its own
    if max(part.stop - part.start for part in episode.segments) > max_episode_tokens:
        return "over_long"
    return None


def _bad_completion(completion: Any) -> bool:
    """An aborted turn, or recorded log-probs that are not log-probabilities (NaN, inf, > 0)."""
    if completion.finish_reason == "abort":
        return True
    return not all(math.isfinite(lp) and lp <= MAX_LOGPROB for lp in completion.logprobs)


async def play_episode(
    env: gym.Env,
    engine: Any,
    *,
    reset_seed: int,
    sampling_seed: Callable[[int], int],
    sampling: Mapping[str, Any],
    max_episode_tokens: int,
    executor: Executor,
    reset_options: Mapping[str, Any] | None = None,
    keep_reset_info: Sequence[str] = (),
    env_timeout_s: float | None = DEFAULT_ENV_TIMEOUT_S,
    max_turns: int | None = None,
    max_observation_tokens: int | None = None,
) -> Episode:
    """Run `env` to the end with `engine` as the policy.

    Args:
        env: a `LanguageEnv` (chat messages in, reply text out).
        engine: a `flashrl.engines.Engine`.
        reset_seed: seed of `env.reset` (picks the task).
        sampling_seed: turn number -> seed of that turn's sampling request.
        sampling: `SamplingConfig` fields except `seed` (max_tokens is capped by the context budget).
        max_episode_tokens: context budget of the whole episode.
        executor: where the env's blocking calls run.
        reset_options: options of `env.reset` (e.g. `{"task_index": i}` for evaluation).
        keep_reset_info: fields of the reset info copied into the episode's info when the last step's
            info lacks them (e.g. the benchmark name an evaluation reports by).
        env_timeout_s: time limit of each `env.reset`/`env.step` call (None: none); past it the call
            raises `EnvTimeout`.
        max_turns: most model turns of the episode (None: the env's own limit only).
        max_observation_tokens: longest env message in tokens, cut with a marker past it (None: no limit).
    """
    from flashrl.conversation import TokenizedConversation
    from flashrl.engines import SamplingConfig

    messages, info = await in_thread(
        executor, env_timeout_s, env.reset, seed=reset_seed, options=reset_options
    )
    conversation = TokenizedConversation(
        engine.tokenizer, messages, prompt_id=str(info["prompt_id"]), max_tokens=max_episode_tokens,
        tools=info.get("tools"), max_observation_tokens=max_observation_tokens,
    )
    stop_ids = tuple(sorted(conversation.stop_token_ids))
    total_reward = 0.0
    terminated = truncated = False
    step_info: dict[str, Any] = {}
    reward_error: dict[str, str] = {}
    turn = 0
    while (budget := conversation.max_new_tokens(int(sampling["max_tokens"]))) > 0:
        request = SamplingConfig(
            **{**sampling, "max_tokens": budget, "seed": sampling_seed(turn), "stop_token_ids": stop_ids},
            routed_experts_start=conversation.routed_positions,  # an MoE engine recording routing: what is new
        )
        completion = await engine.generate(conversation.token_ids, request)
        text = conversation.add_model_turn(
            completion.token_ids, completion.logprobs, version=completion.version,
            finish_reason=completion.finish_reason, routed_experts=completion.routed_experts,
        )
        if _bad_completion(completion):
            turn += 1
            break  # the episode is dropped and counted (`skip_reason`): the env never sees the reply
        new_messages, reward, terminated, truncated, step_info = await in_thread(
            executor, env_timeout_s, env.step, text
        )
        turn += 1
        value, problem = reward_value(reward)
        if problem is not None:  # the episode is dropped and counted (`skip_reason`: bad_reward)
            logger.warning("%s.step returned a bad reward in turn %d (prompt id %r): %s.", type(env.unwrapped).__name__,
                           turn, getattr(env, "prompt_id", None), problem)
            reward_error = {REWARD_ERROR: f"turn {turn}: {problem}"}
            break
        total_reward += value
        if terminated or truncated:
            break
        if max_turns is not None and turn >= max_turns:
            truncated = True
            step_info = {**step_info, "runner_turn_limit_reached": True}
            break
        if not conversation.add_env_messages(new_messages):
            break
    if turn == 0:
        truncated = True  # the prompt alone filled the context budget (dropped as 'empty')
    kept = {key: info[key] for key in keep_reset_info if key in info and key not in step_info}
    return conversation.to_episode(
        reward=total_reward, terminated=terminated, truncated=truncated, info={**step_info, **kept, **reward_error}
    )


class GymRollout(Rollout):
    """The ``"gym"`` rollout kind: the env stepped with the engine as the policy (`play_episode`)."""

    async def play(self, ctx: RolloutContext) -> Episode:
        limits = ctx.limits
        return await play_episode(
            ctx.env,
            ctx.engine,
            reset_seed=ctx.reset_seed,
            sampling_seed=ctx.turn_seed,
            sampling=ctx.sampling,
            max_episode_tokens=limits.max_episode_tokens,
            executor=ctx.executor,
            reset_options=ctx.reset_options,
            keep_reset_info=ctx.keep_reset_info,
            env_timeout_s=limits.env_timeout_s,
            max_turns=limits.max_turns,
            max_observation_tokens=limits.max_observation_tokens,
        )
