"""One timeline: a tuned example's progress.jsonl, curves and result.json follow the algorithm's
iteration through learner restarts and resumes, with no missing or doubled update whatever the kill point.

A fake algorithm (no Ray) stands in for `FlashReinforce` where the recipe loop is what is tested: it
counts iterations as `Trainable.train()` does, goes back to its newest checkpoint as a learner restart
does, and writes real checkpoint folders (`write_checkpoint`) recording each iteration's result as
`FlashReinforce._save` does. The real algorithm goes through the same loop in test_timeline_ray.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.algorithms.flash_reinforce.algorithm import RESULT_KEY
from flashrl.checkpoints import read_checkpoint, record_checkpoint, write_checkpoint
from flashrl.recipes import run as recipe_run
from flashrl.recipes.preset import NodePlan, Preset

PRESET = Preset(name="timeline", description="fake algorithm", success_metric="never/reached",
                success_threshold=float("inf"), stop_iters=5, node_plan=NodePlan(), needs_gpu=False)


class Killed(BaseException):
    """Stands in for SIGKILL: nothing of the recipe after the kill point runs (only `finally` blocks)."""


class FakeLearners:
    def __init__(self) -> None:
        self.version = 0

    def save_state(self, path: str) -> str:
        os.makedirs(path)
        Path(path, "learner_state.pt").write_bytes(b"state")
        return path


class FakeAlgo:
    """Trains `learners/version` = iteration; ``restart_at``: the call of `train()` (1-based, this process)
    that finds the learners dead and resumes from the newest checkpoint; ``kill_after_save``: the
    iteration whose periodic checkpoint is the last thing that happens (then `Killed`)."""

    def __init__(self, checkpoints: Path, *, restart_at: int | None = None, kill_after_save: int | None = None):
        self.iteration, self.calls, self.checkpoints = 0, 0, checkpoints
        self.restart_at, self.kill_after_save = restart_at, kill_after_save
        self.learner_group, self.newest = FakeLearners(), None
        self.progress = type("Progress", (), {"stop": None})()
        self.total_updates = 100

    def train(self) -> dict[str, Any]:
        self.calls += 1
        if self.calls == self.restart_at:  # the learner group died: back to the newest checkpoint
            self.restore_from_path(self.newest)
        iteration = self.iteration + 1
        result = {"learners/version": float(iteration), "learners/loss": 1.0 / iteration, "done": False}
        if iteration % 2 == 0:  # checkpoint_frequency=2, inside the iteration as FlashReinforce._report does
            self.learner_group.version = iteration
            path = str(self.checkpoints / f"checkpoint_{iteration:06d}")
            write_checkpoint(path, config={}, learner_group=self.learner_group,
                             algorithm_state={"iteration": iteration, RESULT_KEY: dict(result)}, export_policy=False)
            record_checkpoint(self.checkpoints, path)
            self.newest = path
            if iteration == self.kill_after_save:
                raise Killed
        self.iteration = iteration
        self.learner_group.version = iteration
        return {**result, "training_iteration": iteration}

    def restore_from_path(self, path: str) -> None:
        self.iteration = int(read_checkpoint(path).algorithm_state["iteration"])
        self.learner_group.version = self.iteration
        self.newest = path

    def save_to_path(self, path: str) -> str:
        return path

    def stop(self) -> None:
        pass


def _train(monkeypatch, tmp_path: Path, algo: FakeAlgo, stop_iters: int, resume: str | None = None):
    config = FlashReinforceConfig().checkpointing(checkpoint_frequency=2, checkpoint_dir=str(algo.checkpoints))
    config.tensorboard = False
    monkeypatch.setattr(FlashReinforceConfig, "build_algo", lambda self: algo)
    monkeypatch.setattr(recipe_run, "start_memory_warning", lambda config: None)
    return recipe_run.train(config, PRESET, stop_iters=stop_iters, stop_reward=float("inf"),
                            output=str(tmp_path / "run"), resume=resume)


def _rows(tmp_path: Path, name: str = "progress.jsonl") -> list[dict[str, float]]:
    return [json.loads(line) for line in (tmp_path / "run" / name).read_text(encoding="utf-8").splitlines()]


def _labels(rows: list[dict[str, float]]) -> list[tuple[float, float]]:
    """(label, the algorithm's real iteration) of every training row."""
    return [(r["training_iteration"], r["learners/version"]) for r in rows if "learners/version" in r]


def test_a_learner_restart_rewinds_the_rows_and_redoes_the_lost_updates(monkeypatch, tmp_path):
    # Checkpoint at 2; the 4th call finds the learners dead: iteration 3 is lost and trained again.
    algo = FakeAlgo(tmp_path / "checkpoints", restart_at=4)
    summary = _train(monkeypatch, tmp_path, algo, stop_iters=5)
    rows = _rows(tmp_path)
    assert _labels(rows) == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]
    assert rows[2] == {"learners_restarted_from_iteration": 2.0}
    assert summary.iterations == 5 and algo.iteration == 5  # the lost update does not cut the run short
    discarded = _rows(tmp_path, "progress.discarded.jsonl")
    assert discarded[0] == {"discarded_by_resume_from_iteration": 2.0}
    assert _labels(discarded) == [(3, 3)]  # the abandoned iteration, kept aside
    result = json.loads((tmp_path / "run" / "result.json").read_text(encoding="utf-8"))
    assert result["iterations"] == 5


def test_a_kill_after_the_checkpoint_before_the_row_loses_no_row(monkeypatch, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(Killed):
        _train(monkeypatch, tmp_path, FakeAlgo(checkpoints, kill_after_save=2), stop_iters=5)
    assert _labels(_rows(tmp_path)) == [(1, 1)]  # the checkpoint at 2 is saved, its row never written

    resumed = FakeAlgo(checkpoints)
    summary = _train(monkeypatch, tmp_path, resumed, stop_iters=4, resume=str(checkpoints / "checkpoint_000002"))
    rows = _rows(tmp_path)
    assert _labels(rows) == [(1, 1), (2, 2), (3, 3), (4, 4)]
    assert rows[1] == {"learners/version": 2.0, "learners/loss": 0.5, "training_iteration": 2.0}  # as recorded
    assert rows[2] == {"resumed_from_iteration": 2.0}
    assert summary.iterations == 4


def test_a_resume_after_the_row_was_written_doubles_nothing(monkeypatch, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(Killed):  # killed at the checkpoint at 4, after rows 1-3 (3 past the checkpoint at 2)
        _train(monkeypatch, tmp_path, FakeAlgo(checkpoints, kill_after_save=4), stop_iters=5)
    _train(monkeypatch, tmp_path, FakeAlgo(checkpoints), stop_iters=5, resume=str(checkpoints / "checkpoint_000002"))
    assert _labels(_rows(tmp_path)) == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]


def test_resume_removes_an_interrupted_save_of_its_own_before_the_run_needs_the_space(monkeypatch, tmp_path):
    """A save killed mid-write (or refused by a full disk before this fix) leaves `checkpoint_<N>.tmp`; the
    resumed run removes it before it builds anything, and leaves a folder flashrl did not write."""
    from flashrl.checkpoints import SAVE_MARKER

    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(Killed):
        _train(monkeypatch, tmp_path, FakeAlgo(checkpoints, kill_after_save=2), stop_iters=5)
    partial = checkpoints / "checkpoint_000004.tmp"
    partial.mkdir()
    (partial / SAVE_MARKER).touch()
    (partial / "learner_state.pt").write_bytes(b"x" * 4096)
    final = tmp_path / "run" / "checkpoint_final.tmp"
    final.mkdir()
    (final / SAVE_MARKER).touch()
    foreign = checkpoints / "checkpoint_000006.tmp"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("not flashrl's", encoding="utf-8")
    seen = []
    algo = FakeAlgo(checkpoints)
    original = algo.restore_from_path

    def restore(path: str) -> None:  # what the resumed run finds when it starts loading
        seen.append((partial.exists(), final.exists(), foreign.exists()))
        original(path)

    algo.restore_from_path = restore
    _train(monkeypatch, tmp_path, algo, stop_iters=3, resume=str(checkpoints / "checkpoint_000002"))
    assert seen == [(False, False, True)]
