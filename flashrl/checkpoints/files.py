"""A checkpoint's files: read as untrusted input (regular files inside its folder, never blocking),
written durably (fsynced, renamed into place).

A checkpoint folder comes from wherever it was copied. Every file flashrl reads from one goes through
`open_regular`: the path is resolved and must stay inside the folder (a symlink out is refused), it
must be a regular file (a FIFO, a device such as ``/dev/zero``, a socket or a folder is refused before
it is opened for reading), and it is opened with ``O_NONBLOCK | O_NOFOLLOW`` and checked again on the
descriptor. What is unpickled from those files is loaded through allow-lists
(``flashrl.checkpoints.safe_load``): no code runs from them.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from typing import Any

from flashrl.checkpoints.layout import TMP_SUFFIX


class CheckpointError(ValueError):
    """A folder that is not a (compatible) flashrl checkpoint, or a file in it that cannot be read safely."""


# --------------------------------------------------------------------------------------------------
# Reading untrusted files
def open_regular(file: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None,
                 what: str = "a checkpoint file") -> int:
    """A read-only descriptor of ``file``; a `CheckpointError` unless it is a regular file (inside ``root``).

    Nothing here blocks or reads a device: the path is resolved and ``stat``-ed first (a symlink must
    stay inside ``root``; a FIFO, device, socket or folder is refused unopened), then opened with
    ``O_NONBLOCK | O_NOFOLLOW`` and checked again on the descriptor (a swap in between is refused too).
    A missing file raises FileNotFoundError for the caller to name.
    """
    file = os.fspath(file)
    real = resolve_inside(file, root, what)
    check_regular(file, os.stat(real).st_mode, what=what)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise CheckpointError(f"{file}: cannot be opened as {what} ({error.strerror}).") from error
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        check_regular(file, mode, what=what)
    return fd


def tree_modes(root: str) -> list[tuple[str, int]]:
    """``(relative path, lstat mode)`` of everything under ``root`` but folders; links are not followed."""
    found = []
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                found += [(f"{entry.name}/{name}", mode) for name, mode in tree_modes(entry.path)]
            else:
                found.append((entry.name, entry.stat(follow_symlinks=False).st_mode))
    return sorted(found)


def resolve_inside(file: str, root: str | os.PathLike[str] | None, what: str) -> str:
    """``file`` with every link resolved; a `CheckpointError` if that leads out of ``root``."""
    real = os.path.realpath(file)
    if root is not None:
        top = os.path.realpath(os.fspath(root))
        if real != top and not real.startswith(top.rstrip(os.sep) + os.sep):
            raise CheckpointError(
                f"{file}: a symlink to {real}, outside {os.fspath(root)}. Expected {what} as a regular file "
                "inside it; a checkpoint never reads through a link out of its folder. Replace the link by a "
                "copy of the file."
            )
    return real


def file_kind(mode: int) -> str:
    kinds = [(stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"),
             (stat.S_ISREG, "a regular file")]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def check_regular(file: str, mode: int, *, root: str | None = None, what: str = "a checkpoint file") -> None:
    """Refuse ``file`` (of ``lstat`` mode ``mode``) unless it is a regular file or a link to one in ``root``."""
    if stat.S_ISLNK(mode) and root is not None:
        real = resolve_inside(file, root, what)
        try:
            mode = os.stat(real).st_mode
        except FileNotFoundError:
            raise CheckpointError(f"{file}: a symlink to {real}, which does not exist.") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(
            f"{file} is {file_kind(mode)}; expected {what} as a regular file. flashrl never reads from FIFOs, "
            "devices or sockets (a read could block forever or never end). Restore the checkpoint from an "
            "intact copy."
        )


def is_regular(file: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(file).st_mode)
    except OSError:
        return False


def read_json(path: str, *, root: str) -> Any:
    """A JSON file of a checkpoint, read through `open_regular` (a regular file inside ``root``)."""
    with os.fdopen(open_regular(path, root=root), "rb") as f:
        return json.loads(f.read().decode("utf-8"))


# --------------------------------------------------------------------------------------------------
# Writing durably
def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a folder by its path (a folder: the entries renamed or created in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folders(root: str) -> None:
    for folder, _, _ in os.walk(root, topdown=False):
        fsync_path(folder)


def write_json(path: str, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=True))


def write_text(path: str, text: str) -> None:
    """Write ``path`` beside itself, fsync, rename into place."""
    tmp = path + TMP_SUFFIX
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_tree(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
