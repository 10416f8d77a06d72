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
``<path>.tmp`` (whose first file, ``SAVE_MARKER``, marks it as this module's own), every file and
folder is fsynced, the manifest is written and fsynced last, and the folder is renamed into place (an
existing checkpoint at ``path`` is swapped out in one ``renameat2(RENAME_EXCHANGE)`` on Linux, then
removed). A crash at any point leaves ``path`` as it was (the previous checkpoint, or nothing) and
never a mix of two saves. A save deletes only what flashrl wrote (`own_folder`): an existing file or
folder at ``path``, ``<path>.tmp`` or ``<path>.old`` that is not an empty folder, a checkpoint holding
only the files its manifest lists, or a marked interrupted save is a `CheckpointError` naming it.

The manifest is the only truth when reading. Restoring refuses a folder holding any file the manifest
does not list (it could be loaded in place of a listed one), reads only regular files (a FIFO, a
device, a socket, or a symlink leading out of the folder is refused before anything is opened for
reading; files are opened with ``O_NONBLOCK | O_NOFOLLOW``, so nothing blocks), checks every file's
size and SHA-256 before loading anything, and hands the learner the manifest's ``learner_layout``
(one state file, or DCP shards) instead of letting it guess from the files present.

Periodic checkpoints (``record_checkpoint``) keep a ``latest`` file in their folder naming the newest
one (replaced atomically) and prune all but the newest ``keep_last_n``. ``latest`` must be a regular
file naming a sibling ``checkpoint_<N>``; anything else there (a FIFO, a folder, a link out) is an error.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from flashrl.checkpoint_files import (
    CheckpointError,
    check_regular,
    file_kind,
    is_regular,
    load_error_reason,
    load_tensor_file,
    open_regular,
    tree_modes,
)

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "check_listed",
    "fsync_path",
    "latest_checkpoint",
    "load_error_reason",
    "load_tensor_file",
    "manifest_layout",
    "open_regular",
    "own_folder",
    "read_checkpoint",
    "read_config",
    "record_checkpoint",
    "verify_files",
    "write_checkpoint",
]

FORMAT_VERSION = 2
"""Bumped when the layout changes incompatibly (2: learner/ folder, sharded learner state, manifest)."""
MARKER = "flashrl_checkpoint.json"
"""The manifest; a folder without it is not a checkpoint."""
SAVE_MARKER = ".flashrl_save_in_progress"
"""The first file of a save's ``<path>.tmp`` folder (removed just before the rename): marks it as flashrl's."""
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
SINGLE_FILE_LAYOUT = "single_file"
DCP_LAYOUT = "dcp"
LAYOUT_FILES = {SINGLE_FILE_LAYOUT: "learner_state.pt", DCP_LAYOUT: ".metadata"}
"""The manifest's ``learner_layout`` -> the file in ``learner/`` that makes it (one state file, or DCP's
metadata beside its shards); a checkpoint lists exactly one of the two."""
_CHUNK = 8 << 20
_MAX_LATEST_BYTES = 4096


@dataclass
class Checkpoint:
    """A checkpoint folder, verified: its config and algorithm state loaded, where its learner state is."""

    path: str
    config: dict[str, Any]
    algorithm_state: dict[str, Any]
    learner_path: str
    """The learner group's ``save_state`` folder (``LearnerGroup.load_state`` reads it)."""
    manifest: dict[str, Any]
    learner_layout: str = SINGLE_FILE_LAYOUT
    """The manifest's: ``single_file`` or ``dcp``; pass it to ``LearnerGroup.load_state(layout=...)``."""


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
    (``learner_group.save_policy``: sharded learners stream it to rank 0 bucket by bucket). Only what
    flashrl wrote is ever replaced or removed (`own_folder`); anything else at ``path``, ``<path>.tmp``
    or ``<path>.old`` is a `CheckpointError` naming it, raised before anything is written.
    """
    path = os.path.abspath(os.fspath(path))
    tmp, old = path + TMP_SUFFIX, path + OLD_SUFFIX
    _refuse_foreign(path, "a save replaces the whole folder at its path")
    _refuse_foreign(tmp, "a save writes into this temporary folder first and removes an interrupted one")
    _refuse_foreign(old, "a save over a checkpoint may move the old one here and remove it")
    _remove_own(tmp)  # an interrupted save of this path
    os.makedirs(tmp)
    os.close(os.open(os.path.join(tmp, SAVE_MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL))  # first: ours
    fsync_path(tmp)
    learner_group.save_state(os.path.join(tmp, LEARNER_DIR))
    if export_policy:
        learner_group.save_policy(os.path.join(tmp, POLICY_DIR))
    _write_json(os.path.join(tmp, CONFIG_FILE), config)
    _write_json(os.path.join(tmp, ALGORITHM_STATE_FILE), algorithm_state)
    files = _digest_tree(tmp)  # fsyncs every file on the way
    manifest = {
        "format_version": FORMAT_VERSION,
        "created_unix_ns": time.time_ns(),
        "iteration": algorithm_state.get("iteration"),
        "learner_layout": _written_layout(tmp, files),
        "num_learners": int(getattr(learner_group, "num_learners", 1)),
        "policy": export_policy,
        "files": files,
    }
    _fsync_folders(tmp)
    # The manifest goes last: a folder without it is an interrupted save, never a checkpoint.
    _write_json(os.path.join(tmp, MARKER), manifest)
    os.remove(os.path.join(tmp, SAVE_MARKER))  # the manifest now marks it, and lists every file left
    fsync_path(tmp)
    _replace(tmp, path)
    return path


def _written_layout(tmp: str, files: dict[str, Any]) -> str:
    found = [layout for layout, name in LAYOUT_FILES.items() if f"{LEARNER_DIR}/{name}" in files]
    if len(found) != 1:
        raise CheckpointError(
            f"{os.path.join(tmp, LEARNER_DIR)}: expected exactly one of {sorted(LAYOUT_FILES.values())} from the "
            f"learner group's save_state, found {found or 'neither'}; the save was not completed."
        )
    return found[0]


def record_checkpoint(folder: str | os.PathLike[str], path: str | os.PathLike[str],
                      *, keep_last_n: int | None = None) -> list[str]:
    """After a periodic save into ``folder``: point ``latest`` at ``path``, prune; returns what was removed.

    ``latest`` is replaced atomically (written beside it, fsynced, renamed). Pruning keeps the newest
    ``keep_last_n`` complete checkpoints named ``checkpoint_<N>`` by save time (not by name: after a
    resume from an older checkpoint the new saves are the newest ones) and never the one ``latest``
    names; each is renamed away before it is deleted, so a crash never leaves half of one. Leftovers of
    interrupted saves and deletions (``*.tmp``, ``*.old``) are removed too. Only flashrl's own folders
    are removed (`own_folder`): a checkpoint holding a file its manifest does not list stays, as does a
    ``*.tmp`` folder flashrl did not mark.
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
        leftover = os.path.join(folder, name)
        if base != name and CHECKPOINT_NAME.fullmatch(base) and own_folder(leftover):  # an interrupted save
            _remove_own(leftover)
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
        if name not in keep and own_folder(os.path.join(folder, name)):
            old = os.path.join(folder, name + OLD_SUFFIX)
            if os.path.lexists(old):
                continue  # not ours (own ones were removed above): never replaced
            os.rename(os.path.join(folder, name), old)  # gone at once; the files go after
            _remove_own(old)
            removed.append(name)
    fsync_path(folder)
    return removed


def latest_checkpoint(folder: str | os.PathLike[str]) -> str | None:
    """The checkpoint the ``latest`` file of ``folder`` names, if it exists and has its manifest; else None.

    ``latest`` must be a regular file (read without blocking, never through a link out of ``folder``)
    holding a ``checkpoint_<N>`` name; a FIFO, a folder or a device there is a `CheckpointError`.
    """
    folder = os.path.abspath(os.fspath(folder))
    latest = os.path.join(folder, LATEST_FILE)
    if not os.path.lexists(latest):
        return None
    try:
        with os.fdopen(open_regular(latest, root=folder, what="the pointer to the newest checkpoint"), "rb") as f:
            name = f.read(_MAX_LATEST_BYTES).decode("utf-8").strip()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None
    if not CHECKPOINT_NAME.fullmatch(name):
        return None
    path = os.path.join(folder, name)
    return path if os.path.isdir(path) and is_regular(os.path.join(path, MARKER)) else None


# --------------------------------------------------------------------------------------------------
# Reading
def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Only the run's config dict, checked against the manifest (cheap; used by `from_checkpoint`)."""
    path, manifest = _check(path)
    check_listed(path, manifest)
    verify_files(path, manifest, only=[CONFIG_FILE])
    return _read_json(os.path.join(path, CONFIG_FILE), root=path)


def read_checkpoint(path: str | os.PathLike[str], *, verify: bool = True) -> Checkpoint:
    """Check a checkpoint folder written by `write_checkpoint` and load its config and algorithm state.

    The folder must hold exactly the files its manifest lists, each a regular file (`check_listed`);
    ``verify`` checks every file's size and SHA-256 against the manifest too (one read of the
    checkpoint). The learner state itself is loaded by
    ``LearnerGroup.load_state(checkpoint.learner_path, layout=checkpoint.learner_layout)``.
    """
    path, manifest = _check(path)
    check_listed(path, manifest)
    layout = manifest_layout(path, manifest)
    if verify:
        verify_files(path, manifest)
    else:
        verify_files(path, manifest, only=[CONFIG_FILE, ALGORITHM_STATE_FILE])
    return Checkpoint(
        path=path,
        config=_read_json(os.path.join(path, CONFIG_FILE), root=path),
        algorithm_state=_read_json(os.path.join(path, ALGORITHM_STATE_FILE), root=path),
        learner_path=os.path.join(path, LEARNER_DIR),
        manifest=manifest,
        learner_layout=layout,
    )


def check_listed(path: str, manifest: dict[str, Any]) -> None:
    """The folder ``path`` holds only files the manifest lists, and each is a regular file inside it.

    A file it does not list (say DCP shards beside a single learner's state file, or the reverse) is
    refused rather than ignored: loaders pick files by name, and an unlisted one would be loaded
    unverified. Nothing is opened here (``lstat`` only).
    """
    files: dict[str, Any] = manifest.get("files") or {}
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: the manifest {MARKER} has no file table; the checkpoint is corrupt.")
    for name, mode in tree_modes(path):
        file = os.path.join(path, *name.split("/"))
        if name != MARKER and name not in files:
            raise CheckpointError(
                f"{file}: not listed in the manifest {MARKER}. A checkpoint folder holds only the files its "
                "manifest lists, and restoring refuses anything else (a loader could pick it up unverified). "
                "Move the file out of the checkpoint, or restore the checkpoint from an intact copy."
            )
        check_regular(file, mode, root=path)


def manifest_layout(path: str, manifest: dict[str, Any]) -> str:
    """The manifest's ``learner_layout``, checked against the learner files it lists."""
    layout = manifest.get("learner_layout")
    if layout not in LAYOUT_FILES:
        raise CheckpointError(
            f"{path}: the manifest {MARKER} says learner_layout {layout!r}, expected one of "
            f"{sorted(LAYOUT_FILES)}. The checkpoint is corrupt; restore it from an intact copy."
        )
    listed = [name for name in LAYOUT_FILES.values() if f"{LEARNER_DIR}/{name}" in (manifest.get("files") or {})]
    if listed != [LAYOUT_FILES[layout]]:
        raise CheckpointError(
            f"{path}: the manifest {MARKER} says learner_layout {layout!r} (learner/{LAYOUT_FILES[layout]}) but "
            f"lists {['learner/' + n for n in listed] or 'neither learner file'}. The checkpoint is corrupt; "
            "restore it from an intact copy."
        )
    return layout


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
            fd = open_regular(file, root=path)
        except FileNotFoundError:
            raise CheckpointError(
                f"{file}: missing; the manifest lists it ({expected['size']} bytes). Restore the checkpoint "
                "from an intact copy."
            ) from None
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != expected["size"]:
                raise CheckpointError(
                    f"{file}: {size} bytes, the manifest says {expected['size']} (truncated or altered). Restore "
                    "the checkpoint from an intact copy; nothing was loaded from it."
                )
            digest = _sha256_of(f)
        if digest != expected["sha256"]:
            raise CheckpointError(
                f"{file}: SHA-256 {digest}, the manifest says {expected['sha256']} (corrupt or altered). Restore "
                "the checkpoint from an intact copy; nothing was loaded from it."
            )

    _map(check, names)


def _check(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    path = os.path.abspath(os.fspath(path))
    marker = os.path.join(path, MARKER)
    if not os.path.isdir(path) or not os.path.lexists(marker):
        hint = ""
        if not os.path.exists(path) and os.path.isdir(path + OLD_SUFFIX):
            hint = f" {path + OLD_SUFFIX} holds the checkpoint that a save over it was replacing."
        raise CheckpointError(
            f"{path} is not a flashrl checkpoint: expected a file {MARKER} in it (written last by "
            f"save_to_path), found none. Pass the folder that save_to_path() returned.{hint}"
        )
    try:
        manifest = _read_json(marker, root=path)
    except (ValueError, UnicodeDecodeError) as error:
        if isinstance(error, CheckpointError):
            raise
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
# What is flashrl's own (a save removes nothing else)
def own_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder flashrl wrote and may remove: an empty folder, a save in progress
    (``SAVE_MARKER`` in it), or a checkpoint whose manifest lists every file in it.

    Removal (`_remove_own`) deletes the markers last, so an interrupted removal stays recognisable.
    """
    return _not_own(os.fspath(path)) is None


def _not_own(path: str) -> str | None:
    """Why ``path`` is not one of flashrl's folders (`own_folder`); None when it is."""
    try:
        mode = os.lstat(path).st_mode
        if not stat.S_ISDIR(mode):
            return f"{file_kind(mode)}, not a folder"
        if not os.listdir(path) or is_regular(os.path.join(path, SAVE_MARKER)):
            return None
        if not os.path.lexists(os.path.join(path, MARKER)):
            return f"a folder without {MARKER}"
        files = _read_json(os.path.join(path, MARKER), root=path).get("files")
        if not isinstance(files, dict):
            return f"a folder whose {MARKER} lists no files"
        unlisted = [name for name, _ in tree_modes(path) if name != MARKER and name not in files]
    except (OSError, ValueError, AttributeError) as error:
        return f"unreadable as a checkpoint ({error})"
    return f"a checkpoint holding {unlisted[0]}, which its manifest does not list" if unlisted else None


def _refuse_foreign(path: str, why: str) -> None:
    reason = _not_own(path) if os.path.lexists(path) else None
    if reason is not None:
        raise CheckpointError(
            f"{path} exists and is not a flashrl checkpoint ({reason}); {why}, and a save never deletes what "
            "flashrl did not write. Move it away or pass another path (a new or empty folder, or an earlier "
            "checkpoint to replace)."
        )


def _remove_own(path: str) -> None:
    """Remove one of flashrl's folders (`own_folder`): everything but its markers first, the markers last."""
    if not os.path.lexists(path):
        return
    if not own_folder(path):
        raise CheckpointError(f"{path} is not flashrl's own folder; not removing it.")
    markers = (MARKER, SAVE_MARKER)
    for name in os.listdir(path):
        if name not in markers:
            _remove_tree(os.path.join(path, name))
    for name in markers:
        _remove_tree(os.path.join(path, name))
    os.rmdir(path)


# --------------------------------------------------------------------------------------------------
# Files
def _digest_tree(root: str) -> dict[str, dict[str, Any]]:
    """``{relative path: {size, sha256}}`` of every file under ``root`` but the save marker, each fsynced."""
    names = []
    for folder, _, files in os.walk(root):
        for file in files:
            names.append(os.path.relpath(os.path.join(folder, file), root).replace(os.sep, "/"))
    names = sorted(name for name in names if name != SAVE_MARKER)

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
    with open(file, "rb") as f:
        digest = _sha256_of(f)
        if sync:
            os.fsync(f.fileno())  # the writer's dirty pages of this file, whichever process wrote them
    return digest


def _sha256_of(f: Any) -> str:
    digest = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        digest.update(chunk)
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


def _read_json(path: str, *, root: str) -> Any:
    """A JSON file of a checkpoint, read through `open_regular` (a regular file inside ``root``)."""
    with os.fdopen(open_regular(path, root=root), "rb") as f:
        return json.loads(f.read().decode("utf-8"))


def _created(path: str) -> int | None:
    """When a complete checkpoint was saved (its manifest's time, else the manifest file's); None if not one."""
    marker = os.path.join(path, MARKER)
    try:
        created = _read_json(marker, root=path).get("created_unix_ns")
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
    """Move the finished folder ``tmp`` to ``path``; an existing one (flashrl's own) is swapped out, then removed."""
    parent = os.path.dirname(path)
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):  # tmp now holds the old checkpoint
        fsync_path(parent)
        _remove_own(tmp)
    else:  # two renames: in between, the old checkpoint is at <path>.old (read_checkpoint says so)
        old = path + OLD_SUFFIX
        _remove_own(old)
        os.rename(path, old)
        os.rename(tmp, path)
        fsync_path(parent)
        _remove_own(old)
    fsync_path(parent)
