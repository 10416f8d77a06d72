"""A checkpoint folder is hostile input, and a save path may hold the user's data.

Restoring reads only what the manifest lists, as the manifest says (``learner_layout``), and only
regular files inside the folder: an unlisted file, a FIFO, a device, a link out of the folder or a DCP
shard path leading out is a `CheckpointError` naming it, and nothing blocks (every attempt that used
to hang runs in a child process with a timeout here). Saving removes only what flashrl wrote.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from flashrl.checkpoints import (
    FRESH_OPTIMIZER_FILE,
    LATEST_FILE,
    MARKER,
    SAVE_MARKER,
    STATE_FILE,
    CheckpointError,
    dcp,
    latest_checkpoint,
    read_checkpoint,
    record_checkpoint,
    write_checkpoint,
)

TIMEOUT_S = 120
"""For each child process that runs a read which used to block forever (imports torch: a few seconds)."""


class _SingleFileGroup:
    """What write_checkpoint needs of a single learner: one state file."""

    num_learners = 0

    def __init__(self, value: float) -> None:
        self.value = value

    def save_state(self, path: str) -> str:
        os.makedirs(path)
        torch.save({"w": torch.full((4,), self.value)}, os.path.join(path, STATE_FILE))
        return path

    def save_policy(self, path: str) -> str:
        raise AssertionError("not exported in these tests")


class _DcpGroup:
    """What write_checkpoint needs of sharded learners: DCP shards and .metadata, in one process; before
    the first optimizer step (no optimizer state) with the 0-byte ``optimizer_not_started`` marker, as
    ``ShardedPolicy.save_state`` writes it."""

    num_learners = 2

    def __init__(self, value: float) -> None:
        self.model = torch.nn.Linear(3, 2)
        with torch.no_grad():
            self.model.weight.fill_(value)

    def save_state(self, path: str) -> str:
        with warnings.catch_warnings():  # DCP warns that no process group is initialised: intended here
            warnings.simplefilter("ignore")
            dcp.save_sharded(path, self.model, extra_state={"version": 1})
        Path(path, FRESH_OPTIMIZER_FILE).touch()
        return path

    def save_policy(self, path: str) -> str:
        raise AssertionError("not exported in these tests")


def _save(path: Path, group: object) -> Path:
    return Path(write_checkpoint(path, config={"v": 1}, learner_group=group, algorithm_state={"iteration": 1},
                                 export_policy=False))


def _in_child(code: str) -> dict[str, str]:
    """Run ``code`` (which sets ``result``) in a fresh interpreter with a timeout: what it raised, or returned.

    A read that blocks forever (a FIFO, /dev/zero) fails the test through ``TimeoutExpired`` (the child
    is killed) instead of hanging the suite.
    """
    script = (
        "import json, sys\n"
        "try:\n"
        + "".join(f"    {line}\n" for line in code.strip().splitlines())
        + "    out = {'returned': repr(result)}\n"
        "except Exception as error:\n"
        "    out = {'raised': type(error).__name__, 'message': str(error)}\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT_S,
                          check=False, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------------
# The manifest is the only truth: no unlisted file, the manifest's layout
def test_unlisted_dcp_metadata_beside_a_single_learners_state_is_refused(tmp_path: Path) -> None:
    single = _save(tmp_path / "a", _SingleFileGroup(1.0))
    sharded = _save(tmp_path / "b", _DcpGroup(7.0))
    for name in (".metadata", "__0_0.distcp"):  # B's learner state, beside A's
        shutil.copy(sharded / "learner" / name, single / "learner" / name)
    with pytest.raises(CheckpointError, match=r"learner/\.metadata: not listed in the manifest") as info:
        read_checkpoint(single)
    assert "Move the file out of the checkpoint" in str(info.value)


def test_unlisted_state_file_beside_dcp_shards_is_refused(tmp_path: Path) -> None:
    sharded = _save(tmp_path / "b", _DcpGroup(7.0))
    single = _save(tmp_path / "a", _SingleFileGroup(1.0))
    shutil.copy(single / "learner" / STATE_FILE, sharded / "learner" / STATE_FILE)
    with pytest.raises(CheckpointError, match=r"learner/learner_state\.pt: not listed in the manifest"):
        read_checkpoint(sharded)


def test_the_checkpoint_carries_the_manifests_layout(tmp_path: Path) -> None:
    assert read_checkpoint(_save(tmp_path / "a", _SingleFileGroup(1.0))).learner_layout == "single_file"
    assert read_checkpoint(_save(tmp_path / "b", _DcpGroup(7.0))).learner_layout == "dcp"


def test_a_manifest_whose_layout_disagrees_with_its_files_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path / "a", _SingleFileGroup(1.0))
    manifest = json.loads((path / MARKER).read_text())
    (path / MARKER).write_text(json.dumps({**manifest, "learner_layout": "dcp"}))
    with pytest.raises(CheckpointError, match=r"learner_layout 'dcp' \(learner/\.metadata\) but lists "
                                              r"\['learner/learner_state\.pt'\]"):
        read_checkpoint(path)


def test_checkpoint_a_never_restores_bs_weights_through_the_learner_group(tmp_path: Path, tiny_llama_path) -> None:
    """What ``FlashReinforce.restore_from_path`` does with the learner: read_checkpoint, then
    ``LearnerGroup.load_state`` with the manifest's layout. Checkpoint A (one learner) gets B's DCP shards
    (every weight 7.0) copied beside its verified state file."""
    from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
    from flashrl.learners import Learner, LearnerGroup, LearnerSpec

    spec = LearnerSpec(model=tiny_llama_path, device="cpu", optimizer="sgd", loss=FlashReinforceLossSpec(delta=0.05))
    group = LearnerGroup(spec, local=True)
    a = Path(write_checkpoint(tmp_path / "a", config={}, learner_group=group, algorithm_state={"iteration": 1},
                              export_policy=False))
    original = group.get_weights()
    other = Learner(spec)
    with torch.no_grad():
        for p in other.model.parameters():
            p.fill_(7.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save_sharded(tmp_path / "b", other.model, extra_state=other._extra_state())
    for name in (".metadata", "__0_0.distcp"):
        shutil.copy(tmp_path / "b" / name, a / "learner" / name)

    with pytest.raises(CheckpointError, match=r"\.metadata: not listed in the manifest"):
        read_checkpoint(a)
    # Even past read_checkpoint, the learner reads the layout the manifest names, not the shards beside it...
    group.load_state(a / "learner", layout="single_file")
    for name, tensor in group.get_weights().items():
        assert torch.equal(tensor, original[name]), name
    # ...and without a layout it refuses to guess between the two.
    with pytest.raises(CheckpointError, match="holds both learner_state.pt .* and .metadata"):
        group.load_state(a / "learner")
    assert not any(torch.equal(t, torch.full_like(t, 7.0)) for t in group.get_weights().values())


# --------------------------------------------------------------------------------------------------
# Only regular files, nothing blocks
def _fresh_marker(tmp_path: Path) -> tuple[Path, Path]:
    path = _save(tmp_path / "ckpt", _DcpGroup(7.0))
    marker = path / "learner" / FRESH_OPTIMIZER_FILE
    assert json.loads((path / MARKER).read_text())["files"][f"learner/{FRESH_OPTIMIZER_FILE}"]["size"] == 0
    marker.unlink()
    return path, marker


def test_a_fifo_in_place_of_a_listed_empty_file_is_refused_without_blocking(tmp_path: Path) -> None:
    path, marker = _fresh_marker(tmp_path)
    os.mkfifo(marker)
    out = _in_child(f"from flashrl.checkpoints import read_checkpoint\nresult = read_checkpoint({str(path)!r})")
    assert out.get("raised") == "CheckpointError", out
    assert f"{marker} is a FIFO; expected a checkpoint file as a regular file" in out["message"]


@pytest.mark.parametrize("kind", ["symlink", "device"])
def test_dev_zero_as_a_listed_empty_file_is_refused_without_reading_it(tmp_path: Path, kind: str) -> None:
    path, marker = _fresh_marker(tmp_path)
    if kind == "symlink":
        marker.symlink_to("/dev/zero")
        expected = f"{marker}: a symlink to /dev/zero, outside {path}"
    else:
        try:
            os.mknod(marker, 0o600 | 0o020000, os.makedev(1, 5))  # S_IFCHR: the /dev/zero device
        except PermissionError:
            pytest.skip("creating a device node needs CAP_MKNOD (root); the symlink case covers the rest")
        expected = f"{marker} is a character device; expected a checkpoint file as a regular file"
    out = _in_child(f"from flashrl.checkpoints import read_checkpoint\nresult = read_checkpoint({str(path)!r})")
    assert out.get("raised") == "CheckpointError", out
    assert expected in out["message"]


def test_a_symlink_out_of_the_folder_is_refused_even_with_the_right_bytes(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt", _SingleFileGroup(1.0))
    outside = tmp_path / "elsewhere.json"
    shutil.move(path / "config.json", outside)  # the very bytes the manifest lists
    (path / "config.json").symlink_to(outside)
    with pytest.raises(CheckpointError, match=f"config.json: a symlink to {outside}, outside {path}"):
        read_checkpoint(path)


@pytest.mark.parametrize("kind", ["fifo", "folder", "symlink_out"])
def test_latest_must_be_a_regular_file_in_its_folder(tmp_path: Path, kind: str) -> None:
    folder = tmp_path / "checkpoints"
    record_checkpoint(folder, _save(folder / "checkpoint_000001", _SingleFileGroup(1.0)))
    latest = folder / LATEST_FILE
    assert latest_checkpoint(folder) == str(folder / "checkpoint_000001")
    latest.unlink()
    if kind == "fifo":
        os.mkfifo(latest)
        expected = f"{latest} is a FIFO; expected the pointer to the newest checkpoint as a regular file"
    elif kind == "folder":
        latest.mkdir()
        expected = f"{latest} is a folder; expected the pointer to the newest checkpoint as a regular file"
    else:
        (tmp_path / "pointer").write_text("checkpoint_000001\n")
        latest.symlink_to(tmp_path / "pointer")
        expected = f"{latest}: a symlink to {tmp_path / 'pointer'}, outside {folder}"
    out = _in_child(f"from flashrl.checkpoints import latest_checkpoint\nresult = latest_checkpoint('{folder}')")
    assert out.get("raised") == "CheckpointError", out
    assert expected in out["message"]


# --------------------------------------------------------------------------------------------------
# DCP shard paths stay inside their folder
def _dcp(folder: Path, value: float) -> torch.nn.Module:
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save_sharded(folder, model, extra_state={"version": 1})
    return model


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_dcp_storage_paths_leading_out_of_the_folder_are_refused(tmp_path: Path, where: str) -> None:
    _dcp(tmp_path / "a", 1.0)
    _dcp(tmp_path / "b", 7.0)
    target = "../b/__0_0.distcp" if where == "relative" else str(tmp_path / "b" / "__0_0.distcp")
    with open(tmp_path / "a" / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file, just written
    metadata.storage_data = {index: dataclasses.replace(info, relative_path=target)
                             for index, info in metadata.storage_data.items()}
    with open(tmp_path / "a" / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    refused = f"a shard's storage path is {target!r}; expected a file name inside"
    with pytest.raises(CheckpointError, match=refused), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load_sharded_full(tmp_path / "a")
    with pytest.raises(CheckpointError, match=refused), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load_sharded(tmp_path / "a", torch.nn.Linear(3, 2))


def test_a_dcp_shard_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    _dcp(tmp_path / "a", 1.0)
    shard = tmp_path / "a" / "__0_0.distcp"
    shard.unlink()
    os.mkfifo(shard)
    out = _in_child(
        "import warnings\nwarnings.simplefilter('ignore')\nfrom flashrl.checkpoints import dcp\n"
        f"result = dcp.load_sharded_full({str(tmp_path / 'a')!r})"
    )
    assert out.get("raised") == "CheckpointError", out
    assert f"{shard} is a FIFO; expected a DCP shard as a regular file" in out["message"]


# --------------------------------------------------------------------------------------------------
# Saving never deletes what flashrl did not write
def test_a_save_over_a_users_file_is_refused_and_the_file_kept(tmp_path: Path) -> None:
    results = tmp_path / "results.csv"
    results.write_text("step,reward\n1,0.5\n")
    with pytest.raises(CheckpointError, match=f"{results} exists and is not a flashrl checkpoint \\(a regular "
                                              "file, not a folder\\)"):
        _save(results, _SingleFileGroup(1.0))
    assert results.read_text() == "step,reward\n1,0.5\n"
    assert sorted(os.listdir(tmp_path)) == ["results.csv"]


def test_a_save_over_a_checkpoint_holding_a_users_file_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt", _SingleFileGroup(1.0))
    (path / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="a checkpoint holding notes.txt, which its manifest does not list"):
        _save(path, _SingleFileGroup(2.0))
    assert (path / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_users_own_tmp_path_is_refused_and_kept(tmp_path: Path, kind: str) -> None:
    mine = tmp_path / "ckpt.tmp"
    if kind == "folder":
        mine.mkdir()
        (mine / "data.txt").write_text("mine")
        reason = f"a folder without {MARKER}"
    else:
        mine.write_text("mine")
        reason = "a regular file, not a folder"
    with pytest.raises(CheckpointError, match=f"{mine} exists and is not a flashrl checkpoint \\({reason}\\)"):
        _save(tmp_path / "ckpt", _SingleFileGroup(1.0))
    assert (mine / "data.txt" if kind == "folder" else mine).read_text() == "mine"
    assert not (tmp_path / "ckpt").exists()


def test_an_interrupted_save_is_marked_first_and_still_cleaned(tmp_path: Path) -> None:
    seen = []

    class Watching(_SingleFileGroup):
        def save_state(self, path: str) -> str:
            seen.append(sorted(os.listdir(os.path.dirname(path))))  # the temporary folder, before any state
            return super().save_state(path)

    leftover = tmp_path / "ckpt.tmp"  # an interrupted save of this path: marked, half written
    (leftover / "learner").mkdir(parents=True)
    (leftover / SAVE_MARKER).touch()
    (leftover / "learner" / STATE_FILE).write_bytes(b"half")
    path = _save(tmp_path / "ckpt", Watching(1.0))
    assert seen == [[SAVE_MARKER]]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert SAVE_MARKER not in json.loads((path / MARKER).read_text())["files"]
    assert not (path / SAVE_MARKER).exists()
    assert read_checkpoint(path).config == {"v": 1}


def test_record_checkpoint_leaves_folders_flashrl_did_not_write(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    first = _save(folder / "checkpoint_000001", _SingleFileGroup(1.0))
    (folder / "checkpoint_000009.tmp").mkdir()
    (folder / "checkpoint_000009.tmp" / "data.txt").write_text("mine")  # not marked: not an interrupted save
    (first / "notes.txt").write_text("keep me")  # a checkpoint the user added a file to
    record_checkpoint(folder, first)
    second = _save(folder / "checkpoint_000002", _SingleFileGroup(2.0))
    assert record_checkpoint(folder, second, keep_last_n=1) == []
    assert (folder / "checkpoint_000009.tmp" / "data.txt").read_text() == "mine"
    assert (first / "notes.txt").read_text() == "keep me"
