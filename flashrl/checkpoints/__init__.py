"""Checkpoints, in one place: atomic, verified folders with the policy and everything to resume.

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
``<path>.tmp`` (whose first file, ``SAVE_MARKER``, marks it as flashrl's own), every file and
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

The learners hand this package their state and keep what only they know (which tensors, how they
are sharded, the optimizer objects); every file is written, hashed, verified and unpickled here:

- ``layout``: the names of the files and folders (format 2) and of the learner layouts;
- ``files``: reading a file as untrusted input (`open_regular`: a regular file inside the folder,
  never blocking) and writing durably (fsync, rename into place); `CheckpointError`;
- ``safe_load``: the allow-listed unpicklers (torch ``weights_only`` and DCP's metadata);
- ``manifest``: hashing a save into the manifest, and checking a folder against it;
- ``ownership``: what flashrl wrote and may remove, and swapping a finished save into place;
- ``save_failure``: a save the disk refused (full, I/O error, no permission) as one error naming the
  path, the free space and the checkpoint's size, its partial ``.tmp`` removed; the leftovers of
  interrupted saves removed before a resumed run needs the space;
- ``folder``: the algorithm checkpoint (`write_checkpoint`, `read_checkpoint`, `record_checkpoint`,
  `latest_checkpoint`, `read_config`);
- ``learner_state``: a learner's ``save_state`` folder (one state file, or DCP shards);
- ``dcp``: torch DCP save and load of a sharded model and optimizer, through the safe readers;
- ``export``: the policy as a Hugging Face folder (streamed from shards, or ``save_pretrained``).
- ``stored_code``: a stored config is data: the values in it that name code (each setting's ``code``
  marking, ``flashrl.validation``), refused on restore unless given again or trusted.

``dcp``, ``learner_state`` and ``export`` are imported on use (``from flashrl.checkpoints import dcp``):
they load ``torch.distributed`` (and DCP), which reading a checkpoint's config does not need.
"""

from flashrl.checkpoints.files import (
    CheckpointError,
    check_regular,
    file_kind,
    fsync_path,
    is_regular,
    open_regular,
    resolve_inside,
    tree_modes,
)
from flashrl.checkpoints.folder import (
    Checkpoint,
    latest_checkpoint,
    read_checkpoint,
    read_config,
    record_checkpoint,
    write_checkpoint,
)
from flashrl.checkpoints.layout import (
    ALGORITHM_STATE_FILE,
    CHECKPOINT_NAME,
    CONFIG_FILE,
    DCP_LAYOUT,
    DCP_METADATA_FILE,
    FORMAT_VERSION,
    FRESH_OPTIMIZER_FILE,
    LATEST_FILE,
    LAYOUT_FILES,
    LEARNER_DIR,
    MARKER,
    OLD_SUFFIX,
    POLICY_DIR,
    SAVE_MARKER,
    SINGLE_FILE_LAYOUT,
    STATE_FILE,
    TMP_SUFFIX,
)
from flashrl.checkpoints.manifest import check_listed, manifest_layout, verify_files
from flashrl.checkpoints.ownership import own_folder
from flashrl.checkpoints.safe_load import load_error_reason, load_tensor_file
from flashrl.checkpoints.save_failure import CheckpointSaveError, remove_interrupted_saves

__all__ = [
    "ALGORITHM_STATE_FILE",
    "CHECKPOINT_NAME",
    "CONFIG_FILE",
    "DCP_LAYOUT",
    "DCP_METADATA_FILE",
    "FORMAT_VERSION",
    "FRESH_OPTIMIZER_FILE",
    "LATEST_FILE",
    "LAYOUT_FILES",
    "LEARNER_DIR",
    "MARKER",
    "OLD_SUFFIX",
    "POLICY_DIR",
    "SAVE_MARKER",
    "SINGLE_FILE_LAYOUT",
    "STATE_FILE",
    "TMP_SUFFIX",
    "Checkpoint",
    "CheckpointError",
    "CheckpointSaveError",
    "check_listed",
    "check_regular",
    "file_kind",
    "fsync_path",
    "is_regular",
    "latest_checkpoint",
    "load_error_reason",
    "load_tensor_file",
    "manifest_layout",
    "open_regular",
    "own_folder",
    "read_checkpoint",
    "read_config",
    "record_checkpoint",
    "remove_interrupted_saves",
    "resolve_inside",
    "tree_modes",
    "verify_files",
    "write_checkpoint",
]
