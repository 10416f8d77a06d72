"""The console: the progress line (done of the stop, elapsed, time left), its terminal switch, and the
evaluation figure in the iteration line."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from flashrl.algorithms.flash_reinforce.algorithm import FlashReinforce
from flashrl.metrics.console import RunProgress, progress_line, progress_text


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# 3 updates in 165 s: 55 s each, 37 left -> 2035 s = 33:55; the bar is 3/40 of 20 cells = 1.5 cells.
@pytest.mark.parametrize(
    ("done", "stop", "elapsed", "initial", "expected"),
    [
        (3, 40, 165.0, 0, "progress 3/40 updates |█▌                  |   8% | 02:45 elapsed | 33:55 left"),
        # resumed at update 10: 3 updates done here in 165 s, 27 left x 55 s = 1485 s = 24:45
        (13, 40, 165.0, 10, "progress 13/40 updates |██████▌             |  32% | 02:45 elapsed | 24:45 left"),
        # past an hour: 40 updates in 4000 s, 100 s each, 20 left = 2000 s
        (40, 60, 4000.0, 0, "progress 40/60 updates |█████████████▎      |  67% | 1:06:40 elapsed | 33:20 left"),
        (40, 40, 2000.0, 0, "progress 40/40 updates |████████████████████| 100% | 33:20 elapsed | 00:00 left"),
        (7, None, 125.0, 0, "progress 7 updates | 02:05 elapsed"),
    ],
)
def test_progress_text(done, stop, elapsed, initial, expected):
    assert progress_text(done, stop, elapsed, initial=initial) == expected


def test_run_progress_counts_from_its_start_on_a_fake_clock():
    clock = FakeClock(1000.0)
    progress = RunProgress(40, clock=clock, stream=Terminal())
    progress.start(10)  # a run resumed at update 10
    clock.now = 1100.0
    progress.start(12)  # later calls keep the first start
    clock.now = 1165.0
    assert progress.line(13) == "progress 13/40 updates |██████▌             |  32% | 02:45 elapsed | 24:45 left"


def test_run_progress_shows_on_a_terminal_only():
    clock = FakeClock(0.0)
    terminal, piped = Terminal(), io.StringIO()
    for stream in (terminal, piped):
        progress = RunProgress(4, clock=clock, stream=stream)
        progress.start(0)
        clock.now = 30.0
        progress.show(1)
        clock.now = 0.0
    assert terminal.getvalue() == "progress 1/4 updates |█████               |  25% | 00:30 elapsed | 01:30 left\n"
    assert piped.getvalue() == ""


METRICS = {
    "env_runners/episode_return_mean": 0.25,
    "env_runners/batch_episode_return_mean": 0.3125,
    "learners/accepted_fraction": 1.0,
    "learners/drift_mean": 0.0123,
    "env_runners/policy_lag_mean": 0.5,
    "learners/idle_fraction": 0.04,
    "env_runners/generated_tokens_per_s": 34.4,
    "timers/iteration_s": 55.26,
}


def test_iteration_line_shows_the_evaluation_taken_in_it():
    line = progress_line(10, {**METRICS, "evaluation/episode_return_mean": 0.359375})
    assert line == (
        "iter   10 | return 0.250 | batch return 0.312 | eval 0.359 | accepted 1.00 | drift 1.2e-02 | lag 0.50"
        " | idle 4% | 34 tok/s | 55.3 s"
    )
    assert " eval " not in progress_line(11, METRICS)  # no evaluation in that iteration: no column


def test_iteration_line_shows_the_episodes_dropped_in_it_by_reason():
    # Before: no drop column; an agent that never called the model left no trace on the console.
    drops = {"env_runners/dropped/empty": 3.0, "env_runners/dropped/env_error": 1.0,
             "env_runners/dropped/stale": 0.0, "env_runners/num_skipped_empty_lifetime": 40.0}
    line = progress_line(12, {**METRICS, **drops})
    assert " | batch return 0.312 | dropped 4 (empty 3, env_error 1) | accepted 1.00" in line
    assert "dropped" not in progress_line(13, {**METRICS, "env_runners/dropped/empty": 0.0})


def _reporting_algorithm(stream) -> SimpleNamespace:
    clock = FakeClock(0.0)
    progress = RunProgress(40, clock=clock, stream=stream)
    progress.start(0)
    clock.now = 110.0
    return SimpleNamespace(
        algo_config=SimpleNamespace(console_every=1, rollout_dump_every=0, checkpoint_frequency=0,
                                    checkpoint_interval_minutes=None),
        iteration=1,
        _loggers=[],
        iteration_metrics=SimpleNamespace(multi_turn=False),
        progress=progress,
    )


def test_the_algorithm_prints_the_progress_line_after_the_iteration_line(capsys):
    terminal = Terminal()
    FlashReinforce._report(_reporting_algorithm(terminal), dict(METRICS), [], [], {})
    assert capsys.readouterr().out.startswith("iter    2 | return 0.250")
    # 2 updates in 110 s: 55 s each, 38 left = 2090 s; 2/40 of 20 cells = 1 cell
    assert terminal.getvalue() == "progress 2/40 updates |█                   |   5% | 01:50 elapsed | 34:50 left\n"
