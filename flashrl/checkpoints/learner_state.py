"""A learner's ``save_state`` folder: one state file (one learner) or DCP shards (sharded learners).

The learner's policy hands over what only it knows (its full train state by parameter name, or its
sharded model and optimizer); this module writes and reads the folder. Either layout restores on
either kind of learner: one learner reads every DCP shard in full (`read_full_state`), sharded
learners read a single learner's file and shard it themselves. A checkpoint's manifest says which
layout its ``learner/`` folder holds (``learner_layout``); without one, the file present does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flashrl.checkpoints import dcp
from flashrl.checkpoints.files import CheckpointError
from flashrl.checkpoints.layout import (
    DCP_LAYOUT,
    DCP_METADATA_FILE,
    FRESH_OPTIMIZER_FILE,
    LAYOUT_FILES,
    SINGLE_FILE_LAYOUT,
    STATE_FILE,
)
from flashrl.checkpoints.safe_load import load_tensor_file

__all__ = [
    "FullState",
    "load_sharded_state",
    "read_full_state",
    "read_state_file",
    "save_sharded_state",
    "state_layout",
    "write_state_file",
]


@dataclass
class FullState:
    """A learner's train state as full tensors: what `read_full_state` returns."""

    model: dict[str, torch.Tensor]
    """Full weights by parameter name."""
    optimizer: dict[str, Any] | None
    """Optimizer state keyed by parameter name; None: the optimizer had not stepped (start it fresh)."""
    extra: dict[str, Any]
    """The learner's extra state (format, schedule, RNG, version, counters)."""


def write_state_file(path: str | os.PathLike[str], model: dict[str, torch.Tensor], optimizer: dict[str, Any],
                     extra: dict[str, Any]) -> str:
    """One file in the folder ``path``: the full weights and optimizer state, and ``extra``."""
    folder = Path(path).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (STATE_FILE + ".tmp")
    torch.save({"model": model, "optimizer": optimizer, "extra_state": extra}, tmp)
    tmp.replace(folder / STATE_FILE)
    return str(folder)


def read_state_file(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(weights, optimizer state, extra) of a single learner's state file, loaded weights-only."""
    file = folder / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{folder} is not a learner state folder: expected {STATE_FILE} (one learner) or DCP shards with "
            f"{DCP_METADATA_FILE} (sharded learners). Pass the folder that save_state() wrote."
        )
    state = load_tensor_file(file)  # tensors and plain values only: a tampered file runs nothing
    return state["model"], state["optimizer"], state["extra_state"]


def read_full_state(path: str | os.PathLike[str], layout: str | None = None) -> FullState:
    """A single learner's state file, or the DCP shards of sharded learners (every shard, in full).

    ``layout`` (a checkpoint manifest's ``learner_layout``) says which; None: the one present (a
    single learner's file when neither is).
    """
    folder = Path(path).resolve()
    if state_layout(folder, layout, default=SINGLE_FILE_LAYOUT) == DCP_LAYOUT:
        state = dcp.load_sharded_full(folder)
        fresh = (folder / FRESH_OPTIMIZER_FILE).is_file()
        return FullState(state["model"], None if fresh else state["optimizer"], state["extra_state"])
    model, optimizer, extra = read_state_file(folder)
    return FullState(model, optimizer, extra)


def save_sharded_state(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer,
                       extra: dict[str, Any], *, rank: int) -> str:
    """A DCP folder: every rank writes its own shards of the weights and optimizer state; ``extra`` once.

    An optimizer that has not stepped yet is not saved (``get_state_dict`` would first give it a
    zero step, one step ahead of a fresh one); a marker file says so. A collective.
    """
    started = bool(optimizer.state)
    folder = dcp.save_sharded(path, model, optimizer if started else None, extra_state=extra)
    if not started and rank == 0:
        (Path(folder) / FRESH_OPTIMIZER_FILE).touch()
    return folder


def load_sharded_state(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer
                       ) -> dict[str, Any]:
    """Load a DCP folder written by `save_sharded_state` (on any number of ranks) in place; returns ``extra``.

    A collective. An optimizer saved before its first step is cleared (as saved: not stepped yet).
    """
    folder = Path(path).resolve()
    if (folder / FRESH_OPTIMIZER_FILE).is_file():
        optimizer.state.clear()
        return dcp.load_sharded(folder, model)
    return dcp.load_sharded(folder, model, optimizer)


def state_layout(folder: Path, layout: str | None, *, default: str) -> str:
    """How to read the ``save_state`` folder ``folder``: ``layout`` when given (a checkpoint's manifest
    says), else by the file present (``default`` when neither is); both present is refused."""
    if layout is not None:
        if layout not in LAYOUT_FILES:
            raise ValueError(f"layout must be one of {sorted(LAYOUT_FILES)}; got {layout!r}.")
        return layout
    present = [kind for kind, name in LAYOUT_FILES.items() if os.path.lexists(folder / name)]
    if len(present) > 1:
        raise CheckpointError(
            f"{folder} holds both {STATE_FILE} (one learner's state) and {DCP_METADATA_FILE} (sharded learners' "
            "DCP shards); a save writes one of them. Pass layout= (the checkpoint's learner_layout, which "
            "read_checkpoint returns), or remove the file that does not belong."
        )
    return present[0] if present else default
