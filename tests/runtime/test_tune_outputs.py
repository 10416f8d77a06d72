"""Under Ray Tune with a local storage_path, flashrl's own outputs of a trial (progress files) sit in the
trial's folder there, beside Tune's result.json, not in the working folder Ray keeps in its session."""

from __future__ import annotations

import json
import os

import pytest

from flashrl.algorithms import FlashReinforce

pytestmark = pytest.mark.ray


def test_a_trials_progress_files_sit_beside_tunes_result_json(ray_session, tiny_config, tmp_path):
    from ray import tune

    config = tiny_config(tensorboard=False, console_every=0, num_cpus_per_learner=0.25,
                         num_cpus_per_env_runner=0.25)
    config.training(delta=tune.grid_search([0.5, 1.0]))
    grid = tune.Tuner(
        FlashReinforce,
        param_space=config,
        tune_config=tune.TuneConfig(max_concurrent_trials=2),
        run_config=tune.RunConfig(stop={"training_iteration": 1}, storage_path=str(tmp_path), verbose=0),
    ).fit()
    assert grid.num_errors == 0, [r.error for r in grid]
    for result in grid:
        trial = result.path
        assert trial.startswith(str(tmp_path)) and os.path.isfile(os.path.join(trial, "result.json"))
        with open(os.path.join(trial, "results", "progress.jsonl"), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        assert [row["training_iteration"] for row in rows] == [1.0]
        assert os.path.isfile(os.path.join(trial, "results", "progress.csv"))
