"""Ray Tune: FlashReinforce is a Trainable; a 2x2 grid over delta and train_batch_size runs."""

from __future__ import annotations

import os

import pytest

from flashrl.algorithms import FlashReinforce

pytestmark = pytest.mark.ray


def test_tune_grid_over_delta_and_batch_size(ray_session, tiny_config, tmp_path):
    from ray import tune

    # 0.75 logical CPUs per trial: the four trials run at once on the 4-CPU test cluster.
    config = tiny_config(
        tensorboard=False, console_every=0, num_cpus_per_learner=0.25, num_cpus_per_env_runner=0.25
    )
    # RLlib style: the config itself is the param_space, with grid searches in its fields.
    config.training(delta=tune.grid_search([0.5, 1.0]), train_batch_size=tune.grid_search([2, 4]))
    bundles = FlashReinforce.default_resource_request(config.copy().training(delta=1.0, train_batch_size=2))
    assert bundles.bundles == [{"CPU": 0.5}, {"CPU": 0.25}]  # main + local learner, one env runner
    tuner = tune.Tuner(
        FlashReinforce,
        param_space=config,
        tune_config=tune.TuneConfig(max_concurrent_trials=4),
        run_config=tune.RunConfig(
            stop={"training_iteration": 1},
            storage_path=str(tmp_path),
            checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=True),
            verbose=0,
        ),
    )
    grid = tuner.fit()
    assert grid.num_errors == 0, [r.error for r in grid]
    assert len(grid) == 4
    seen = set()
    for result in grid:
        params = result.config
        metrics = result.metrics
        seen.add((params["delta"], params["train_batch_size"]))
        assert metrics["training_iteration"] == 1
        assert metrics["learners/version"] == 1
        assert metrics["learners/episodes"] == params["train_batch_size"]
        assert os.path.isdir(os.path.join(result.checkpoint.path, "policy"))
    assert seen == {(0.5, 2), (0.5, 4), (1.0, 2), (1.0, 4)}
