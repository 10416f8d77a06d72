"""Unpickling a checkpoint's data through allow-lists: no code runs from a file, whoever altered it.

A checkpoint is data from wherever it was copied, and a full unpickle runs whatever a file asks for.
Three things in a checkpoint are pickles: a single learner's state file and the bytes entries of a DCP
checkpoint (``torch.save`` of tensors and plain containers, loaded ``weights_only``), and DCP's own
``.metadata`` (a plain pickle of DCP's metadata classes, loaded by `MetadataUnpickler`). DCP's loader
would unpickle the last two fully (plain ``pickle.load`` in ``FileSystemReader.read_metadata``, a full
``torch.load`` in ``DefaultLoadPlanner.load_bytes``; torch 2.13); ``flashrl.checkpoints.dcp`` reads
them through this module instead.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
from typing import Any

import torch

from flashrl.checkpoints.files import CheckpointError, open_regular


def load_tensor_file(file: str | os.PathLike[str]) -> Any:
    """Load a file written by ``torch.save`` of tensors and plain containers, running no code from it.

    ``weights_only=True`` makes torch's unpickler refuse every global outside its allow-list (tensors,
    dtypes, plain containers, numbers, strings): a checkpoint is data from wherever it was copied, and a
    full unpickle of it would run whatever the file asks for. Every way the file can be unreadable
    (refused global, truncated or corrupt zip, not a torch file) becomes one `CheckpointError` naming it;
    so does a file that is not a regular one (read through `open_regular`: nothing blocks).
    """
    file = os.fspath(file)
    try:
        fd = open_regular(file, root=os.path.dirname(os.path.abspath(file)), what="a torch state file")
    except FileNotFoundError:
        raise CheckpointError(
            f"{file}: expected a torch state file here, found none. The checkpoint is incomplete; pass a "
            "folder written whole by save_to_path()."
        ) from None
    try:
        with os.fdopen(fd, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
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


def load_plain_bytes(value: io.BytesIO) -> Any:
    """A bytes entry of a DCP checkpoint (``save_sharded``'s extra state), loaded weights-only.

    DCP stored the BytesIO object itself (torch.save of it), so the outer load must allow that one
    class; the blob inside is what ``save_sharded`` wrote, loaded weights-only too. Raises what
    ``torch.load`` raises on a refused or corrupt entry.
    """
    with torch.serialization.safe_globals([io.BytesIO]):
        loaded = torch.load(value, map_location="cpu", weights_only=True)
    if isinstance(loaded, io.BytesIO):
        loaded.seek(0)
        loaded = torch.load(loaded, map_location="cpu", weights_only=True)
    return loaded


_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": None,  # None: every class of the module (plain dataclasses)
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file, refusing every global outside ``_METADATA_GLOBALS``."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _METADATA_GLOBALS.get(module, set())
        if allowed is None:  # a class defined in DCP's metadata module, not one it imports
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and found.__module__ == module:
                return found
        elif name in allowed:
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"global {module}.{name} is not allowed in DCP metadata (expected only DCP's metadata classes, "
            "torch.Size and dtypes)"
        )
