"""What is flashrl's own (a save removes nothing else), and swapping a finished save into place.

A save deletes only what flashrl wrote (`own_folder`): an existing file or folder at ``path``,
``<path>.tmp`` or ``<path>.old`` that is not an empty folder, a checkpoint holding only the files its
manifest lists, or a marked interrupted save is a `CheckpointError` naming it. The finished folder
replaces an existing checkpoint in one ``renameat2(RENAME_EXCHANGE)`` on Linux (two renames elsewhere,
the old one at ``<path>.old`` in between), so a crash never leaves a mix of two saves.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat

from flashrl.checkpoints.files import (
    CheckpointError,
    file_kind,
    fsync_path,
    is_regular,
    read_json,
    remove_tree,
    tree_modes,
)
from flashrl.checkpoints.layout import MARKER, OLD_SUFFIX, SAVE_MARKER


def own_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder flashrl wrote and may remove: an empty folder, a save in progress
    (``SAVE_MARKER`` in it), or a checkpoint whose manifest lists every file in it.

    Removal (`remove_own`) deletes the markers last, so an interrupted removal stays recognisable.
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
        files = read_json(os.path.join(path, MARKER), root=path).get("files")
        if not isinstance(files, dict):
            return f"a folder whose {MARKER} lists no files"
        unlisted = [name for name, _ in tree_modes(path) if name != MARKER and name not in files]
    except (OSError, ValueError, AttributeError) as error:
        return f"unreadable as a checkpoint ({error})"
    return f"a checkpoint holding {unlisted[0]}, which its manifest does not list" if unlisted else None


def refuse_foreign(path: str, why: str) -> None:
    reason = _not_own(path) if os.path.lexists(path) else None
    if reason is not None:
        raise CheckpointError(
            f"{path} exists and is not a flashrl checkpoint ({reason}); {why}, and a save never deletes what "
            "flashrl did not write. Move it away or pass another path (a new or empty folder, or an earlier "
            "checkpoint to replace)."
        )


def remove_own(path: str) -> None:
    """Remove one of flashrl's folders (`own_folder`): everything but its markers first, the markers last."""
    if not os.path.lexists(path):
        return
    if not own_folder(path):
        raise CheckpointError(f"{path} is not flashrl's own folder; not removing it.")
    markers = (MARKER, SAVE_MARKER)
    for name in os.listdir(path):
        if name not in markers:
            remove_tree(os.path.join(path, name))
    for name in markers:
        remove_tree(os.path.join(path, name))
    os.rmdir(path)


# --------------------------------------------------------------------------------------------------
# Swapping a finished save into place
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


def move_into_place(tmp: str, path: str) -> None:
    """Move the finished folder ``tmp`` to ``path``; an existing one (flashrl's own) is swapped out, then removed."""
    parent = os.path.dirname(path)
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):  # tmp now holds the old checkpoint
        fsync_path(parent)
        remove_own(tmp)
    else:  # two renames: in between, the old checkpoint is at <path>.old (read_checkpoint says so)
        old = path + OLD_SUFFIX
        remove_own(old)
        os.rename(path, old)
        os.rename(tmp, path)
        fsync_path(parent)
        remove_own(old)
    fsync_path(parent)
