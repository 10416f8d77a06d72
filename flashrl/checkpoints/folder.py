"""An algorithm checkpoint folder: written atomically, read after verifying it, the newest one found.

The layout and the guarantees are the package's (``flashrl.checkpoints``); this module puts the
pieces together: `write_checkpoint` (the learner group writes ``learner/`` and ``policy/``, the rest
is written here, hashed into the manifest and swapped into place), `read_checkpoint` and
`read_config` (the manifest checked before anything is loaded), `record_checkpoint` and
`latest_checkpoint` (the ``latest`` pointer of periodic checkpoints, pruning).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from flashrl.checkpoints.files import (
    fsync_folders,
    fsync_path,
    is_regular,
    open_regular,
    read_json,
    write_json,
    write_text,
)
from flashrl.checkpoints.layout import (
    ALGORITHM_STATE_FILE,
    CHECKPOINT_NAME,
    CONFIG_FILE,
    FORMAT_VERSION,
    LATEST_FILE,
    LEARNER_DIR,
    MARKER,
    OLD_SUFFIX,
    POLICY_DIR,
    SAVE_MARKER,
    SINGLE_FILE_LAYOUT,
    TMP_SUFFIX,
)
from flashrl.checkpoints.manifest import (
    check_listed,
    created_ns,
    digest_tree,
    manifest_layout,
    read_manifest,
    verify_files,
    written_layout,
)
from flashrl.checkpoints.ownership import move_into_place, own_folder, refuse_foreign, remove_own
from flashrl.checkpoints.save_failure import is_disk_error, remove_interrupted_saves, save_failure

__all__ = [
    "Checkpoint",
    "latest_checkpoint",
    "read_checkpoint",
    "read_config",
    "record_checkpoint",
    "write_checkpoint",
]

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
    refuse_foreign(path, "a save replaces the whole folder at its path")
    refuse_foreign(tmp, "a save writes into this temporary folder first and removes an interrupted one")
    refuse_foreign(old, "a save over a checkpoint may move the old one here and remove it")
    remove_own(tmp)  # an interrupted save of this path
    try:
        _write_into(tmp, config=config, learner_group=learner_group, algorithm_state=algorithm_state,
                    export_policy=export_policy)
    except Exception as error:
        if not is_disk_error(error):
            raise
        # The partial save is measured, then removed: the disk it filled gets its space back, and a
        # resume never trips over it.
        raise save_failure(path, tmp, error) from error
    move_into_place(tmp, path)
    return path


def _write_into(tmp: str, *, config: dict[str, Any], learner_group: Any, algorithm_state: dict[str, Any],
                export_policy: bool) -> None:
    """Everything of a save into ``tmp``, the manifest last; `write_checkpoint` moves it into place."""
    os.makedirs(tmp)
    os.close(os.open(os.path.join(tmp, SAVE_MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL))  # first: ours
    fsync_path(tmp)
    learner_group.save_state(os.path.join(tmp, LEARNER_DIR))
    if export_policy:
        learner_group.save_policy(os.path.join(tmp, POLICY_DIR))
    write_json(os.path.join(tmp, CONFIG_FILE), config)
    write_json(os.path.join(tmp, ALGORITHM_STATE_FILE), algorithm_state)
    files = digest_tree(tmp)  # fsyncs every file on the way
    manifest = {
        "format_version": FORMAT_VERSION,
        "created_unix_ns": time.time_ns(),
        "iteration": algorithm_state.get("iteration"),
        "learner_layout": written_layout(tmp, files),
        "num_learners": int(getattr(learner_group, "num_learners", 1)),
        "policy": export_policy,
        "files": files,
    }
    fsync_folders(tmp)
    # The manifest goes last: a folder without it is an interrupted save, never a checkpoint.
    write_json(os.path.join(tmp, MARKER), manifest)
    os.remove(os.path.join(tmp, SAVE_MARKER))  # the manifest now marks it, and lists every file left
    fsync_path(tmp)


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
    write_text(os.path.join(folder, LATEST_FILE), os.path.basename(path) + "\n")
    fsync_path(folder)
    removed = remove_interrupted_saves(folder)
    if keep_last_n is None:
        return removed
    if keep_last_n < 1:
        raise ValueError(f"keep_last_n must be >= 1 or None; got {keep_last_n}.")
    dated = []
    for name in os.listdir(folder):
        created = created_ns(os.path.join(folder, name)) if CHECKPOINT_NAME.fullmatch(name) else None
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
            remove_own(old)
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
    path, manifest = read_manifest(path)
    check_listed(path, manifest)
    verify_files(path, manifest, only=[CONFIG_FILE])
    return read_json(os.path.join(path, CONFIG_FILE), root=path)


def read_checkpoint(path: str | os.PathLike[str], *, verify: bool = True) -> Checkpoint:
    """Check a checkpoint folder written by `write_checkpoint` and load its config and algorithm state.

    The folder must hold exactly the files its manifest lists, each a regular file (`check_listed`);
    ``verify`` checks every file's size and SHA-256 against the manifest too (one read of the
    checkpoint). The learner state itself is loaded by
    ``LearnerGroup.load_state(checkpoint.learner_path, layout=checkpoint.learner_layout)``.
    """
    path, manifest = read_manifest(path)
    check_listed(path, manifest)
    layout = manifest_layout(path, manifest)
    if verify:
        verify_files(path, manifest)
    else:
        verify_files(path, manifest, only=[CONFIG_FILE, ALGORITHM_STATE_FILE])
    return Checkpoint(
        path=path,
        config=read_json(os.path.join(path, CONFIG_FILE), root=path),
        algorithm_state=read_json(os.path.join(path, ALGORITHM_STATE_FILE), root=path),
        learner_path=os.path.join(path, LEARNER_DIR),
        manifest=manifest,
        learner_layout=layout,
    )
