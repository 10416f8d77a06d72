"""A save the disk refuses (ENOSPC, EIO, EACCES, or torch's ``unexpected pos``): one error naming the path,
the free space and the checkpoint's size, the partial ``.tmp`` removed, the previous checkpoint intact; the
periodic save logs it, trains on, retries at the next interval and stops the run only after
``max_failed_checkpoints`` failures in a row. A full disk cannot be made here without root (no mounts), so
the failure is injected in the write path, where the learner writes its state."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.algorithms.flash_reinforce.algorithm import FlashReinforce
from flashrl.algorithms.flash_reinforce.learner_faults import LearnerRestarts
from flashrl.checkpoints import (
    SAVE_MARKER,
    CheckpointSaveError,
    latest_checkpoint,
    read_checkpoint,
    remove_interrupted_saves,
    write_checkpoint,
)

PARTIAL = 50_000
"""Bytes the learner writes before the disk refuses the rest."""


class Learners:
    """Writes ``learner_state.pt``; each call listed in ``fail`` (1-based) dies after PARTIAL bytes with ``error``."""

    def __init__(self, fail: set[int] = frozenset(), error: BaseException | None = None) -> None:
        self.fail, self.error, self.calls, self.num_learners, self.version = fail, error, 0, 1, 0

    def save_state(self, path: str) -> str:
        self.calls += 1
        os.makedirs(path)
        with open(os.path.join(path, "learner_state.pt"), "wb") as f:
            f.write(b"x" * PARTIAL)
            if self.calls in self.fail:
                raise self.error or OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            f.write(b"y" * 1000)
        return path

    def save_policy(self, path: str) -> str:
        os.makedirs(path)
        return path


def _save(path: Path, learners: Learners, iteration: int = 1) -> str:
    return write_checkpoint(path, config={}, learner_group=learners, algorithm_state={"iteration": iteration},
                            export_policy=False)


def test_enospc_names_path_free_space_and_size_and_leaves_no_partial_save(tmp_path):
    learners = Learners(fail={2})
    previous = _save(tmp_path / "checkpoint_000001", learners)
    target = tmp_path / "checkpoint_000002"
    with pytest.raises(CheckpointSaveError) as info:
        _save(target, learners, iteration=2)
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert f"Saving the checkpoint {target} failed: No space left on device." in message
    free = shutil.disk_usage(tmp_path).free
    reported = int(message.split("Free space on its disk: ")[1].split(" GiB (")[1].split(" bytes")[0])
    assert abs(reported - free) < 2**26  # this disk's free space, give or take what others write meanwhile
    size = PARTIAL + 1000 + sum(os.path.getsize(os.path.join(previous, n)) for n in ("config.json", "algorithm_state.json"))
    assert f"the previous checkpoint is {size / 2**30:.2f} GiB ({size} bytes)" in message
    assert "The partial checkpoint_000002.tmp was removed. Fix: free space there, or set checkpoint_dir" in message
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_000001"]  # no .tmp, nothing at the target
    assert read_checkpoint(previous).algorithm_state == {"iteration": 1}


def test_torch_s_unexpected_pos_is_the_same_clear_error(tmp_path):
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 4011")
    with pytest.raises(CheckpointSaveError) as info:
        _save(tmp_path / "checkpoint_000001", Learners(fail={1}, error=error))
    message = str(info.value)
    assert "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 4011" in message
    assert f"this save had written {PARTIAL / 2**30:.2f} GiB ({PARTIAL} bytes) before it failed" in message
    assert os.listdir(tmp_path) == []


def test_a_permission_error_says_to_make_the_folder_writable(tmp_path):
    with pytest.raises(CheckpointSaveError, match="Permission denied.*make the folder writable") as info:
        _save(tmp_path / "checkpoint_000001", Learners(fail={1}, error=PermissionError(errno.EACCES, "Permission denied")))
    assert info.value.errno == errno.EACCES and os.listdir(tmp_path) == []


def test_an_error_that_is_not_the_disk_s_is_raised_as_it_is(tmp_path):
    with pytest.raises(KeyError):
        _save(tmp_path / "checkpoint_000001", Learners(fail={1}, error=KeyError("a bug, not a disk")))


def test_interrupted_saves_of_flashrl_are_removed_and_foreign_folders_stay(tmp_path):
    ours = tmp_path / "checkpoint_000004.tmp"
    ours.mkdir()
    (ours / SAVE_MARKER).touch()
    (ours / "learner_state.pt").write_bytes(b"x" * 1000)
    foreign = tmp_path / "checkpoint_000006.tmp"  # no marker: not flashrl's
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine", encoding="utf-8")
    assert remove_interrupted_saves(tmp_path) == ["checkpoint_000004.tmp"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_000006.tmp"]


# -- the periodic save: trains on, retries, stops after max_failed_checkpoints in a row ----------------------
def _algo(tmp_path: Path, learners: Learners, max_failed: int) -> FlashReinforce:
    """The parts of FlashReinforce its periodic save uses (no Ray, no model)."""
    algo = FlashReinforce.__new__(FlashReinforce)
    algo.algo_config = FlashReinforceConfig().checkpointing(
        checkpoint_frequency=1, checkpoint_dir=str(tmp_path), max_failed_checkpoints=max_failed
    )
    algo.learner_group = learners
    algo.stream = SimpleNamespace(state=lambda: {"sync_cursor": 0, "runner_cursors": []})
    algo._learner_restarts = LearnerRestarts(restart=True, max_restarts=3)
    algo._last_periodic_save, algo._failed_saves = 0.0, 0
    return algo


def test_a_failed_periodic_save_is_logged_and_retried_and_the_limit_stops_the_run(tmp_path, caplog):
    algo = _algo(tmp_path, Learners(fail={2, 3}), max_failed=2)
    with caplog.at_level(logging.ERROR, logger="flashrl"):
        algo._periodic_checkpoint(1, {"learners/loss": 0.5})
        algo._periodic_checkpoint(2, {})  # fails: training goes on
        assert algo._failed_saves == 1 and latest_checkpoint(tmp_path).endswith("checkpoint_000001")
        with pytest.raises(CheckpointSaveError, match="2 periodic saves in a row failed"):
            algo._periodic_checkpoint(3, {})  # fails again: the second in a row stops the run
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "checkpoint_000002 failed: No space left on device" in errors[0]
    assert "Training goes on; the next periodic save retries (1 of 2 failed in a row)." in errors[0]


def test_the_limit_counts_failures_in_a_row_only(tmp_path):
    algo = _algo(tmp_path, Learners(fail={2, 4, 5}), max_failed=2)
    algo._periodic_checkpoint(1, {})
    algo._periodic_checkpoint(2, {})  # fails
    algo._periodic_checkpoint(3, {})  # saves: the count starts over
    assert algo._failed_saves == 0 and latest_checkpoint(tmp_path).endswith("checkpoint_000003")
    algo._periodic_checkpoint(4, {})  # fails
    with pytest.raises(CheckpointSaveError, match=r"2 periodic saves in a row failed \(max_failed_checkpoints=2\), "
                       "so the run stops here"):
        algo._periodic_checkpoint(5, {})
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_000001", "checkpoint_000003", "latest"]


def test_the_periodic_checkpoint_records_its_iteration_s_result(tmp_path):
    algo = _algo(tmp_path, Learners(), max_failed=1)
    algo._periodic_checkpoint(1, {"learners/loss": 0.5, "learners/version": 1, "note": "text", "done": False})
    state = read_checkpoint(tmp_path / "checkpoint_000001").algorithm_state
    assert state["result"] == {"learners/loss": 0.5, "learners/version": 1.0}  # the numbers, as a row has them
