"""Pure metric helpers, the TensorBoard writer, the console line and checkpoint folder checks."""

from __future__ import annotations

import json
import math
import os

import pytest

from flashrl.checkpoints import MARKER, CheckpointError, read_checkpoint, read_config
from flashrl.metrics import TensorBoardLogger, Window, lag_histogram, policy_lags, progress_line


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
    with pytest.raises(CheckpointError, match="checkpoint format 999, this flashrl reads format 1"):
        read_config(tmp_path)
    assert not os.path.exists(tmp_path / "config.json")
