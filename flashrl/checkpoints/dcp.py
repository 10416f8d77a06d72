"""Sharded checkpoints (torch DCP): every rank writes its own shards; any number of ranks reads them.

``save_sharded`` / ``load_sharded`` write and read a DCP folder of a sharded model and its optimizer
(the learner hands over the objects; torch's ``get_state_dict`` / ``set_state_dict`` take the shards
from them and put them back); a load may use another world size (DCP reshards).
``load_sharded_full`` reads the whole folder as full tensors in one process, no process group (a
single learner resuming from sharded ones). Every read goes through the allow-listed readers here
(``_SafeReader``, ``_SafeLoadPlanner``; the unpicklers are ``flashrl.checkpoints.safe_load``): DCP's
metadata and bytes entries run no code, and a shard path leading out of the folder is refused.

Saving and loading a sharded model are collectives: call them on every rank, in the same order.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from flashrl.checkpoints.files import CheckpointError, open_regular
from flashrl.checkpoints.layout import DCP_METADATA_FILE
from flashrl.checkpoints.safe_load import MetadataUnpickler, load_error_reason, load_plain_bytes

__all__ = ["DCP_METADATA_FILE", "load_sharded", "load_sharded_full", "save_sharded"]

_EXTRA_KEY = "extra_state"


def save_sharded(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra_state: dict[str, Any] | None = None,
) -> str:
    """Write a DCP checkpoint folder: every rank writes its shards of the model and optimizer state.

    ``extra_state`` (version, counters, RNG, data cursors: anything picklable) is stored once, from
    rank 0, as in a replicated learner. The folder must be on storage every rank can reach (one
    node's disk, or a shared filesystem across nodes). Returns the absolute path.
    """
    path = os.path.abspath(os.fspath(path))
    state: dict[str, Any] = {}
    if optimizer is None:
        state["model"] = get_model_state_dict(model)
    else:
        state["model"], state["optimizer"] = get_state_dict(model, optimizer)
    # One opaque leaf (a pickled blob), not a nested dict: DCP loads only the keys the target already
    # has, and the caller of load_sharded does not know them in advance.
    blob = io.BytesIO()
    torch.save(extra_state or {}, blob)
    blob.seek(0)
    state[_EXTRA_KEY] = blob
    try:
        dcp.save(state, checkpoint_id=path)
    except CheckpointException as error:  # every rank raises it (DCP gathers the ranks' failures)
        raise _rank_failure(error) from error
    return path


def _rank_failure(error: CheckpointException) -> Exception:
    """DCP's gathered failure as the first failing rank's own error, an ``Exception`` (DCP's derives from
    ``BaseException``, which Ray's actors and the checkpoint writer do not treat as an error): a disk's
    ``OSError`` keeps its errno, so the save is reported, and retried, as the disk's failure."""
    for rank, (failure, _) in sorted(error.failures.items()):
        if isinstance(failure, OSError):
            return OSError(failure.errno, f"{failure.strerror or failure} (learner rank {rank})", failure.filename)
        if isinstance(failure, Exception):
            return RuntimeError(f"learner rank {rank}: {type(failure).__name__}: {failure}")
    return RuntimeError(str(error))


def load_sharded(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load what ``save_sharded`` wrote into a sharded ``model`` (and ``optimizer``), in place.

    The model must be sharded (and the optimizer built) the same way as before saving, on any number of
    ranks. Returns the ``extra_state`` that was saved.
    """
    path = _complete_folder(path)
    state: dict[str, Any] = {}
    if optimizer is None:
        state["model"] = get_model_state_dict(model)
    else:
        state["model"], state["optimizer"] = get_state_dict(model, optimizer)
    state[_EXTRA_KEY] = io.BytesIO()
    _load_or_refuse(path, state, _SafeReader(path), _SafeLoadPlanner())
    set_state_dict(model, optimizer if optimizer is not None else (),
                   model_state_dict=state["model"], optim_state_dict=state.get("optimizer", {}))
    return state[_EXTRA_KEY]


def load_sharded_full(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Everything ``save_sharded`` wrote, as full CPU tensors in this process (no process group needed).

    ``{"model": {name: tensor}, "optimizer": {"state": {name: {...}}, "param_groups": [...]},
    "extra_state": {...}}`` (no ``optimizer`` when none was saved), names as ``get_state_dict`` spells
    them (Hugging Face names). What one learner loads from the shards of several: DCP reads every
    shard of every tensor (``_EmptyStateDictLoadPlanner``, as ``format_utils.dcp_to_torch_save``),
    through the same allow-listed readers as ``load_sharded``.
    """
    path = _complete_folder(path)
    state: dict[str, Any] = {}
    # dcp.load copies back only the keys the target already has; torch's own converter
    # (format_utils.dcp_to_torch_save) calls the loader underneath for the same reason.
    _load_or_refuse(path, state, _SafeReader(path), _SafeFullLoadPlanner(), load=_load_state_dict, no_dist=True)
    return state


def _complete_folder(path: str | os.PathLike[str]) -> str:
    """The absolute path of a DCP folder whose ``.metadata`` (written last) exists."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(os.path.join(path, DCP_METADATA_FILE)):
        raise FileNotFoundError(
            f"{path} is not a complete sharded checkpoint: {DCP_METADATA_FILE} is missing (expected a folder "
            "written by save_sharded; an interrupted save has shard files but no metadata)."
        )
    return path


def _load_or_refuse(path: str, state: dict[str, Any], reader: _SafeReader, planner: Any, *,
                    load: Callable[..., Any] = dcp.load, **kwargs: Any) -> None:
    try:
        load(state, storage_reader=reader, planner=planner, **kwargs)
    except (Exception, CheckpointException) as error:  # CheckpointException derives from BaseException
        # DCP gathers a rank's failure into its own exception (AssertionError, CheckpointException);
        # the refusal itself is kept by whichever of the two raised it.
        if reader.refused is not None:  # names the metadata file
            raise reader.refused from error
        if planner.refused is not None:
            raise CheckpointError(f"{path}: {planner.refused}") from error
        raise


class _SafeReader(dcp.FileSystemReader):
    refused: CheckpointError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        file = self._get_metadata_path(kwargs.get("rank"))
        try:
            # A regular file inside the folder, opened without blocking (never a FIFO or a device).
            fd = open_regular(file, root=self.path, what="DCP metadata")
            with os.fdopen(fd, "rb") as stream:
                metadata = MetadataUnpickler(stream).load()
        except FileNotFoundError:
            raise  # DCP probes for per-rank metadata files that a plain save does not write
        except CheckpointError as error:
            self.refused = error
            raise
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError) as error:
            self.refused = CheckpointError(
                f"{file} is not readable DCP metadata ({type(error).__name__}: {error}). The checkpoint is "
                "truncated, corrupt or was altered; nothing in it was run. Restore it from an intact copy."
            )
            raise self.refused from error
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self._check_storage(file, metadata)
        return metadata

    def _check_storage(self, file: Any, metadata: Any) -> None:
        """Every shard file the metadata names is a plain name in this folder, and a regular file.

        DCP reads ``folder / relative_path`` as written in the metadata: ``../other/__0_0.distcp`` or an
        absolute path would load another checkpoint's shards (or any file) unverified.
        """
        storage = getattr(metadata, "storage_data", None) or {}
        names = {getattr(info, "relative_path", None) for info in storage.values()}
        for name in sorted(names, key=repr):
            if not _plain_name(name):
                self.refused = CheckpointError(
                    f"{file}: a shard's storage path is {name!r}; expected a file name inside {self.path} (as "
                    "save_sharded writes, e.g. '__0_0.distcp'). The metadata points outside its folder, so the "
                    "checkpoint was altered; nothing was loaded. Restore it from an intact copy."
                )
                raise self.refused
            try:
                os.close(open_regular(os.path.join(self.path, name), root=self.path, what="a DCP shard"))
            except FileNotFoundError:
                continue  # DCP names the missing shard itself
            except CheckpointError as error:
                self.refused = error
                raise


def _plain_name(name: Any) -> bool:
    """A file name with no folder part (no separator, not ``.`` or ``..``, not absolute)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


class _SafeLoadPlanner(DefaultLoadPlanner):
    refused: CheckpointError | None = None

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = load_plain_bytes(value)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
            self.refused = CheckpointError(
                f"the entry {read_item.dest_index.fqn!r} of the DCP checkpoint is not plain data (expected "
                f"tensors and Python values; {load_error_reason(error)}); nothing in it was run. Restore the "
                "checkpoint from an intact copy."
            )
            raise self.refused from error
        if self.flatten_state_dict:  # the same placement as DefaultLoadPlanner.load_bytes
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class _SafeFullLoadPlanner(_SafeLoadPlanner, _EmptyStateDictLoadPlanner):
    """Rebuilds the whole state dict from the metadata (full tensors), bytes entries loaded safely."""
