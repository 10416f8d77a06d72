"""`checkpoint_interval_minutes`: a periodic checkpoint after the first iteration that ends that long after
the run's start (or its last periodic save), besides `checkpoint_frequency`'s every N iterations."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.ray


def test_a_checkpoint_is_saved_once_the_interval_has_passed(ray_session, tiny_config, tmp_path):
    folder = tmp_path / "checkpoints"
    config = tiny_config(checkpoint_frequency=0, checkpoint_interval_minutes=60.0, checkpoint_dir=str(folder),
                         checkpoint_export_policy=False, tensorboard=False)
    algo = config.build_algo()
    try:
        algo.train()
        assert not folder.exists() or not os.listdir(folder)  # an hour has not passed
        algo.algo_config.checkpoint_interval_minutes = 1e-9  # now it has, at the end of the next iteration
        algo.train()
        assert sorted(name for name in os.listdir(folder) if name.startswith("checkpoint_")) == ["checkpoint_000002"]
        assert (folder / "latest").read_text(encoding="utf-8").strip() == "checkpoint_000002"
    finally:
        algo.stop()


def test_the_interval_must_be_positive(tiny_config):
    from flashrl.algorithms.flash_reinforce.config import ConfigError

    with pytest.raises(ConfigError, match="checkpoint_interval_minutes"):
        tiny_config(checkpoint_interval_minutes=0.0).validate()
