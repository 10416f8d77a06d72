"""Metrics of a batch's finished episodes: turns, tokens, how they ended, their info fields, per data source.

Keys (all over the episodes of the batch the learner trained on):

- ``env_runners/episode_turns_mean`` / ``_min`` / ``_max``: model turns per episode;
- ``env_runners/episode_tokens_mean`` / ``_max`` (prompt, model and environment tokens) and
  ``env_runners/episode_generated_tokens_mean`` / ``_max`` (the model's);
- ``env_runners/termination/<reason>``: episodes per `TERMINATION_REASONS` (zeros included);
- ``env_runners/episode_info/<name>_mean`` (and ``_min`` / ``_max`` for numbers that are not bools)
  for every numeric field ``name`` of the episodes' ``info`` (the last step's info: ``tool_calls``,
  ``success``, ``correct``, ``duration_s``, ...), over the episodes that have it; bookkeeping fields
  (`BOOKKEEPING_INFO`) are left out. Non-finite values are left out of the mean and counted under
  ``<name>_num_non_finite`` (present only when there is one);
- ``env_runners/by_data_source/<source>/episode_return_mean``, ``num_episodes`` and, when the episodes
  carry success labels, ``success_mean``, for each value of the info field ``datasource_key`` (the
  evaluation's ``evaluation_datasource_key``), when any episode has it (``unknown`` for the others).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from flashrl.episode import Episode
from flashrl.metrics.stats import mean

TERMINATION_REASONS = ("terminated", "truncated", "context_budget", "other")
"""How an episode ended: the env terminated it, the env truncated it (e.g. a turn limit), the context
budget (``max_episode_tokens``) ended it, or none of these (the env returned no next message)."""
BOOKKEEPING_INFO = ("episode_index", "replica", "runner_index", "task_index", "game_index", "num_model_turns")
"""Numeric info fields that are indices, not measurements (``num_model_turns`` is ``episode_turns``)."""
UNKNOWN_SOURCE = "unknown"


def termination_reason(episode: Episode) -> str:
    """One of `TERMINATION_REASONS` for ``episode``."""
    if episode.info.get("context_budget_exceeded"):
        return "context_budget"
    if episode.terminated:
        return "terminated"
    if episode.truncated:
        return "truncated"
    return "other"


def _number(value: Any) -> float | bool | None:
    """A bool, a float, or None for what is not a number (strings, lists, dicts, None)."""
    if isinstance(value, bool):
        return value
    if hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "ndim", 1) == 0:
        value = value.item()  # numpy scalars
        if isinstance(value, bool):
            return value
    if isinstance(value, (int, float)):
        return float(value)
    return None


def episode_metrics(episodes: Sequence[Episode], *, datasource_key: str | None = None) -> dict[str, float]:
    """The keys of the module docstring for ``episodes`` (a batch; empty gives {})."""
    if not episodes:
        return {}
    out: dict[str, float] = {}
    turns = [len(ep.policy_versions) for ep in episodes]
    tokens = [len(ep.token_ids) for ep in episodes]
    generated = [ep.num_generated_tokens for ep in episodes]
    out["env_runners/episode_turns_mean"] = mean(turns)
    out["env_runners/episode_turns_min"] = float(min(turns))
    out["env_runners/episode_turns_max"] = float(max(turns))
    out["env_runners/episode_tokens_mean"] = mean(tokens)
    out["env_runners/episode_tokens_max"] = float(max(tokens))
    out["env_runners/episode_generated_tokens_mean"] = mean(generated)
    out["env_runners/episode_generated_tokens_max"] = float(max(generated))
    reasons = Counter(termination_reason(ep) for ep in episodes)
    for reason in TERMINATION_REASONS:
        out[f"env_runners/termination/{reason}"] = float(reasons[reason])
    out.update(_info_metrics(episodes))
    out.update(_source_metrics(episodes, datasource_key))
    return out


def _info_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    values: dict[str, list[float | bool]] = defaultdict(list)
    for ep in episodes:
        for name, value in ep.info.items():
            if name in BOOKKEEPING_INFO or not isinstance(name, str):
                continue
            number = _number(value)
            if number is not None:
                values[name].append(number)
    out: dict[str, float] = {}
    for name in sorted(values):
        prefix = f"env_runners/episode_info/{name}"
        found = values[name]
        finite = [float(v) for v in found if math.isfinite(v)]
        if len(finite) < len(found):
            out[f"{prefix}_num_non_finite"] = float(len(found) - len(finite))
        if not finite:
            continue
        out[f"{prefix}_mean"] = mean(finite)
        if not all(isinstance(v, bool) for v in found):  # a bool's mean is its rate; min/max say nothing
            out[f"{prefix}_min"] = min(finite)
            out[f"{prefix}_max"] = max(finite)
    return out


def _source_metrics(episodes: Sequence[Episode], key: str | None) -> dict[str, float]:
    if key is None or not any(key in ep.info for ep in episodes):
        return {}
    by_source: dict[str, list[Episode]] = defaultdict(list)
    for ep in episodes:
        by_source[str(ep.info.get(key, UNKNOWN_SOURCE))].append(ep)
    out: dict[str, float] = {}
    for source, group in sorted(by_source.items()):
        prefix = f"env_runners/by_data_source/{source}/"
        out[prefix + "episode_return_mean"] = mean([ep.reward for ep in group])
        out[prefix + "num_episodes"] = float(len(group))
        labels = [ep.success for ep in group if ep.success is not None]
        if labels:
            out[prefix + "success_mean"] = mean([float(s) for s in labels])
    return out
