"""The one-line console progress summary of an iteration."""

from __future__ import annotations

from collections.abc import Mapping


def progress_line(iteration: int, metrics: Mapping[str, float]) -> str:
    """E.g. 'iter 12 | return 0.41 | accepted 0.97 | drift 3.1e-04 | lag 1.2 | idle 4% | 812 tok/s | 3.2 s'."""

    def get(key: str) -> float:
        value = metrics.get(key, float("nan"))
        return float(value) if isinstance(value, (int, float)) else float("nan")

    return (
        f"iter {iteration:>4d} | return {get('env_runners/episode_return_mean'):.3f}"
        f" | batch return {get('env_runners/batch_episode_return_mean'):.3f}"
        f" | accepted {get('learners/accepted_fraction'):.2f}"
        f" | drift {get('learners/drift_mean'):.1e}"
        f" | lag {get('env_runners/policy_lag_mean'):.2f}"
        f" | idle {100 * get('learners/idle_fraction'):.0f}%"
        f" | {get('env_runners/generated_tokens_per_s'):.0f} tok/s"
        f" | {get('timers/iteration_s'):.1f} s"
    )
