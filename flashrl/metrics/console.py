"""The console lines: an iteration's one-line summary, an evaluation's when it is taken, and on a terminal
the run's progress (updates done of the stop, elapsed, an estimate of the time left)."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from tqdm import tqdm

from flashrl.terminal_text import escape_terminal

TOOL_CALLS_KEY = "env_runners/episode_info/tool_calls_mean"
"""The tool-calls column of a multi-turn run (an env that reports ``info["tool_calls"]``)."""
EVALUATION_KEY = "evaluation/episode_return_mean"
"""The evaluation column of an iteration that took one."""


def _getter(metrics: Mapping[str, float]):
    def get(key: str) -> float:
        value = metrics.get(key, float("nan"))
        return float(value) if isinstance(value, (int, float)) else float("nan")

    return get


def progress_line(iteration: int, metrics: Mapping[str, float], *, multi_turn: bool = False) -> str:
    """E.g. 'iter 12 | return 0.41 | accepted 0.97 | drift 3.1e-04 | lag 1.2 | idle 4% | 812 tok/s | 3.2 s'.

    An evaluation taken in the iteration shows its return after the batch return (``| eval 0.359``).
    With ``multi_turn`` (the run has seen an episode of several model turns) the batch's mean turns
    per episode follow, and its mean tool calls when the env reports them. Episodes dropped in the
    iteration follow, by reason (`dropped_column`), when there were any.
    """
    get = _getter(metrics)
    evaluation = f" | eval {get(EVALUATION_KEY):.3f}" if EVALUATION_KEY in metrics else ""
    turns = ""
    if multi_turn:
        turns = f" | turns {get('env_runners/episode_turns_mean'):.2f}"
        if TOOL_CALLS_KEY in metrics:
            turns += f" | tool calls {get(TOOL_CALLS_KEY):.2f}"
    return (
        f"iter {iteration:>4d} | return {get('env_runners/episode_return_mean'):.3f}"
        f" | batch return {get('env_runners/batch_episode_return_mean'):.3f}"
        f"{evaluation}{turns}{dropped_column(metrics)}"
        f" | accepted {get('learners/accepted_fraction'):.2f}"
        f" | drift {get('learners/drift_mean'):.1e}"
        f" | lag {get('env_runners/policy_lag_mean'):.2f}"
        f" | idle {100 * get('learners/idle_fraction'):.0f}%"
        f" | {get('env_runners/generated_tokens_per_s'):.0f} tok/s"
        f" | {get('timers/iteration_s'):.1f} s"
    )


_DROPPED = re.compile(r"^env_runners/dropped/(\w+)$")


def dropped_column(metrics: Mapping[str, float]) -> str:
    """``" | dropped 3 (empty 2, env_error 1)"``: the iteration's dropped episodes by reason
    (``env_runners/dropped/<reason>``, the largest first); nothing when none was dropped."""
    drops = {}
    for key, value in metrics.items():
        match = _DROPPED.match(key)
        if match and isinstance(value, (int, float)) and value > 0:
            drops[match.group(1)] = int(value)
    if not drops:
        return ""
    parts = ", ".join(f"{reason} {count}" for reason, count in sorted(drops.items(), key=lambda kv: (-kv[1], kv[0])))
    return f" | dropped {sum(drops.values())} ({parts})"


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
    by_split = "".join(f" | {escape_terminal(name)} {get(f'evaluation/{name}/episode_return_mean'):.3f}"
                       for name in splits)  # a split's name is config text
    return (
        f"eval v{int(get('evaluation/learner_version')) if 'evaluation/learner_version' in metrics else '?'}"
        f" | return {get('evaluation/episode_return_mean'):.3f}{at_k}{by_split}"
        f" | {get('evaluation/num_prompts'):.0f} prompts, {get('evaluation/num_episodes'):.0f} episodes"
        f" | {get('timers/evaluation_s'):.1f} s"
    )


PROGRESS_FORMAT = "progress {n_fmt}/{total_fmt} updates |{bar:20}| {percentage:3.0f}% | {elapsed} elapsed | {remaining} left"
"""tqdm's ``bar_format`` of the progress line when the stop is known."""


def progress_text(done: int, stop: int | None, elapsed_s: float, *, initial: int = 0) -> str:
    """E.g. 'progress 13/40 updates |######5             |  32% | 02:45 elapsed | 24:45 left'.

    ``done`` updates of ``stop`` after ``elapsed_s`` seconds of this process's training, which began at
    update ``initial`` (a resumed run): the time left is the mean time per update done here times the
    updates still to do (tqdm's ``format_meter``). Without a known stop: done and elapsed only.
    """
    if stop is None:
        return f"progress {done} updates | {tqdm.format_interval(elapsed_s)} elapsed"
    return tqdm.format_meter(min(done, stop), stop, elapsed_s, bar_format=PROGRESS_FORMAT, initial=initial)


class RunProgress:
    """The progress line printed after each iteration line, on a terminal only (a log file keeps the lines).

    Args:
        stop: the update the run stops at (`train()`'s ``stop_iters``, else the schedule's
            ``total_updates``); None: unknown, no estimate.
        clock: seconds, monotonic (a fake one in tests).
        stream: where the lines go (default: ``sys.stdout``, read at each call).
    """

    def __init__(
        self, stop: int | None, *, clock: Callable[[], float] = time.monotonic, stream: TextIO | None = None
    ) -> None:
        self.stop = stop
        self._clock = clock
        self._stream = stream
        self._start: tuple[float, int] | None = None

    def start(self, done: int) -> None:
        """Mark the start of this process's training at ``done`` updates (once; later calls do nothing)."""
        if self._start is None:
            self._start = (self._clock(), int(done))

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def enabled(self) -> bool:
        """Only a terminal shows it: piped or redirected output keeps the one-line summaries alone."""
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def line(self, done: int) -> str:
        started, initial = self._start if self._start is not None else (self._clock(), int(done))
        return progress_text(int(done), self.stop, self._clock() - started, initial=initial)

    def show(self, done: int) -> None:
        """Print the progress line after ``done`` updates, if the stream is a terminal."""
        if self.enabled():
            print(self.line(done), file=self.stream, flush=True)
