"""Restoring a checkpoint runs no code from it: tampered and truncated state files are CheckpointErrors.

Every file a restore reads is covered: the checkpoint's learner state (``read_checkpoint``), a single
learner's state file (``Learner.load_state``) and both unpickled parts of a sharded DCP checkpoint
(its ``.metadata`` and the extra-state entry).
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from flashrl.checkpoints import (
    STATE_FILE,
    Checkpoint,
    CheckpointError,
    dcp,
    load_tensor_file,
    read_checkpoint,
    safe_load,
    write_checkpoint,
)
from flashrl.checkpoints.learner_state import read_state_file as _read_state_file
from flashrl.learners import fsdp


class _Payload:
    """Unpickling this object calls ``Path.touch(marker)``: the stand-in for an attacker's code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


class _StateGroup:
    """Writes ``state`` as a single learner's state file: a checkpoint whose manifest matches its files
    (what an altered copy with a rewritten manifest also looks like)."""

    num_learners = 0

    def __init__(self, state: object) -> None:
        self.state = state

    def save_state(self, path: str) -> str:
        os.makedirs(path)
        torch.save(self.state, os.path.join(path, STATE_FILE))
        return path

    def save_policy(self, path: str) -> str:
        raise AssertionError("not exported in these tests")


def _checkpoint_folder(path: Path, learner_state: object) -> Path:
    return Path(write_checkpoint(path, config={"train_batch_size": 2}, learner_group=_StateGroup(learner_state),
                                 algorithm_state={"iteration": 3}, export_policy=False))


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def test_a_plain_checkpoint_still_loads(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(3.0)}, "rng": {"python": (3, (1, 2), None)}, "version": 7}
    checkpoint = read_checkpoint(_checkpoint_folder(tmp_path / "ckpt", state))
    loaded = load_tensor_file(Path(checkpoint.learner_path, STATE_FILE))
    assert torch.equal(loaded["model"]["w"], torch.arange(3.0))
    assert loaded["rng"] == {"python": (3, (1, 2), None)}
    assert (loaded["version"], checkpoint.algorithm_state) == (7, {"iteration": 3})


def test_a_pickle_payload_in_the_learner_state_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    folder = _checkpoint_folder(tmp_path / "ckpt", {"model": {}, "version": 1, "x": _Payload(marker)})
    file = Path(read_checkpoint(folder).learner_path, STATE_FILE)  # the manifest matches: it was rewritten
    with pytest.raises(CheckpointError, match=f"{STATE_FILE}.*nothing in it was run") as info:
        load_tensor_file(file)
    assert str(file) in str(info.value)
    assert "Unsupported global" in str(info.value)  # the unpickler's own reason, not torch's preamble
    assert not marker.exists()


def test_a_truncated_learner_state_is_a_checkpoint_error(tmp_path: Path) -> None:
    folder = _checkpoint_folder(tmp_path / "ckpt", {"model": {"w": torch.zeros(1000)}, "version": 1})
    file = folder / "learner" / STATE_FILE
    _truncate(file)
    with pytest.raises(CheckpointError, match=r"bytes, the manifest says \d+ \(truncated or altered\)") as info:
        read_checkpoint(folder)  # the manifest catches it before torch sees the file
    assert str(file) in str(info.value)
    with pytest.raises(CheckpointError, match="truncated, corrupt or was altered"):
        load_tensor_file(file)  # and torch's loader, without the manifest, never raises a raw zip error


def test_a_missing_learner_state_names_the_file(tmp_path: Path) -> None:
    folder = _checkpoint_folder(tmp_path / "ckpt", {})
    (folder / "learner" / STATE_FILE).unlink()
    with pytest.raises(CheckpointError, match=f"{STATE_FILE}: missing; the manifest lists it"):
        read_checkpoint(folder)
    with pytest.raises(CheckpointError, match=f"{STATE_FILE}: expected a torch state file"):
        load_tensor_file(folder / "learner" / STATE_FILE)


def test_the_checkpoint_has_no_policy_path_property() -> None:
    assert not hasattr(Checkpoint, "policy_path")  # unused: the policy folder is path / POLICY_DIR


def test_a_single_learner_state_file_with_a_payload_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    torch.save({"model": {}, "optimizer": {}, "extra_state": _Payload(marker)}, tmp_path / STATE_FILE)
    with pytest.raises(CheckpointError, match=STATE_FILE):
        _read_state_file(tmp_path)
    assert not marker.exists()
    _truncate(tmp_path / STATE_FILE)
    with pytest.raises(CheckpointError, match="truncated, corrupt or was altered"):
        _read_state_file(tmp_path)


# --------------------------------------------------------------------------------------------------
# DCP (sharded learners): a one-process save and load, no process group needed
@pytest.fixture
def dcp_folder(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings():  # DCP warns that no process group is initialised: intended here
        warnings.simplefilter("ignore")
        dcp.save_sharded(tmp_path / "dcp", model, optimizer, extra_state={"version": 4, "rng": (1, [2], None)})
    return tmp_path / "dcp", model


def _load(folder: Path) -> tuple[dict, torch.nn.Module]:
    model = torch.nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extra = dcp.load_sharded(folder, model, torch.optim.AdamW(model.parameters()))
    return extra, model


def test_a_dcp_checkpoint_round_trips_through_the_safe_loader(dcp_folder) -> None:
    folder, saved = dcp_folder
    extra, model = _load(folder)
    assert extra == {"version": 4, "rng": (1, [2], None)}
    assert torch.equal(model.weight, saved.weight)


def test_one_process_reads_a_whole_dcp_checkpoint_through_the_safe_loader(dcp_folder, tmp_path: Path) -> None:
    folder, saved = dcp_folder
    state = dcp.load_sharded_full(folder)  # what a single learner restores from sharded ones
    assert state["extra_state"] == {"version": 4, "rng": (1, [2], None)}
    assert torch.equal(state["model"]["weight"], saved.weight)
    assert sorted(state["optimizer"]["state"]["weight"]) == ["exp_avg", "exp_avg_sq", "step"]
    assert state["optimizer"]["param_groups"][0]["params"] == ["weight", "bias"]
    marker = tmp_path / "ran"
    (folder / dcp.DCP_METADATA_FILE).write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata is not readable DCP metadata.*is not allowed"):
        dcp.load_sharded_full(folder)
    assert not marker.exists()


def test_a_payload_in_the_dcp_metadata_runs_nothing(dcp_folder, tmp_path: Path) -> None:
    folder, _ = dcp_folder
    marker = tmp_path / "ran"
    (folder / dcp.DCP_METADATA_FILE).write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata is not readable DCP metadata.*is not allowed"):
        _load(folder)
    assert not marker.exists()


def test_a_truncated_dcp_metadata_is_a_checkpoint_error(dcp_folder) -> None:
    folder, _ = dcp_folder
    _truncate(folder / dcp.DCP_METADATA_FILE)
    with pytest.raises(CheckpointError, match=r"\.metadata is not readable DCP metadata"):
        _load(folder)


def test_a_payload_in_the_dcp_extra_state_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    model = torch.nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save_sharded(tmp_path / "dcp", model, extra_state={"x": _Payload(marker)})
    assert not marker.exists()
    with (
        pytest.raises(CheckpointError, match=r"dcp: the entry 'extra_state' .* not plain data.*Unsupported global"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        dcp.load_sharded(tmp_path / "dcp", torch.nn.Linear(3, 2))
    assert not marker.exists()


def test_no_module_loads_with_weights_only_false() -> None:
    root = Path(__file__).resolve().parents[1]
    offenders = [
        str(path.relative_to(root))
        for folder in ("flashrl", "tests")
        for path in (root / folder).rglob("*.py")
        if "weights_only=" + "False" in path.read_text(encoding="utf-8")
    ]
    assert offenders == []


def test_the_unused_bucketed_gather_is_gone() -> None:
    assert not hasattr(fsdp, "iter_full_buckets")
    assert "iter_full_buckets" not in fsdp.__all__


def test_dcp_metadata_allow_list_refuses_a_torch_function() -> None:
    # torch is allowed for Size and dtypes only: torch.load itself must not be reachable.
    payload = b"ctorch\nload\n."  # protocol 0: the global torch.load
    with pytest.raises(pickle.UnpicklingError, match="global torch.load is not allowed"):
        safe_load.MetadataUnpickler(io.BytesIO(payload)).load()
