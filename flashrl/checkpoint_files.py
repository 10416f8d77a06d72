"""Reading a checkpoint's files as untrusted input: regular files inside its folder, never blocking.

A checkpoint folder comes from wherever it was copied. Every file flashrl reads from one goes through
`open_regular`: the path is resolved and must stay inside the folder (a symlink out is refused), it
must be a regular file (a FIFO, a device such as ``/dev/zero``, a socket or a folder is refused before
it is opened for reading), and it is opened with ``O_NONBLOCK | O_NOFOLLOW`` and checked again on the
descriptor. Torch state files are loaded weights-only (`load_tensor_file`): no code runs from them.
"""

from __future__ import annotations

import os
import pickle
import stat
from typing import Any

import torch


class CheckpointError(ValueError):
    """A folder that is not a (compatible) flashrl checkpoint, or a file in it that cannot be read safely."""


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
