"""Learner faults: a killed learner actor restarts the learner group from the run's newest checkpoint
(or its start), counted and bounded; with restarts off or used up the run stops naming the cause."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from flashrl.algorithms.flash_reinforce.config import ConfigError, FlashReinforceConfig
from flashrl.algorithms.flash_reinforce.learner_faults import LearnerRestarts
from flashrl.learners import LearnerGroupError

B = 4
CAUSE = "learner actor rank 0 died during 'update'"


# -- the books and the rules, without Ray -------------------------------------------------------------
def test_restarts_are_counted_up_to_the_limit_then_the_run_stops_with_the_cause():
    restarts = LearnerRestarts(restart=True, max_restarts=2)
    error = LearnerGroupError("boom")
    restarts.begin("rank 1 timed out", error)
    restarts.begin("rank 0 died", error)
    assert restarts.num_restarts == 2
    with pytest.raises(LearnerGroupError, match=r"failed: rank 0 died\. It was restarted 2 time\(s\) already "
                       r"\(max_num_learner_restarts=2\)") as info:
        restarts.begin("rank 0 died", error)
    assert info.value.__cause__ is error
    assert restarts.num_restarts == 2


def test_with_restarts_off_the_first_fault_stops_the_run():
    restarts = LearnerRestarts(restart=False, max_restarts=5)
    with pytest.raises(LearnerGroupError, match="failed: rank 0 died. restart_failed_learners=False"):
        restarts.begin("rank 0 died", LearnerGroupError("boom"))
    assert restarts.num_restarts == 0


def test_the_resume_point_and_the_books(tmp_path):
    restarts = LearnerRestarts(restart=True, max_restarts=1)
    assert restarts.resume_point() is None  # no checkpoint yet: the start
    restarts.checkpoint = str(tmp_path)
    assert restarts.resume_point() == str(tmp_path)
    restarts.checkpoint = str(tmp_path / "deleted")
    with pytest.raises(LearnerGroupError, match="that folder no longer exists"):
        restarts.resume_point()
    restarts.num_restarts, restarts.num_lost_updates = 1, 3
    assert restarts.metrics() == {"learners/num_restarts_lifetime": 1.0, "learners/num_lost_updates_lifetime": 3.0}
    other = LearnerRestarts(restart=True, max_restarts=1)
    other.set_state(restarts.state())
    assert (other.num_restarts, other.num_lost_updates) == (1, 3)
    other.set_state({})  # a checkpoint written before these books existed
    assert (other.num_restarts, other.num_lost_updates) == (0, 0)


def test_the_settings_are_checked():
    config = FlashReinforceConfig().learners(restart_failed_learners="yes", max_num_learner_restarts=-1)
    with pytest.raises(ConfigError) as info:
        config.validate()
    assert "restart_failed_learners: expected a bool, got 'yes'" in str(info.value)
    assert "max_num_learner_restarts: expected an integer >= 0, got -1" in str(info.value)


# -- the real path: Ray actors, the tiny model, the torch engine ----------------------------------------
@pytest.mark.ray
def test_a_killed_learner_restarts_from_the_newest_checkpoint_and_redoes_the_lost_update(
    ray_session, tiny_config, exact_sync_group, tmp_path, caplog
):
    """sync_group on CPU is exact: the update redone after the restart is the lost one, to the bit."""
    config = tiny_config(
        **exact_sync_group,
        num_learners=1,
        num_cpus_per_learner=0.5,
        checkpoint_frequency=2,
        checkpoint_dir=str(tmp_path / "checkpoints"),
    )
    algo = config.build_algo()
    try:
        for _ in range(3):
            lost = algo.train()
        lost_weights = algo.learner_group.get_weights()
        algo.learner_group.kill(0)  # between updates: the next call to the learners finds it dead
        with caplog.at_level(logging.WARNING, logger="flashrl"):
            redone = algo.train()
        redone_weights = algo.learner_group.get_weights()
        after = algo.train()
    finally:
        algo.stop()
    assert lost["learners/num_restarts_lifetime"] == 0
    # Resumed at checkpoint_000002 (version 2): the version numbering goes on from there.
    assert (redone["training_iteration"], redone["learners/version"]) == (3, 3)
    assert redone["learners/num_restarts_lifetime"] == 1
    assert redone["learners/num_lost_updates_lifetime"] == 1  # update 3 of the failed group
    assert redone["env_runners/policy_lag_max"] == 0  # the runners serve the restored version 2
    assert redone["learners/loss"] == lost["learners/loss"]
    for name, tensor in lost_weights.items():
        assert torch.equal(redone_weights[name], tensor), name
    assert (after["training_iteration"], after["learners/version"]) == (4, 4)
    assert after["learners/num_restarts_lifetime"] == 1
    restored = os.path.join(str(tmp_path / "checkpoints"), "checkpoint_000002")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(CAUSE in m and f"restarting it from {restored} (restart 1 of at most 3)" in m for m in warnings), warnings
    assert any("at version 2 (iteration 2); 1 update(s) lost" in m for m in warnings), warnings


@pytest.mark.ray
@pytest.mark.slow  # about 95 s on 2 shared cores; the restart from a checkpoint runs in the default suite
def test_before_any_checkpoint_a_restart_resumes_from_the_start_and_the_limit_stops_the_run(
    ray_session, tiny_config
):
    config = tiny_config(num_learners=1, num_cpus_per_learner=0.5, tensorboard=False, max_num_learner_restarts=1)
    algo = config.build_algo()
    try:
        algo.train()
        algo.train()
        algo.learner_group.kill(0)
        r = algo.train()
        # The initial weights, a fresh optimizer and the books at the start: iteration 1 again.
        assert (r["training_iteration"], r["learners/version"]) == (1, 1)
        assert r["learners/num_restarts_lifetime"] == 1
        assert r["learners/num_lost_updates_lifetime"] == 2
        assert r["env_runners/num_episodes_lifetime"] == B
        assert r["env_runners/policy_lag_max"] == 0  # runners restarted with the initial policy
        algo.learner_group.kill(0)
        with pytest.raises(LearnerGroupError, match=rf"(?s){CAUSE}.*restarted 1 time\(s\) already "
                           r"\(max_num_learner_restarts=1\), so the run stops here"):
            algo.train()
    finally:
        algo.stop()


@pytest.mark.ray
def test_with_restarts_off_a_killed_learner_stops_the_run_naming_the_cause(ray_session, tiny_config):
    config = tiny_config(num_learners=1, num_cpus_per_learner=0.5, tensorboard=False, restart_failed_learners=False)
    algo = config.build_algo()
    try:
        algo.train()
        algo.learner_group.kill(0)
        with pytest.raises(LearnerGroupError, match=rf"(?s){CAUSE}.*restart_failed_learners=False, so the run stops"):
            algo.train()
        assert algo.learner_group.failure.startswith(CAUSE)
    finally:
        algo.stop()


@pytest.mark.ray
@pytest.mark.slow  # two gloo ranks set up twice, sharded checkpoints: minutes on a shared 2-core host
def test_two_sharded_learners_restart_together_when_one_is_killed(ray_session, tiny_config, tmp_path):
    """One rank of two (gloo, FSDP2) dies: the group stops both, and a new pair resumes the checkpoint."""
    config = tiny_config(
        num_learners=2,
        num_cpus_per_learner=0.5,
        tensorboard=False,
        checkpoint_frequency=1,
        checkpoint_dir=str(tmp_path / "checkpoints"),
    )
    algo = config.build_algo()
    try:
        algo.train()
        algo.train()
        algo.learner_group.kill(1)
        r = algo.train()
        assert (r["training_iteration"], r["learners/version"]) == (3, 3)
        assert r["learners/num_restarts_lifetime"] == 1
        assert r["learners/num_lost_updates_lifetime"] == 0  # checkpoint_000002 had every update
        assert algo.learner_group.num_learners == 2 and algo.learner_group.failure is None
    finally:
        algo.stop()
