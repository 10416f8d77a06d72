"""Metric helpers, an iteration's metrics by hand, TensorBoard, the console line, checkpoint folder checks."""

from __future__ import annotations

import json
import math
import os

import pytest

from flashrl.checkpoints import MARKER, CheckpointError, read_checkpoint, read_config
from flashrl.episode import Episode
from flashrl.metrics import (
    LAG_BUCKETS,
    IterationMetrics,
    IterationTimes,
    StreamCounts,
    TensorBoardLogger,
    Window,
    iteration_histograms,
    lag_histogram,
    policy_lags,
    progress_line,
)


def test_policy_lags_and_histogram_by_hand():
    lags = policy_lags(5, [5, 4, 4, 1, None, 0])
    assert lags == [0, 1, 1, 4, 0, 5]
    assert lag_histogram(lags) == {"0": 2 / 6, "1": 2 / 6, "2": 0.0, "3": 0.0, "4+": 2 / 6}
    assert lag_histogram([]) == {"0": 0.0, "1": 0.0, "2": 0.0, "3": 0.0, "4+": 0.0}


def test_window_keeps_the_last_values():
    window = Window(3)
    assert math.isnan(window.mean())
    window.extend([1.0, 2.0, 3.0, 10.0])
    assert len(window) == 3
    assert window.mean() == pytest.approx(5.0)


def test_progress_line_formats_the_key_metrics():
    line = progress_line(
        7,
        {
            "env_runners/episode_return_mean": 0.5,
            "env_runners/batch_episode_return_mean": 0.25,
            "learners/accepted_fraction": 0.875,
            "learners/drift_mean": 0.00031,
            "env_runners/policy_lag_mean": 1.5,
            "learners/idle_fraction": 0.04,
            "env_runners/generated_tokens_per_s": 812.4,
            "timers/iteration_s": 3.21,
        },
    )
    assert line == (
        "iter    7 | return 0.500 | batch return 0.250 | accepted 0.88 | drift 3.1e-04 | lag 1.50 | "
        "idle 4% | 812 tok/s | 3.2 s"
    )


def test_tensorboard_writes_scalars_and_histograms(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path)
    logger.log(1, {"a/b": 1.5, "skip/nan": float("nan"), "skip/text": "x"}, {"hist/lag": [0, 1, 1, 3]})
    logger.log(2, {"a/b": 2.5}, {"hist/lag": []})
    logger.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("a/b")] == [(1, 1.5), (2, 2.5)]
    assert acc.Tags()["scalars"] == ["a/b"]
    (hist,) = acc.Histograms("hist/lag")
    assert (hist.step, hist.histogram_value.num, hist.histogram_value.sum) == (1, 4.0, 5.0)


def test_a_folder_without_the_marker_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="is not a flashrl checkpoint: expected a file"):
        read_checkpoint(tmp_path)
    (tmp_path / MARKER).write_text(json.dumps({"format_version": 999}))
    with pytest.raises(CheckpointError, match="checkpoint format 999, this flashrl reads format 2"):
        read_config(tmp_path)
    assert not os.path.exists(tmp_path / "config.json")


def _episode(prompt: str, reward: float, length: int, version: int) -> Episode:
    return Episode(prompt, [1] * length, [False] + [True] * (length - 1), [0.0] * length, reward=reward,
                   policy_versions=[version])


def _counts(**books) -> StreamCounts:
    values = {"episodes": 0, "generated_tokens": 0, "env_steps": 0, "skipped": {"stale": 0}, "lost": 0,
              "restarts": 0, "started": 0, "in_flight": 0, "pending": 0}
    return StreamCounts(**{**values, **books})


def test_iteration_metrics_by_hand():
    metrics = IterationMetrics(smoothing_window=3, max_lag=None, token_rate_window=2)
    times = IterationTimes(sample_wait=1.0, learner_update=0.5, weight_sync=0.25, iteration=4.0)
    first = metrics.update(
        [_episode("a", 1.0, 4, 0), _episode("b", 0.0, 2, 0)], lags=[0, 2], generated_tokens=40,
        counts=_counts(episodes=2, skipped={"stale": 1, "empty": 0}, started=9, pending=1, lost=3),
        learner_version=1, learner_metrics={"loss": -0.5, "drift_values": [0.1, 0.2]}, times=times,
    )
    assert first["env_runners/episode_return_mean"] == 0.5 and first["env_runners/episode_len_mean"] == 3.0
    assert first["env_runners/batch_episode_return_max"] == 1.0
    assert first["env_runners/batch_episode_return_min"] == 0.0
    assert first["env_runners/batch_num_distinct_prompts"] == 2.0
    assert (first["env_runners/policy_lag_mean"], first["env_runners/policy_lag_max"]) == (1.0, 2.0)
    assert first["env_runners/generated_tokens_per_s"] == 10.0  # 40 tokens / 4 s
    assert first["env_runners/num_skipped_stale_lifetime"] == 1.0
    assert first["env_runners/num_skipped_empty_lifetime"] == 0.0
    assert first["env_runners/num_started_lifetime"] == 9.0
    assert first["env_runners/num_pending_episodes"] == 1.0
    assert first["env_runners/num_lost_episodes_lifetime"] == 3.0
    assert (first["learners/idle_fraction"], first["learners/trajectories_per_s"]) == (0.25, 0.5)
    assert first["learners/loss"] == -0.5 and "learners/drift_values" not in first  # lists go to histograms
    assert first["learners/version"] == 1.0 and first["num_episodes"] == 2
    hist = [first[f"env_runners/policy_lag_hist/{k}"] for k in ("0", "1", "2", "3", "4+")]
    assert hist == [0.5, 0.0, 0.5, 0.0, 0.0]
    # The windows: returns over the last 3 episodes, tokens/s over the last 2 iterations.
    second = metrics.update(
        [_episode("c", 0.5, 6, 1), _episode("d", 0.5, 6, 1)], lags=[0, 0], generated_tokens=0,
        counts=_counts(), learner_version=2, learner_metrics={}, times=IterationTimes(0.0, 0.5, 0.25, 1.0),
    )
    assert second["env_runners/episode_return_mean"] == pytest.approx((0.0 + 0.5 + 0.5) / 3)
    assert second["env_runners/episode_len_mean"] == pytest.approx((2 + 6 + 6) / 3)
    assert second["env_runners/generated_tokens_per_s"] == 8.0  # (40 + 0) tokens / (4 + 1) s
    with pytest.raises(ValueError, match="expected the episodes of a batch, got none"):
        metrics.update([], lags=[], generated_tokens=0, counts=_counts(), learner_version=2,
                       learner_metrics={}, times=times)


def test_each_iteration_reports_its_own_drops_by_reason():
    # Before: lifetime counts only, so a run's dropped episodes per update had to be differenced by hand.
    metrics = IterationMetrics(smoothing_window=3)
    times = IterationTimes(sample_wait=1.0, learner_update=0.5, weight_sync=0.25, iteration=4.0)
    drops = [{"empty": 3, "env_error": 0}, {"empty": 3, "env_error": 2}]
    got = [
        metrics.update([_episode("a", 1.0, 4, 0)], lags=[0], generated_tokens=0, counts=_counts(skipped=skipped),
                       learner_version=1, learner_metrics={}, times=times)
        for skipped in drops
    ]
    assert [(m["env_runners/dropped/empty"], m["env_runners/dropped/env_error"]) for m in got] == [
        (3.0, 0.0), (0.0, 2.0)]
    assert got[1]["env_runners/num_skipped_empty_lifetime"] == 3.0


def test_the_lag_histogram_has_a_bucket_for_every_allowed_lag():
    assert IterationMetrics(smoothing_window=1).lag_buckets == LAG_BUCKETS
    assert IterationMetrics(smoothing_window=1, max_lag=2).lag_buckets == LAG_BUCKETS
    assert IterationMetrics(smoothing_window=1, max_lag=6).lag_buckets == 7
    hists = iteration_histograms([_episode("a", 1.0, 3, 0)], [4], {"drift_values": [0.5]})
    assert hists == {"hist/episode_len": [3], "hist/generated_len": [2], "hist/policy_lag": [4],
                     "hist/episode_return": [1.0], "hist/drift": [0.5]}
