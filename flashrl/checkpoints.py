"""Algorithm checkpoints: a folder with the policy (a Hugging Face folder) and everything to resume.

Layout::

    <path>/flashrl_checkpoint.json   format version and the list below
    <path>/config.json               FlashReinforceConfig.to_dict()
    <path>/policy/                   the policy: config, safetensors, tokenizer (transformers / vLLM load it)
    <path>/learner_state.pt          model, optimizer, RNG states and version of the learner
    <path>/algorithm_state.json      iteration, data cursors, lifetime counters

The policy folder is what users deploy; the other files resume training exactly where it stopped
(in `sync_group` mode exactly; in `async` mode the episodes in flight and those waiting for a later
batch at save time are not saved, so the resumed run restarts the prompt stream after the last
started episode and the checkpoint books them as lost).
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch

FORMAT_VERSION = 1
"""Bumped when the layout changes incompatibly."""
MARKER = "flashrl_checkpoint.json"
POLICY_DIR = "policy"
CONFIG_FILE = "config.json"
LEARNER_STATE_FILE = "learner_state.pt"
ALGORITHM_STATE_FILE = "algorithm_state.json"


class CheckpointError(ValueError):
    """A folder that is not a (compatible) flashrl checkpoint, or a file in it that cannot be read safely."""


@dataclass
class Checkpoint:
    """The contents of a checkpoint folder, loaded."""

    path: str
    config: dict[str, Any]
    learner_state: dict[str, Any]
    algorithm_state: dict[str, Any]


def write_checkpoint(
    path: str | os.PathLike[str],
    *,
    config: dict[str, Any],
    learner_group: Any,
    algorithm_state: dict[str, Any],
) -> str:
    """Write a checkpoint folder at `path` (created if missing); returns its absolute path."""
    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    learner_group.save_policy(os.path.join(path, POLICY_DIR))
    torch.save(learner_group.get_state(), os.path.join(path, LEARNER_STATE_FILE))
    _write_json(os.path.join(path, CONFIG_FILE), config)
    _write_json(os.path.join(path, ALGORITHM_STATE_FILE), algorithm_state)
    # The marker goes last: a folder without it is an interrupted save, never a checkpoint.
    _write_json(
        os.path.join(path, MARKER),
        {"format_version": FORMAT_VERSION, "files": [POLICY_DIR, CONFIG_FILE, LEARNER_STATE_FILE,
                                                      ALGORITHM_STATE_FILE]},
    )
    return path


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Only the run's config dict (cheap; used by `FlashReinforce.from_checkpoint`)."""
    path = _check(path)
    with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
        return json.load(f)


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Load a checkpoint folder written by `write_checkpoint`."""
    path = _check(path)
    with open(os.path.join(path, ALGORITHM_STATE_FILE), encoding="utf-8") as f:
        algorithm_state = json.load(f)
    learner_state = load_tensor_file(os.path.join(path, LEARNER_STATE_FILE))
    return Checkpoint(path=path, config=read_config(path), learner_state=learner_state,
                      algorithm_state=algorithm_state)


def load_tensor_file(file: str | os.PathLike[str]) -> Any:
    """Load a file written by ``torch.save`` of tensors and plain containers, running no code from it.

    ``weights_only=True`` makes torch's unpickler refuse every global outside its allow-list (tensors,
    dtypes, plain containers, numbers, strings): a checkpoint is data from wherever it was copied, and a
    full unpickle of it would run whatever the file asks for. Every way the file can be unreadable
    (refused global, truncated or corrupt zip, not a torch file) becomes one `CheckpointError` naming it.
    """
    file = os.fspath(file)
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(
            f"{file}: expected a torch state file here, found none. The checkpoint is incomplete; pass a "
            "folder written whole by save_to_path()."
        ) from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError, TypeError) as error:
        raise CheckpointError(
            f"{file} is not a readable flashrl state file (expected tensors and plain Python values saved by "
            f"flashrl; torch said: {load_error_reason(error)}). The file is truncated, corrupt or was altered; "
            "nothing in it was run. Restore it from an intact copy of the checkpoint."
        ) from error


def load_error_reason(error: BaseException) -> str:
    """One line saying why ``torch.load`` refused a file: the unpickler's own line when there is one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    # weights_only refusals open with a paragraph about torch 2.6; the reason is the WeightsUnpickler line.
    reason = next((line for line in lines if line.startswith("WeightsUnpickler error:")), lines[0] if lines else "")
    return f"{type(error).__name__}: {reason}"


def _check(path: str | os.PathLike[str]) -> str:
    path = os.path.abspath(os.fspath(path))
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise CheckpointError(
            f"{path} is not a flashrl checkpoint: expected a file {MARKER} in it (written last by "
            "save_to_path), found none. Pass the folder that save_to_path() returned."
        )
    with open(marker, encoding="utf-8") as f:
        version = json.load(f).get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format {version!r}, this flashrl reads format {FORMAT_VERSION}. "
            "Load it with the flashrl version that wrote it."
        )
    return path


def _write_json(path: str, data: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    os.replace(tmp, path)
