"""The evaluation protocol, shared by the episode stream (`FlashReinforce.evaluate()`) and `flashrl eval`.

Both run `run_evaluation` over a sampler with `EnvRunner.sample(..., evaluation=True, split=...)`
(the `EnvRunnerGroup` in training, one in-process `EnvRunner` in `flashrl eval`), so they score the
same prompts the same way: prompt ``i`` of a split resets its env with the evaluation seed of index
``i`` (on a finite task list: task ``i``, in order), and its ``k`` samples (replicas ``0..k-1``)
sample with seeds derived from ``(seed, i, replica, turn)``, at the evaluation temperature and
top_p. Which splits and how many prompts: `evaluation_splits`, `num_prompts`; the metrics of the
episodes: `evaluation_metrics`.

Metrics, as the reference's runtime reports them (Molt: ``pass1`` and ``pass{k}`` per data source):

- ``evaluation/avg@k``: mean over prompts of the mean return of the prompt's k samples;
- ``evaluation/pass@k``: mean over prompts of the best return of its k samples;
- ``evaluation/episode_return_mean``: mean return over all evaluation episodes (= avg@k when no
  sample was dropped), ``episode_len_mean``, ``num_episodes``, ``num_prompts``, ``num_skipped``;
- the same under ``evaluation/<split>/`` for each named split, and ``avg@k``, ``pass@k`` and
  ``num_prompts`` under ``evaluation/[<split>/]<datasource>/`` for each benchmark, read from the
  episode info field ``evaluation_datasource_key`` (e.g. ``data_source``); episodes without it
  count as ``unknown`` when others have it, and no per-benchmark key appears when none has it;
- what an agent did, from `flashrl.metrics.episodes` under the same prefixes: ``episode_turns_mean``
  (``_min``, ``_max``), ``episode_tokens_mean``, ``episode_generated_tokens_mean``,
  ``termination/<reason>`` and ``episode_info/<name>_mean`` (e.g. ``episode_info/tool_calls_mean``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flashrl.env_runners.spec import EnvRunnerSpec
from flashrl.env_runners.types import RunnerReport
from flashrl.episode import Episode
from flashrl.metrics.episodes import episode_metrics

UNKNOWN_DATASOURCE = "unknown"
"""Benchmark name of an episode without the datasource field (when other episodes have it)."""


class EvaluationSampler(Protocol):
    """What the protocol needs of the runners: `EnvRunnerGroup`'s on-demand sampling (blocking)."""

    def evaluation_size(self, split: str | None = None) -> int | None: ...

    def sample(
        self, indices: Sequence[int], *, group_size: int, evaluation: bool = False, split: str | None = None
    ) -> list[RunnerReport]: ...


@dataclass(frozen=True)
class EvaluationResult:
    """One evaluation: its metrics and, per split, the reports (every scored episode)."""

    metrics: dict[str, float]
    reports: dict[str | None, list[RunnerReport]]


def run_evaluation(sampler: EvaluationSampler, spec: EnvRunnerSpec, *, num_samples: int) -> EvaluationResult:
    """Play every split's evaluation prompts `num_samples` times each (k of avg@k) and score them.

    Per split, `num_prompts` prompts (indices ``0..n-1``: every task once of a finite list, at most
    `evaluation_num_episodes`), in the order of `evaluation_splits(spec)`.
    """
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise ValueError(
            "run_evaluation: expected num_samples (evaluation_num_samples_per_prompt) to be an integer "
            f">= 1, got {num_samples!r}."
        )
    reports: dict[str | None, list[RunnerReport]] = {}
    for split in evaluation_splits(spec):
        n = num_prompts(spec, sampler.evaluation_size(split))
        indices = list(range(n))
        reports[split] = list(sampler.sample(indices, group_size=num_samples, evaluation=True, split=split))
    key = spec.evaluation_datasource_key
    metrics = evaluation_metrics(reports, num_samples=num_samples, datasource_key=key)
    return EvaluationResult(metrics=metrics, reports=reports)


def evaluation_splits(spec: EnvRunnerSpec) -> dict[str | None, dict[str, Any]]:
    """Split name -> env_config of its evaluation env; ``{None: ...}`` when no split is named."""
    names = list(spec.evaluation_splits) or [None]
    return {name: split_env_config(spec, name) for name in names}


def split_env_config(spec: EnvRunnerSpec, split: str | None) -> dict[str, Any]:
    """``env_config | evaluation_env_config | evaluation_splits[split]`` (no split: the first two)."""
    overrides = spec.evaluation_splits[split] if split is not None else {}
    return {**spec.env_config, **spec.evaluation_env_config, **overrides}


def num_prompts(spec: EnvRunnerSpec, finite_size: int | None) -> int:
    """Prompts to evaluate: `evaluation_num_episodes`, at most every task once of a finite list."""
    n = int(spec.evaluation_num_episodes)
    return n if finite_size is None else max(1, min(n, int(finite_size)))


def evaluation_metrics(
    results: Mapping[str | None, Sequence[RunnerReport]],
    *,
    num_samples: int,
    datasource_key: str | None,
) -> dict[str, float]:
    """The evaluation metrics (see the module docstring) of each split's reports."""
    out: dict[str, float] = {}
    everything: list[tuple[Any, Episode]] = []
    skipped = 0
    for split, reports in results.items():
        # A prompt is (split, evaluation index): its k replicas; two indices may share a task.
        items = [((split, prompt_index(ep)), ep) for report in reports for ep in report.episodes]
        split_skipped = sum(sum(report.skipped.values()) for report in reports)
        everything += items
        skipped += split_skipped
        if split is not None:
            out.update(_split_metrics(f"evaluation/{split}/", items, split_skipped, num_samples, datasource_key))
    out.update(_split_metrics("evaluation/", everything, skipped, num_samples, datasource_key))
    return out


def _split_metrics(
    prefix: str, items: list[tuple[Any, Episode]], skipped: int, k: int, datasource_key: str | None
) -> dict[str, float]:
    out = {
        f"{prefix}episode_return_mean": _mean(ep.reward for _, ep in items),
        f"{prefix}episode_len_mean": _mean(len(ep.token_ids) for _, ep in items),
        f"{prefix}num_episodes": float(len(items)),
        f"{prefix}num_skipped": float(skipped),
    }
    out.update(_prompt_metrics(prefix, items, k))
    agent = episode_metrics([ep for _, ep in items])  # turns, tool calls, terminations (no per-source keys)
    out.update({prefix + key.removeprefix("env_runners/"): value for key, value in agent.items()})
    if datasource_key is not None and any(datasource_key in ep.info for _, ep in items):
        by_source: dict[str, list[tuple[Any, Episode]]] = defaultdict(list)
        for key, ep in items:
            by_source[str(ep.info.get(datasource_key, UNKNOWN_DATASOURCE))].append((key, ep))
        for source, group in sorted(by_source.items()):
            out.update(_prompt_metrics(f"{prefix}{source}/", group, k))
    return out


def _prompt_metrics(prefix: str, items: list[tuple[Any, Episode]], k: int) -> dict[str, float]:
    """avg@k, pass@k and the number of prompts of (prompt key, episode) pairs."""
    by_prompt: dict[Any, list[float]] = defaultdict(list)
    for key, ep in items:
        by_prompt[key].append(float(ep.reward))
    returns = list(by_prompt.values())
    return {
        f"{prefix}avg@{k}": _mean(sum(r) / len(r) for r in returns),
        f"{prefix}pass@{k}": _mean(max(r) for r in returns),
        f"{prefix}num_prompts": float(len(returns)),
    }


def prompt_index(episode: Episode) -> Any:
    """The evaluation index an episode answers (its prompt id when played outside `EnvRunner`)."""
    return episode.info.get("episode_index", episode.prompt_id)


def prompt_ids(reports: Iterable[RunnerReport]) -> list[tuple[int, int, str]]:
    """(index, replica, prompt_id) of every episode, sorted: what was scored, for comparisons."""
    return sorted(
        (int(ep.info["episode_index"]), int(ep.info["replica"]), ep.prompt_id)
        for report in reports
        for ep in report.episodes
    )


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else float("nan")
