"""A checkpoint's manifest: every file's size and SHA-256, written last and the only truth when reading.

Writing hashes every file (fsyncing it on the way) into the manifest's file table; reading refuses a
folder holding a file the table does not list, or one that is not a regular file inside it
(`check_listed`, ``lstat`` only), and checks every listed file's size and SHA-256 before anything is
loaded (`verify_files`). The manifest's ``learner_layout`` says how the learner state was written.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flashrl.checkpoints.files import CheckpointError, check_regular, open_regular, read_json, tree_modes
from flashrl.checkpoints.layout import (
    FORMAT_VERSION,
    LAYOUT_FILES,
    LEARNER_DIR,
    MARKER,
    OLD_SUFFIX,
    SAVE_MARKER,
)

_CHUNK = 8 << 20


# --------------------------------------------------------------------------------------------------
# Writing
def digest_tree(root: str) -> dict[str, dict[str, Any]]:
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


def written_layout(tmp: str, files: dict[str, Any]) -> str:
    """The ``learner_layout`` a save wrote: the one of ``LAYOUT_FILES`` in ``files``; exactly one must be."""
    found = [layout for layout, name in LAYOUT_FILES.items() if f"{LEARNER_DIR}/{name}" in files]
    if len(found) != 1:
        raise CheckpointError(
            f"{os.path.join(tmp, LEARNER_DIR)}: expected exactly one of {sorted(LAYOUT_FILES.values())} from the "
            f"learner group's save_state, found {found or 'neither'}; the save was not completed."
        )
    return found[0]


# --------------------------------------------------------------------------------------------------
# Reading
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


def read_manifest(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """``(absolute path, manifest)`` of a checkpoint folder; a `CheckpointError` unless its manifest is
    readable JSON of this format (nothing else in the folder is checked here)."""
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
        manifest = read_json(marker, root=path)
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


def created_ns(path: str) -> int | None:
    """When a complete checkpoint was saved (its manifest's time, else the manifest file's); None if not one."""
    marker = os.path.join(path, MARKER)
    try:
        created = read_json(marker, root=path).get("created_unix_ns")
        return int(created) if created is not None else os.stat(marker).st_mtime_ns
    except (OSError, ValueError, AttributeError, TypeError):
        return None
