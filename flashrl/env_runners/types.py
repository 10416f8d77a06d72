"""Typed records that EnvRunners send to the algorithm, and the two seed streams (`flashrl.seeds` derives the seeds)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from flashrl.episode import Episode

TRAIN_STREAM = 0
"""Seed stream of training episodes."""
EVAL_STREAM = 1
"""Seed stream of evaluation episodes (the same prompts at every evaluation)."""

RUNNER_SKIP_REASONS = (
    "non_finite", "invalid_logprob", "aborted", "empty", "over_long", "request_error", "env_error",
    "env_timeout", "bad_reward",
)
"""Why an EnvRunner drops a finished episode instead of streaming it (each one is counted):

- ``non_finite``: a non-finite reward or recorded behavior log-prob (NaN, inf);
- ``invalid_logprob``: a recorded behavior log-prob above 0 (not a log-probability);
- ``aborted``: the engine ended a model turn with finish reason ``"abort"`` (the reply is incomplete);
- ``empty``: no generated token (e.g. a prompt that fills the context), or an agent episode without a
  model call (`ENV_ERROR_LIMIT` of those in a row stop the run: `flashrl.env_runners.env_errors`);
- ``over_long``: longer than ``max_episode_tokens`` (an agent's episode: a segment longer than it);
- ``request_error``: the engine rejected the request;
- ``env_error``: the environment raised;
- ``env_timeout``: ``env.reset`` or ``env.step`` ran past the runner's time limit (``env_timeout_s``);
  the hung call keeps its worker thread and the env is never reused;
- ``bad_reward``: the env's reward is not a real number (text, bool, complex, None, an array of other than
  one number) or lies outside float32's finite range, in one step or summed (`flashrl.env_runners.rollout.reward_value`).
"""
DRIVER_SKIP_REASONS = ("stale", "pending_overflow")
"""Why the algorithm drops a delivered episode before it reaches a batch (each one is counted):

- ``stale``: its oldest model turn is more than ``async_queue_size`` versions behind the learner;
- ``pending_overflow``: the queue of episodes waiting for a later batch (repeated prompts, overflow)
  was full; the oldest one is dropped.
"""
SKIP_REASONS = RUNNER_SKIP_REASONS + DRIVER_SKIP_REASONS
"""Every reason behind ``env_runners/num_skipped_<reason>_lifetime``."""


@dataclass
class RunnerReport:
    """What one EnvRunner delivered since its previous report."""

    runner_index: int
    """Which runner (stable across restarts)."""
    episodes: list[Episode]
    """Finished, valid episodes, oldest first."""
    in_flight: int
    """Episodes being played right now (lost if the runner dies)."""
    buffered: int
    """Finished episodes still held by the runner after this report."""
    started: int
    """Training episodes this runner has started in its lifetime (its data cursor)."""
    skipped: Counter[str] = field(default_factory=Counter)
    """Episodes dropped since the last report, by reason (see SKIP_REASONS)."""
    generated_tokens: int = 0
    """Tokens generated since the last report (delivered and dropped episodes)."""
    engine_version: int = 0
    """Policy version the runner's engine serves now."""
    env_steps: int = 0
    """Environment steps (model turns) since the last report."""
    callback_metrics: dict[str, tuple[str, list[float]]] = field(default_factory=dict)
    """What the runner's callbacks logged since the last report (`flashrl.callbacks.MetricsLogger.state`)."""
    last_env_error: str | None = None
    """The runner's latest env error (env id, episode, prompt id, traceback), None if it had none."""
