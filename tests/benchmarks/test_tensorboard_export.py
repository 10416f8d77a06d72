"""`benchmarks/tensorboard_export.py`: a committed report's runs as TensorBoard runs, stepped by rollouts."""

from __future__ import annotations

import json


def test_tensorboard_export_steps_by_rollouts(bench, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report = {
        "benchmark": "learning_efficiency",
        "runs": [
            {
                "method": "grpo",
                "seed": 1,
                "curve": [
                    {"update": 0, "rollouts": 0, "accuracy": 0.25},
                    {"update": 2, "rollouts": 32, "accuracy": 0.5},
                ],
                "updates": [
                    {
                        "update": 1,
                        "rollouts": 16,
                        "accepted_fraction": 1.0,
                        "drift_mean": None,
                        "policy_lag_hist": {},
                    },
                    {
                        "update": 2,
                        "rollouts": 32,
                        "accepted_fraction": 0.75,
                        "drift_mean": 0.01,
                        "policy_lag_hist": {},
                    },
                ],
            }
        ],
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    folders = bench("tensorboard_export").main([str(path), "--logdir", str(tmp_path / "tb")])
    assert folders == [str(tmp_path / "tb" / "learning_efficiency" / "grpo" / "seed1")]
    events = EventAccumulator(folders[0])
    events.Reload()
    accuracy = [(e.step, e.value) for e in events.Scalars("heldout/accuracy")]
    assert accuracy == [(0, 0.25), (32, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("train/accepted_fraction")] == [(16, 1.0), (32, 0.75)]
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("train/drift_mean")] == [(32, 0.01)]
    assert "train/policy_lag_hist" not in events.Tags()["scalars"]
