"""Checkpoints are atomic and verified: kill -9 at random points never leaves a mix or loses the last one.

The crash test runs this file as a script: one process loads a real ``Learner`` of a tiny model once,
then, round after round, forks a writer that saves checkpoints in a loop (``write_checkpoint`` +
``record_checkpoint``, policy export included, sometimes over an existing checkpoint as a resume
from an older one does) and kills it with SIGKILL after a random delay. After every kill it checks
the folder: ``latest`` names a checkpoint that verifies against its manifest and never goes back,
every complete checkpoint is one save (its learner state, policy and algorithm state carry the same
token), and the leftovers of the interrupted save are not taken for checkpoints.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flashrl.checkpoints import (
    ALGORITHM_STATE_FILE,
    CONFIG_FILE,
    FORMAT_VERSION,
    LATEST_FILE,
    MARKER,
    CheckpointError,
    latest_checkpoint,
    read_checkpoint,
    read_config,
    record_checkpoint,
    write_checkpoint,
)

ROUNDS = 24
NORM = "model.norm.weight"


class _FileGroup:
    """What write_checkpoint needs of a learner group, for the folder-level tests: one real state file."""

    num_learners = 0

    def __init__(self, value: float) -> None:
        self.value = value

    def save_state(self, path: str) -> str:
        os.makedirs(path)
        torch.save({"w": torch.full((1000,), self.value)}, os.path.join(path, "learner_state.pt"))
        return path

    def save_policy(self, path: str) -> str:
        os.makedirs(path)
        Path(path, "config.json").write_text("{}")
        return path


def _write(path: Path, value: float, iteration: int = 1, **kwargs) -> str:
    return write_checkpoint(path, config={"v": value}, learner_group=_FileGroup(value),
                            algorithm_state={"iteration": iteration}, **kwargs)


def test_the_manifest_lists_every_file_and_the_tmp_folder_is_gone(tmp_path: Path) -> None:
    path = Path(_write(tmp_path / "ckpt", 1.0))
    manifest = json.loads((path / MARKER).read_text())
    assert manifest["format_version"] == FORMAT_VERSION == 2
    assert sorted(manifest["files"]) == [ALGORITHM_STATE_FILE, CONFIG_FILE, "learner/learner_state.pt",
                                         "policy/config.json"]
    size = (path / "learner" / "learner_state.pt").stat().st_size
    assert manifest["files"]["learner/learner_state.pt"]["size"] == size
    assert manifest["learner_layout"] == "single_file" and manifest["policy"] is True
    assert not (tmp_path / "ckpt.tmp").exists()
    no_policy = Path(_write(tmp_path / "lean", 1.0, export_policy=False))
    assert not (no_policy / "policy").exists()
    assert read_checkpoint(no_policy).manifest["policy"] is False


def test_a_truncated_or_altered_file_is_a_checkpoint_error_naming_it(tmp_path: Path) -> None:
    path = Path(_write(tmp_path / "ckpt", 1.0))
    state = path / "learner" / "learner_state.pt"
    data = state.read_bytes()
    state.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"learner_state\.pt: \d+ bytes, the manifest says \d+ \(truncated"):
        read_checkpoint(path)
    flipped = bytearray(data)
    flipped[-10] ^= 0xFF
    state.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=r"learner_state\.pt: SHA-256 [0-9a-f]{64}, the manifest says"):
        read_checkpoint(path)
    state.unlink()
    with pytest.raises(CheckpointError, match=r"learner_state\.pt: missing; the manifest lists it"):
        read_checkpoint(path)
    (path / CONFIG_FILE).write_text('{"v": 2.0}')  # read_config checks its one file too
    with pytest.raises(CheckpointError, match=r"config\.json: \d+ bytes|config\.json: SHA-256"):
        read_config(path)


def test_an_older_format_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / MARKER).write_text(json.dumps({"format_version": 1, "files": ["policy"]}))
    with pytest.raises(CheckpointError, match="checkpoint format 1, this flashrl reads format 2. Format 1"):
        read_checkpoint(tmp_path)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two_renames"])
def test_a_save_over_a_checkpoint_replaces_it_whole(tmp_path: Path, monkeypatch, exchange: bool) -> None:
    from flashrl.checkpoints import ownership

    if not exchange:  # a filesystem without RENAME_EXCHANGE
        monkeypatch.setattr(ownership, "_exchange", lambda a, b: False)
    _write(tmp_path / "ckpt", 1.0, iteration=10)
    path = _write(tmp_path / "ckpt", 2.0, iteration=3)
    checkpoint = read_checkpoint(path)
    assert checkpoint.algorithm_state == {"iteration": 3} and checkpoint.config == {"v": 2.0}
    assert torch.equal(torch.load(Path(checkpoint.learner_path, "learner_state.pt"))["w"], torch.full((1000,), 2.0))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the old one and the tmp folder are gone


def test_a_folder_that_is_not_a_checkpoint_is_never_replaced(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="exists and is not a flashrl checkpoint"):
        _write(tmp_path / "mine", 1.0)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    (tmp_path / "empty").mkdir()  # Tune hands Trainable.save_checkpoint an empty folder
    assert read_checkpoint(_write(tmp_path / "empty", 1.0)).config == {"v": 1.0}


def test_a_failed_save_over_a_checkpoint_leaves_the_old_one(tmp_path: Path) -> None:
    """The issue's case: a re-save that fails half-way must not leave policy v2 with learner state v1."""
    _write(tmp_path / "ckpt", 1.0, iteration=10)

    class Failing(_FileGroup):
        def save_policy(self, path: str) -> str:
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(tmp_path / "ckpt", config={"v": 2.0}, learner_group=Failing(2.0),
                         algorithm_state={"iteration": 3})
    checkpoint = read_checkpoint(tmp_path / "ckpt")
    assert checkpoint.algorithm_state == {"iteration": 10} and checkpoint.config == {"v": 1.0}
    assert torch.equal(torch.load(Path(checkpoint.learner_path, "learner_state.pt"))["w"], torch.full((1000,), 1.0))


def test_latest_and_keep_last_n_follow_the_save_order(tmp_path: Path) -> None:
    for i in (1, 2, 3):
        record_checkpoint(tmp_path, _write(tmp_path / f"checkpoint_{i:06d}", i, i), keep_last_n=2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_000002", "checkpoint_000003", LATEST_FILE]
    assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoint_000003")
    # Resumed from 2: the new saves are the newest, whatever their names say.
    (tmp_path / "checkpoint_000007.tmp").mkdir()  # an interrupted save's leftover
    removed = record_checkpoint(tmp_path, _write(tmp_path / "checkpoint_000003", 30.0, 3), keep_last_n=2)
    assert removed == ["checkpoint_000007.tmp"]
    record_checkpoint(tmp_path, _write(tmp_path / "checkpoint_000004", 4.0, 4), keep_last_n=2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_000003", "checkpoint_000004", LATEST_FILE]
    assert read_checkpoint(tmp_path / "checkpoint_000003").config == {"v": 30.0}
    assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoint_000004")
    (tmp_path / LATEST_FILE).write_text("checkpoint_000009\n")  # names nothing complete
    assert latest_checkpoint(tmp_path) is None


def test_resume_latest_follows_the_pointer_and_keeps_checkpoint_final(tmp_path: Path) -> None:
    from flashrl.recipes.args import find_checkpoint

    run, folder = tmp_path / "run", tmp_path / "run" / "checkpoints"
    for i in (5, 6):
        _write(folder / f"checkpoint_{i:06d}", i, i)
    (folder / "checkpoint_000009.tmp").mkdir()  # an interrupted save is never a candidate
    assert find_checkpoint("latest", str(run), "x") == (folder / "checkpoint_000006", run)  # no pointer: by iteration
    record_checkpoint(folder, _write(folder / "checkpoint_000003", 3.0, 3))  # resumed from 2, saved 3
    assert find_checkpoint("latest", str(run), "x") == (folder / "checkpoint_000003", run)
    _write(run / "checkpoint_final", 4.0, 4)
    assert find_checkpoint("latest", str(run), "x") == (run / "checkpoint_final", run)  # the higher iteration


# --------------------------------------------------------------------------------------------------
# kill -9
def test_kill_9_at_random_points_never_leaves_a_mix(tmp_path: Path, smollm2_path: str) -> None:
    from flashrl.models import build_tiny_llama

    model = build_tiny_llama(tmp_path / "model", tokenizer_source=smollm2_path, vocab_size=512)  # small files
    done = subprocess.run(
        [sys.executable, __file__, str(tmp_path / "run"), model, str(ROUNDS)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["kills"] == ROUNDS
    assert summary["mid_save"] >= 3, summary  # the kills did land inside saves, not only between them
    assert summary["saves"] >= 5 and summary["resaves"] >= 1, summary
    assert summary["checked"] >= ROUNDS, summary


def _token(learner) -> float:
    return float(learner.model.model.norm.weight[0])


def _save_forever(root: str, learner, start: int, rng: random.Random) -> None:
    """The writer: checkpoint after checkpoint, each with a new token in every part."""
    iteration = start
    while True:
        iteration += 1
        token = float(rng.randrange(1, 10**6))
        with torch.no_grad():
            learner.model.model.norm.weight.fill_(token)
        learner.version = iteration
        path = write_checkpoint(os.path.join(root, f"checkpoint_{iteration:06d}"), config={"token": token},
                                learner_group=learner, algorithm_state={"iteration": iteration, "token": token})
        record_checkpoint(root, path, keep_last_n=2)


def _check_folder(root: str) -> tuple[int, int]:
    """(iteration of latest, complete checkpoints checked); raises AssertionError on any mix."""
    from safetensors import safe_open

    from flashrl.checkpoints import load_tensor_file

    checked = 0
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not (name.startswith("checkpoint_") and os.path.isfile(os.path.join(path, MARKER))):
            continue
        if name.endswith((".tmp", ".old")):
            continue
        checkpoint = read_checkpoint(path)  # every file against the manifest
        token = checkpoint.algorithm_state["token"]
        state = load_tensor_file(os.path.join(checkpoint.learner_path, "learner_state.pt"))
        assert torch.equal(state["model"][NORM], torch.full_like(state["model"][NORM], token)), name
        assert state["extra_state"]["version"] == checkpoint.algorithm_state["iteration"], name
        with safe_open(os.path.join(path, "policy", "model.safetensors"), "pt") as f:
            assert torch.equal(f.get_tensor(NORM), state["model"][NORM]), name
        assert checkpoint.config == {"token": token}, name
        checked += 1
    latest = latest_checkpoint(root)
    if latest is None:
        return 0, checked
    return read_checkpoint(latest).algorithm_state["iteration"], checked


def _crash_rounds(root: str, model: str, rounds: int) -> dict[str, int]:
    from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
    from flashrl.learners import Learner, LearnerSpec

    torch.set_num_threads(1)  # no thread pool exists, so forking this process is safe
    learner = Learner(LearnerSpec(model=model, device="cpu", optimizer="sgd", loss=FlashReinforceLossSpec(delta=0.05)))
    os.makedirs(root)
    rng = random.Random(0)
    summary = {"kills": 0, "mid_save": 0, "saves": 0, "resaves": 0, "checked": 0}
    last = 0
    for _ in range(rounds):
        # Mostly continue from latest; sometimes resume from an older one and save over what follows.
        start = max(0, last - (rng.random() < 0.3))
        summary["resaves"] += start < last
        forked = time.time()
        pid = os.fork()
        if pid == 0:  # the writer
            try:
                _save_forever(root, learner, start, random.Random(rng.random()))
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.05, 2.0))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        summary["kills"] += 1
        summary["mid_save"] += any(n.endswith(".tmp") and os.stat(os.path.join(root, n)).st_mtime >= forked
                                   for n in os.listdir(root))  # this writer's save was cut short
        iteration, checked = _check_folder(root)
        assert iteration >= start, (iteration, start)  # latest never goes back behind where we resumed
        summary["checked"] += checked
        summary["saves"] += max(0, iteration - start)
        last = iteration
    return summary


if __name__ == "__main__":
    print(json.dumps(_crash_rounds(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
