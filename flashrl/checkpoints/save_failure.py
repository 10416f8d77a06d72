"""A save that the disk refused (full, failing, read-only, no permission): one error that says so.

Writing a checkpoint fails in whichever writer hits the disk first: ``open``/``write`` raise an
`OSError` (``ENOSPC``, ``EIO``, ``EACCES``, ``EROFS``, ``EDQUOT``), torch's zip writer a `RuntimeError`
such as ``[enforce fail at inline_container.cc:672] unexpected pos`` that names nothing. `save_failure`
turns either into a `CheckpointSaveError` naming the checkpoint's path, the free space on its disk and
the checkpoint's size (the newest complete sibling's, from its manifest, else what this save wrote
before it failed); `write_checkpoint` raises it after removing its partial ``<path>.tmp``.
`remove_interrupted_saves` removes the ``.tmp`` and ``.old`` folders flashrl left in a folder of
periodic checkpoints (a resumed run calls it before it needs the space).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Collection

from flashrl.checkpoints.files import read_json
from flashrl.checkpoints.layout import CHECKPOINT_NAME, MARKER, OLD_SUFFIX, TMP_SUFFIX
from flashrl.checkpoints.ownership import own_folder, remove_own

__all__ = ["CheckpointSaveError", "is_disk_error", "remove_interrupted_saves", "save_failure"]

_TORCH_WRITE_ERRORS = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")
"""What torch's zip writer says when a write fails (it keeps no errno)."""


class CheckpointSaveError(OSError):
    """A checkpoint could not be written (disk full, I/O error, no permission); nothing partial is left."""


def is_disk_error(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) is the disk refusing a write: an `OSError`, or
    torch's zip writer failing (a `RuntimeError` without an errno)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) or any(text in str(error) for text in _TORCH_WRITE_ERRORS):
            return True
        error = error.__cause__ or error.__context__
    return False


def save_failure(path: str, tmp: str, error: BaseException) -> CheckpointSaveError:
    """The error to raise for a save of ``path`` (written into ``tmp``) that ``error`` stopped; removes
    the partial ``tmp`` (flashrl's own, `remove_own`) after measuring what it had written."""
    written, free = _tree_bytes(tmp), _free_bytes(os.path.dirname(path))  # what the failed save met
    try:
        remove_own(tmp)
        removed = f"The partial {os.path.basename(tmp)} was removed."
    except OSError as again:  # a failing disk may refuse this too: the user removes it
        removed = f"The partial {tmp} could not be removed ({again.strerror}); delete it by hand."
    previous = _newest_sibling_bytes(path)
    if previous is not None:
        size = f"the previous checkpoint is {_gib(previous)}"
    else:
        size = f"this save had written {_gib(written)} before it failed (the checkpoint is larger)"
    code = _errno(error)
    cause = os.strerror(code) if code else f"{type(error).__name__}: {error}"
    if code in (errno.ENOSPC, errno.EDQUOT) or (free is not None and previous is not None and free < previous):
        fix = "free space there, or set checkpoint_dir to a disk with room"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "make the folder writable by this user, or set checkpoint_dir to a writable folder"
    else:
        fix = "check the disk (dmesg shows I/O errors), or set checkpoint_dir to another disk"
    free_text = "unknown" if free is None else _gib(free)
    return CheckpointSaveError(
        code or errno.EIO,
        f"Saving the checkpoint {path} failed: {cause}. Free space on its disk: {free_text}; {size}. "
        f"{removed} Fix: {fix}.",
        path,
    )


def remove_interrupted_saves(folder: str | os.PathLike[str], *, names: Collection[str] = ()) -> list[str]:
    """Remove the leftovers of interrupted saves and prunings in ``folder`` (``checkpoint_<N>.tmp``,
    ``checkpoint_<N>.old``, and those of the checkpoints called ``names``) that flashrl wrote (`own_folder`);
    returns their names. Anything else stays."""
    folder = os.fspath(folder)
    removed = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        base = name.removesuffix(TMP_SUFFIX).removesuffix(OLD_SUFFIX)
        leftover = os.path.join(folder, name)
        ours = CHECKPOINT_NAME.fullmatch(base) or base in names
        if base != name and ours and own_folder(leftover):
            remove_own(leftover)
            removed.append(name)
    return removed


def _errno(error: BaseException | None) -> int | None:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno:
            return int(error.errno)
        error = error.__cause__ or error.__context__
    return None


def _tree_bytes(root: str) -> int:
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass  # removed meanwhile: not part of what is left
    return total


def _free_bytes(folder: str) -> int | None:
    while folder and not os.path.isdir(folder):  # the nearest existing folder is on the same disk
        folder = os.path.dirname(folder)
    try:
        return shutil.disk_usage(folder or os.sep).free
    except OSError:
        return None


def _newest_sibling_bytes(path: str) -> int | None:
    """The size of the newest complete checkpoint beside ``path`` (its manifest's file sizes), or None."""
    folder, best = os.path.dirname(path), None
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    for name in names:
        if not CHECKPOINT_NAME.fullmatch(name) and name != "checkpoint_final":
            continue
        try:
            manifest = read_json(os.path.join(folder, name, MARKER), root=os.path.join(folder, name))
            created, files = int(manifest["created_unix_ns"]), manifest["files"]
            size = sum(int(entry["size"]) for entry in files.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # not a complete checkpoint
        if best is None or created > best[0]:
            best = (created, size)
    return None if best is None else best[1]


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB ({num_bytes} bytes)"
