"""The console lines: an iteration's one-line progress summary, and an evaluation's when it is taken."""

from __future__ import annotations

import re
from collections.abc import Mapping

TOOL_CALLS_KEY = "env_runners/episode_info/tool_calls_mean"
"""The tool-calls column of a multi-turn run (an env that reports ``info["tool_calls"]``)."""


def _getter(metrics: Mapping[str, float]):
    def get(key: str) -> float:
        value = metrics.get(key, float("nan"))
        return float(value) if isinstance(value, (int, float)) else float("nan")

    return get


def progress_line(iteration: int, metrics: Mapping[str, float], *, multi_turn: bool = False) -> str:
    """E.g. 'iter 12 | return 0.41 | accepted 0.97 | drift 3.1e-04 | lag 1.2 | idle 4% | 812 tok/s | 3.2 s'.

    With ``multi_turn`` (the run has seen an episode of several model turns) the batch's mean turns
    per episode follow the batch return, and its mean tool calls when the env reports them.
    """
    get = _getter(metrics)
    turns = ""
    if multi_turn:
        turns = f" | turns {get('env_runners/episode_turns_mean'):.2f}"
        if TOOL_CALLS_KEY in metrics:
            turns += f" | tool calls {get(TOOL_CALLS_KEY):.2f}"
    return (
        f"iter {iteration:>4d} | return {get('env_runners/episode_return_mean'):.3f}"
        f" | batch return {get('env_runners/batch_episode_return_mean'):.3f}"
        f"{turns}"
        f" | accepted {get('learners/accepted_fraction'):.2f}"
        f" | drift {get('learners/drift_mean'):.1e}"
        f" | lag {get('env_runners/policy_lag_mean'):.2f}"
        f" | idle {100 * get('learners/idle_fraction'):.0f}%"
        f" | {get('env_runners/generated_tokens_per_s'):.0f} tok/s"
        f" | {get('timers/iteration_s'):.1f} s"
    )


_AT_K = re.compile(r"^evaluation/((?:avg|pass)@\d+)$")


def evaluation_line(metrics: Mapping[str, float]) -> str:
    """E.g. 'eval v20 | return 0.412 | avg@4 0.412 | pass@4 0.625 | 32 prompts, 128 episodes | 9.8 s'.

    Named splits follow as ``| <split> <return>`` (their ``evaluation/<split>/episode_return_mean``).
    """
    get = _getter(metrics)
    at_k = "".join(f" | {m.group(1)} {get(key):.3f}" for key in metrics if (m := _AT_K.match(key)))
    splits = sorted(
        key.split("/")[1] for key in metrics
        if key.count("/") == 2 and key.endswith("/episode_return_mean") and key.startswith("evaluation/")
        and f"evaluation/{key.split('/')[1]}/num_episodes" in metrics
    )
    by_split = "".join(f" | {name} {get(f'evaluation/{name}/episode_return_mean'):.3f}" for name in splits)
    return (
        f"eval v{int(get('evaluation/learner_version')) if 'evaluation/learner_version' in metrics else '?'}"
        f" | return {get('evaluation/episode_return_mean'):.3f}{at_k}{by_split}"
        f" | {get('evaluation/num_prompts'):.0f} prompts, {get('evaluation/num_episodes'):.0f} episodes"
        f" | {get('timers/evaluation_s'):.1f} s"
    )
