"""What the env runners need to know about a run: the env, the engine, sampling, evaluation, limits.

Nothing here is specific to an algorithm: an algorithm builds the spec from its own config with
``EnvRunnerSpec.from_config(config)`` (every field of the same name), so the env runners never
import an algorithm's config. The spec is frozen and travels to the EnvRunner actors as it is (a
picklable dataclass); ``to_dict()`` / ``from_dict()`` give its plain form.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

__all__ = ["EnvRunnerSpec"]


@dataclass(frozen=True)
class EnvRunnerSpec:
    """Everything an ``EnvRunner`` and the ``EnvRunnerGroup`` read (picklable; one per run)."""

    # --- environment -----------------------------------------------------------------------------
    env: str
    """Gymnasium id of the language environment, e.g. 'flashrl/Math-v0'."""
    env_config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `gymnasium.make(env, **env_config)` for the training episodes."""

    # --- the actors -------------------------------------------------------------------------------
    num_env_runners: int = 1
    """Number of EnvRunner actors sharing the training prompt stream."""
    num_cpus_per_env_runner: float = 1.0
    """Logical CPUs each EnvRunner actor reserves in Ray."""
    num_gpus_per_env_runner: float = 0.0
    """GPUs each EnvRunner actor reserves (its engine runs there); 0 = CPU inference."""
    restart_failed_env_runners: bool = True
    """Restart an EnvRunner actor that died (its in-flight episodes are counted as lost)."""
    max_num_env_runner_restarts: int = 100
    """Give up (raise) after this many restarts in one run."""
    sample_timeout_s: float = 600.0
    """Seconds a call to the runners (start, sample, load weights) may take before it is an error."""

    # --- the engine and the stream ----------------------------------------------------------------
    engine: str = "vllm"
    """Inference engine kind: 'vllm' or 'torch'."""
    engine_options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of `flashrl.engines.make_engine`."""
    episodes_in_flight_per_env_runner: int = 16
    """K: episodes each runner keeps running at once (the engine batches their requests)."""
    max_buffered_episodes_per_env_runner: int | None = None
    """Finished episodes a runner holds before it pauses new ones; None = K (see `max_buffered_episodes`)."""
    async_queue_size: int | None = None
    """Batches the runners may run ahead of the learner; set: training episodes start only as granted."""
    train_batch_size: int = 32
    """B: the most episodes one poll of a runner returns (one batch's worth)."""

    # --- sampling ---------------------------------------------------------------------------------
    temperature: float = 1.0
    """Sampling temperature of the training episodes."""
    top_p: float = 1.0
    """Nucleus mass of the training episodes."""
    top_k: int = 0
    """Top-k truncation (training and evaluation), 0 = off."""
    max_new_tokens: int = 256
    """Most tokens the model may generate in one turn."""
    max_episode_tokens: int = 2048
    """Context budget of an episode (prompt + all turns); longer episodes are dropped as over_long."""

    # --- evaluation -------------------------------------------------------------------------------
    evaluation_num_episodes: int = 32
    """Prompts per evaluation split; a finite task list with fewer tasks plays each once."""
    evaluation_temperature: float = 0.0
    """Sampling temperature of the evaluation episodes; 0 = greedy."""
    evaluation_top_p: float = 1.0
    """Nucleus mass of the evaluation episodes."""
    evaluation_env_config: dict[str, Any] = field(default_factory=dict)
    """Overrides of env_config for the evaluation env."""
    evaluation_splits: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Split name -> env_config overrides on top of evaluation_env_config; {} = one unnamed split."""
    evaluation_datasource_key: str | None = "data_source"
    """Reset-info field kept in an evaluation episode's info (the benchmark it is reported under)."""

    # --- debugging --------------------------------------------------------------------------------
    seed: int = 0
    """Seed of the engines and of every episode's reset and sampling (see `stream_seed`)."""
    log_level: str = "WARNING"
    """Python logging level of the flashrl loggers in the actors."""

    def __post_init__(self) -> None:
        # Own copies: the spec is frozen, and its dicts must not change through the caller's.
        for name in ("env_config", "engine_options", "evaluation_env_config"):
            value = getattr(self, name)
            _check(isinstance(value, Mapping), name, "a mapping of keyword arguments", value)
            object.__setattr__(self, name, dict(value))
        splits = self.evaluation_splits
        _check(isinstance(splits, Mapping) and all(isinstance(v, Mapping) for v in splits.values()),
               "evaluation_splits", "a mapping of split name -> env_config overrides", splits)
        object.__setattr__(self, "evaluation_splits", {str(k): dict(v) for k, v in splits.items()})
        self._check_values()

    def _check_values(self) -> None:
        _check(isinstance(self.env, str) and self.env != "", "env",
               "a Gymnasium id such as 'flashrl/Math-v0'", self.env)
        for name in ("num_env_runners", "episodes_in_flight_per_env_runner", "train_batch_size",
                     "max_new_tokens", "max_episode_tokens", "evaluation_num_episodes"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, name, "an integer >= 1", value)
        for name in ("max_buffered_episodes_per_env_runner", "async_queue_size"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= 1), name, "None or an integer >= 1", value)
        for name in ("top_k", "max_num_env_runner_restarts", "seed"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 0, name, "an integer >= 0", value)
        _check(_is_number(self.temperature) and self.temperature > 0, "temperature",
               "a finite number > 0 (the learner corrects the sampled log-probs)", self.temperature)
        _check(_is_number(self.evaluation_temperature) and self.evaluation_temperature >= 0,
               "evaluation_temperature", "a finite number >= 0 (0 = greedy)", self.evaluation_temperature)
        for name in ("top_p", "evaluation_top_p"):
            value = getattr(self, name)
            _check(_is_number(value) and 0.0 < value <= 1.0, name, "a number in (0, 1]", value)
        _check(_is_number(self.sample_timeout_s) and self.sample_timeout_s > 0, "sample_timeout_s",
               "a number of seconds > 0", self.sample_timeout_s)

    @property
    def max_buffered_episodes(self) -> int:
        """Finished episodes a runner may hold before it pauses new ones (K unless set)."""
        if self.max_buffered_episodes_per_env_runner is None:
            return self.episodes_in_flight_per_env_runner
        return self.max_buffered_episodes_per_env_runner

    def to_dict(self) -> dict[str, Any]:
        """Plain values, field by field (dicts copied)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("env_config", "engine_options", "evaluation_env_config"):
            out[name] = dict(out[name])
        out["evaluation_splits"] = {k: dict(v) for k, v in self.evaluation_splits.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EnvRunnerSpec:
        """Inverse of `to_dict()`; unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"Unknown EnvRunnerSpec fields {unknown}; expected a subset of {sorted(known)}. "
                "Fix: build the spec with EnvRunnerSpec.from_config(config) from an algorithm config."
            )
        return cls(**data)

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> EnvRunnerSpec:
        """The spec of an algorithm config: every spec field read from the config field of that name.

        ``config`` is any object with those attributes (e.g. a ``FlashReinforceConfig``); a field it
        lacks keeps the spec's default, except ``env``, which it must have. ``overrides`` win.
        """
        settings = {f.name: getattr(config, f.name) for f in fields(cls) if hasattr(config, f.name)}
        settings.update(overrides)
        missing = [f.name for f in fields(cls)
                   if f.default is MISSING and f.default_factory is MISSING and f.name not in settings]
        if missing:
            raise ValueError(
                f"EnvRunnerSpec.from_config: the config ({type(config).__name__}) has no field {missing}; "
                "expected an algorithm config with the env runners' fields (e.g. FlashReinforceConfig)."
            )
        return cls(**settings)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, name: str, expected: str, actual: Any) -> None:
    if not ok:
        raise ValueError(f"EnvRunnerSpec.{name}: expected {expected}; got {actual!r}.")
