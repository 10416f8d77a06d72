"""Algorithm checkpoints: atomic, verified folders with the policy and everything to resume.

Layout (format 2)::

    <path>/flashrl_checkpoint.json   the manifest, written last: format, and every file's size and SHA-256
    <path>/config.json               FlashReinforceConfig.to_dict()
    <path>/algorithm_state.json      iteration, data cursors, lifetime counters
    <path>/learner/                  the learner group's ``save_state`` folder: one file, learner_state.pt
                                     (num_learners <= 1), or torch DCP shards, one per rank, and .metadata
                                     (num_learners >= 2: every rank writes its own, nothing is gathered)
    <path>/policy/                   the policy as a Hugging Face folder (transformers / vLLM load it);
                                     optional per save (``export_policy``)

The policy folder is what users deploy; the other files resume training exactly where it stopped
(in `sync_group` mode exactly; in `async` mode the episodes in flight and those waiting for a later
batch at save time are not saved, so the resumed run restarts the prompt stream after the last
started episode and the checkpoint books them as lost). A DCP learner folder restores on any number
of learners (DCP reshards; one learner reads every shard).

Writing is atomic, on one code path for every number of learners: everything goes into
``<path>.tmp`` (a stale one from an interrupted save is removed first), every file and folder is
fsynced, the manifest is written and fsynced last, and the folder is renamed into place (an existing
checkpoint at ``path`` is swapped out in one ``renameat2(RENAME_EXCHANGE)`` on Linux, then removed).
A crash at any point leaves ``path`` as it was (the previous checkpoint, or nothing) and never a mix
of two saves. Reading checks every file against the manifest before loading anything: a missing,
truncated or altered file is a `CheckpointError` naming it.

Periodic checkpoints (``record_checkpoint``) keep a ``latest`` file in their folder naming the newest
one (replaced atomically) and prune all but the newest ``keep_last_n``.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

FORMAT_VERSION = 2
"""Bumped when the layout changes incompatibly (2: learner/ folder, sharded learner state, manifest)."""
MARKER = "flashrl_checkpoint.json"
"""The manifest; a folder without it is not a checkpoint."""
POLICY_DIR = "policy"
CONFIG_FILE = "config.json"
LEARNER_DIR = "learner"
ALGORITHM_STATE_FILE = "algorithm_state.json"
LATEST_FILE = "latest"
"""In a folder of periodic checkpoints: the name of the newest one."""
TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
CHECKPOINT_NAME = re.compile(r"checkpoint_\d+")
"""Names of periodic checkpoints (``checkpoint_<iteration>``)."""
_CHUNK = 8 << 20


class CheckpointError(ValueError):
    """A folder that is not a (compatible) flashrl checkpoint, or a file in it that cannot be read safely."""


@dataclass
class Checkpoint:
    """A checkpoint folder, verified: its config and algorithm state loaded, where its learner state is."""

    path: str
    config: dict[str, Any]
    algorithm_state: dict[str, Any]
    learner_path: str
    """The learner group's ``save_state`` folder (``LearnerGroup.load_state`` reads it)."""
    manifest: dict[str, Any]


# --------------------------------------------------------------------------------------------------
# Writing
def write_checkpoint(
    path: str | os.PathLike[str],
    *,
    config: dict[str, Any],
    learner_group: Any,
    algorithm_state: dict[str, Any],
    export_policy: bool = True,
) -> str:
    """Write a checkpoint folder at ``path`` atomically (replacing one there); returns its absolute path.

    ``learner_group.save_state`` writes the learner state into ``learner/`` without gathering it (every
    rank of sharded learners writes its own DCP shard); ``export_policy`` adds the Hugging Face folder
    (``learner_group.save_policy``: sharded learners stream it to rank 0 bucket by bucket).
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, MARKER)):
        raise CheckpointError(
            f"{path} exists and is not a flashrl checkpoint (no {MARKER}); a save replaces the whole folder, "
            "so it refuses this one. Pass a new or empty folder, or an earlier checkpoint to replace."
        )
    tmp = path + TMP_SUFFIX
    _remove_tree(tmp)  # an interrupted save of this path
    os.makedirs(tmp)
    learner_group.save_state(os.path.join(tmp, LEARNER_DIR))
    if export_policy:
        learner_group.save_policy(os.path.join(tmp, POLICY_DIR))
    _write_json(os.path.join(tmp, CONFIG_FILE), config)
    _write_json(os.path.join(tmp, ALGORITHM_STATE_FILE), algorithm_state)
    learner = os.path.join(tmp, LEARNER_DIR)
    manifest = {
        "format_version": FORMAT_VERSION,
        "created_unix_ns": time.time_ns(),
        "iteration": algorithm_state.get("iteration"),
        "learner_layout": "dcp" if os.path.isfile(os.path.join(learner, ".metadata")) else "single_file",
        "num_learners": int(getattr(learner_group, "num_learners", 1)),
        "policy": export_policy,
        "files": _digest_tree(tmp),  # fsyncs every file on the way
    }
    _fsync_folders(tmp)
    # The manifest goes last: a folder without it is an interrupted save, never a checkpoint.
    _write_json(os.path.join(tmp, MARKER), manifest)
    fsync_path(tmp)
    _replace(tmp, path)
    return path


def record_checkpoint(folder: str | os.PathLike[str], path: str | os.PathLike[str],
                      *, keep_last_n: int | None = None) -> list[str]:
    """After a periodic save into ``folder``: point ``latest`` at ``path``, prune; returns what was removed.

    ``latest`` is replaced atomically (written beside it, fsynced, renamed). Pruning keeps the newest
    ``keep_last_n`` complete checkpoints named ``checkpoint_<N>`` by save time (not by name: after a
    resume from an older checkpoint the new saves are the newest ones) and never the one ``latest``
    names; each is renamed away before it is deleted, so a crash never leaves half of one. Leftovers of
    interrupted saves and deletions (``*.tmp``, ``*.old``) are removed too.
    """
    folder = os.path.abspath(os.fspath(folder))
    path = os.path.abspath(os.fspath(path))
    if os.path.dirname(path) != folder:
        raise ValueError(f"record_checkpoint: {path} is not a checkpoint in {folder}.")
    _write_text(os.path.join(folder, LATEST_FILE), os.path.basename(path) + "\n")
    fsync_path(folder)
    removed = []
    for name in sorted(os.listdir(folder)):
        base = name.removesuffix(TMP_SUFFIX).removesuffix(OLD_SUFFIX)
        if base != name and CHECKPOINT_NAME.fullmatch(base):  # an interrupted save or deletion
            _remove_tree(os.path.join(folder, name))
            removed.append(name)
    if keep_last_n is None:
        return removed
    if keep_last_n < 1:
        raise ValueError(f"keep_last_n must be >= 1 or None; got {keep_last_n}.")
    dated = []
    for name in os.listdir(folder):
        created = _created(os.path.join(folder, name)) if CHECKPOINT_NAME.fullmatch(name) else None
        if created is not None:
            dated.append((created, name))
    dated.sort(reverse=True)
    keep = {name for _, name in dated[:keep_last_n]} | {os.path.basename(path)}
    for _, name in dated:
        if name not in keep:
            old = os.path.join(folder, name + OLD_SUFFIX)
            os.rename(os.path.join(folder, name), old)  # gone at once; the files go after
            _remove_tree(old)
            removed.append(name)
    fsync_path(folder)
    return removed


def latest_checkpoint(folder: str | os.PathLike[str]) -> str | None:
    """The checkpoint the ``latest`` file of ``folder`` names, if it exists and has its manifest; else None."""
    folder = os.path.abspath(os.fspath(folder))
    try:
        with open(os.path.join(folder, LATEST_FILE), encoding="utf-8") as f:
            name = f.read().strip()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None
    if not CHECKPOINT_NAME.fullmatch(name):
        return None
    path = os.path.join(folder, name)
    return path if os.path.isfile(os.path.join(path, MARKER)) else None


# --------------------------------------------------------------------------------------------------
# Reading
def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Only the run's config dict, checked against the manifest (cheap; used by `from_checkpoint`)."""
    path, manifest = _check(path)
    verify_files(path, manifest, only=[CONFIG_FILE])
    return _read_json(os.path.join(path, CONFIG_FILE))


def read_checkpoint(path: str | os.PathLike[str], *, verify: bool = True) -> Checkpoint:
    """Check a checkpoint folder written by `write_checkpoint` and load its config and algorithm state.

    ``verify`` checks every file's size and SHA-256 against the manifest first (one read of the
    checkpoint); the learner state itself is loaded by ``LearnerGroup.load_state(checkpoint.learner_path)``.
    """
    path, manifest = _check(path)
    if verify:
        verify_files(path, manifest)
    else:
        verify_files(path, manifest, only=[CONFIG_FILE, ALGORITHM_STATE_FILE])
    return Checkpoint(
        path=path,
        config=_read_json(os.path.join(path, CONFIG_FILE)),
        algorithm_state=_read_json(os.path.join(path, ALGORITHM_STATE_FILE)),
        learner_path=os.path.join(path, LEARNER_DIR),
        manifest=manifest,
    )


def verify_files(path: str, manifest: dict[str, Any], *, only: list[str] | None = None) -> None:
    """Every file the manifest lists (or those in ``only``) has its recorded size and SHA-256."""
    files: dict[str, Any] = manifest.get("files") or {}
    names = sorted(files) if only is None else list(only)
    for name in names:
        if name not in files:
            raise CheckpointError(f"{path}: the manifest {MARKER} lists no {name}; the checkpoint is incomplete.")
    if not any(name.startswith(LEARNER_DIR + "/") for name in files):
        raise CheckpointError(f"{path}: the manifest {MARKER} lists no learner state files under {LEARNER_DIR}/.")

    def check(name: str) -> None:
        file, expected = os.path.join(path, *name.split("/")), files[name]
        try:
            size = os.path.getsize(file)
        except FileNotFoundError:
            raise CheckpointError(
                f"{file}: missing; the manifest lists it ({expected['size']} bytes). Restore the checkpoint "
                "from an intact copy."
            ) from None
        if size != expected["size"]:
            raise CheckpointError(
                f"{file}: {size} bytes, the manifest says {expected['size']} (truncated or altered). Restore "
                "the checkpoint from an intact copy; nothing was loaded from it."
            )
        digest = _sha256(file, sync=False)
        if digest != expected["sha256"]:
            raise CheckpointError(
                f"{file}: SHA-256 {digest}, the manifest says {expected['sha256']} (corrupt or altered). Restore "
                "the checkpoint from an intact copy; nothing was loaded from it."
            )

    _map(check, names)


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


def _check(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    path = os.path.abspath(os.fspath(path))
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        hint = ""
        if not os.path.exists(path) and os.path.isdir(path + OLD_SUFFIX):
            hint = f" {path + OLD_SUFFIX} holds the checkpoint that a save over it was replacing."
        raise CheckpointError(
            f"{path} is not a flashrl checkpoint: expected a file {MARKER} in it (written last by "
            f"save_to_path), found none. Pass the folder that save_to_path() returned.{hint}"
        )
    try:
        manifest = _read_json(marker)
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{marker} is not readable JSON ({error}); the checkpoint is corrupt.") from error
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        older = isinstance(version, int) and version < FORMAT_VERSION
        raise CheckpointError(
            f"{path}: checkpoint format {version!r}, this flashrl reads format {FORMAT_VERSION}. "
            + ("Format 1 (one gathered learner_state.pt, no manifest) was written by an earlier flashrl: "
               "resume it with that version, or export its policy/ folder and start from it as the model."
               if older else "Load it with the flashrl version that wrote it.")
        )
    return path, manifest


# --------------------------------------------------------------------------------------------------
# Files
def _digest_tree(root: str) -> dict[str, dict[str, Any]]:
    """``{relative path: {size, sha256}}`` of every file under ``root``, each fsynced."""
    names = []
    for folder, _, files in os.walk(root):
        for file in files:
            names.append(os.path.relpath(os.path.join(folder, file), root).replace(os.sep, "/"))
    names.sort()

    def one(name: str) -> dict[str, Any]:
        file = os.path.join(root, *name.split("/"))
        return {"size": os.path.getsize(file), "sha256": _sha256(file, sync=True)}

    return dict(zip(names, _map(one, names)))


def _map(fn: Any, items: list[str]) -> list[Any]:
    """``fn`` over ``items`` on threads (hashlib releases the GIL): checkpoints are read at disk speed."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(8, len(items), os.cpu_count() or 1)) as pool:
        return list(pool.map(fn, items))


def _sha256(file: str, *, sync: bool) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
        if sync:
            os.fsync(f.fileno())  # the writer's dirty pages of this file, whichever process wrote them
    return digest.hexdigest()


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a folder by its path (a folder: the entries renamed or created in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folders(root: str) -> None:
    for folder, _, _ in os.walk(root, topdown=False):
        fsync_path(folder)


def _write_json(path: str, data: Any) -> None:
    _write_text(path, json.dumps(data, indent=2, sort_keys=True))


def _write_text(path: str, text: str) -> None:
    """Write ``path`` beside itself, fsync, rename into place."""
    tmp = path + TMP_SUFFIX
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _created(path: str) -> int | None:
    """When a complete checkpoint was saved (its manifest's time, else the manifest file's); None if not one."""
    marker = os.path.join(path, MARKER)
    try:
        created = _read_json(marker).get("created_unix_ns")
        return int(created) if created is not None else os.stat(marker).st_mtime_ns
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def _remove_tree(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a filesystem without the flag
        return False
    raise OSError(code, os.strerror(code), a)


def _replace(tmp: str, path: str) -> None:
    """Move the finished folder ``tmp`` to ``path``; an existing ``path`` is swapped out, then removed."""
    parent = os.path.dirname(path)
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):  # tmp now holds the old checkpoint
        fsync_path(parent)
        _remove_tree(tmp)
    else:  # two renames: in between, the old checkpoint is at <path>.old (read_checkpoint says so)
        old = path + OLD_SUFFIX
        _remove_tree(old)
        os.rename(path, old)
        os.rename(tmp, path)
        fsync_path(parent)
        _remove_tree(old)
    fsync_path(parent)
