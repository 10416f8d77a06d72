"""The names of a checkpoint's files and folders (format 2), defined once for writers and readers."""

from __future__ import annotations

import re

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
STATE_FILE = "learner_state.pt"
"""A single learner's ``save_state`` folder holds this one file (sharded learners write DCP shards)."""
DCP_METADATA_FILE = ".metadata"
"""DCP writes this file last (rank 0, after every shard): a folder without it is an interrupted save."""
LAYOUT_FILES = {SINGLE_FILE_LAYOUT: STATE_FILE, DCP_LAYOUT: DCP_METADATA_FILE}
"""The manifest's ``learner_layout`` -> the file in ``learner/`` that makes it (one state file, or DCP's
metadata beside its shards); a checkpoint lists exactly one of the two."""
FRESH_OPTIMIZER_FILE = "optimizer_not_started"
"""In a sharded ``save_state`` folder: the optimizer had not stepped, so only the weights were saved."""
