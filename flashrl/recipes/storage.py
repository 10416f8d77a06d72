"""Where a run's outputs go: a local or mounted folder, or a `pyarrow.fs` URI the driver uploads to.

``--output`` (and `flashrl.recipes.run.train`'s ``output``) takes either:

- a path (``/shared/runs/math``, ``~/flashrl_results/...``): written directly. On a multi-node cluster
  it must be a folder every node mounts at the same path (NFS, a shared volume): the driver writes
  TensorBoard, progress and checkpoint state there, and learner rank 0 writes the checkpoints' policy
  folder from its own node.
- a URI that `pyarrow.fs.FileSystem.from_uri` resolves (``s3://bucket/run``, ``gs://...``,
  ``hdfs://...``, ``file:///...``), as Ray Train / Tune's ``storage_path``: the run writes into a local
  staging folder (``$FLASHRL_RESULTS`` or ``~/flashrl_results`` / preset / UTC time, printed at start) and
  the driver copies to the URI with ``pyarrow.fs.copy_files``: each periodic checkpoint as soon as it is
  written (with the TensorBoard folder and progress.jsonl; checkpoints that ``num_checkpoints_to_keep``
  prunes locally are deleted there too), and the whole folder when the run ends, also when it fails.
  Only what is on the driver's node can be uploaded: a checkpoint whose policy folder is missing there
  (learner rank 0 on another node) is an error that says so. ``--resume`` takes a local checkpoint
  (download one first). Credentials are pyarrow's (e.g. the AWS environment variables); nothing here
  reads them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RemoteOutput", "StorageError", "is_uri"]

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class StorageError(ValueError):
    """An output URI that cannot be used (unknown scheme, unreachable), or an upload that cannot be complete."""


def is_uri(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` is a URI (``scheme://...``) rather than a local or mounted path."""
    return isinstance(path, str) and bool(_URI.match(path))


@dataclass
class RemoteOutput:
    """The URI a run's local output folder is copied to (see the module docstring)."""

    uri: str
    filesystem: Any
    """The `pyarrow.fs.FileSystem` of the URI."""
    root: str
    """The URI's path inside that filesystem."""

    @classmethod
    def resolve(cls, uri: str) -> RemoteOutput:
        """Resolve ``uri`` with `pyarrow.fs.FileSystem.from_uri` and create its folder; errors say why."""
        import pyarrow.fs

        try:
            filesystem, root = pyarrow.fs.FileSystem.from_uri(uri)
            filesystem.create_dir(root, recursive=True)
        except (OSError, ValueError) as err:  # ArrowInvalid is a ValueError; unreachable stores raise OSError
            raise StorageError(
                f"--output {uri!r}: expected a local path or a URI that pyarrow.fs resolves and can write "
                f"(s3://, gs://, hdfs://, file://), got {type(err).__name__}: {err}. Fix: check the scheme, the "
                "bucket and the credentials, or write to a folder every node mounts"
            ) from err
        return cls(uri=uri.rstrip("/"), filesystem=filesystem, root=root.rstrip("/"))

    def upload(self, local: str | os.PathLike[str], relative: str = "") -> str:
        """Copy file or folder ``local`` to ``<uri>/<relative>``; returns that URI."""
        import pyarrow.fs

        target = f"{self.root}/{relative}".rstrip("/") if relative else self.root
        if Path(local).is_dir():
            self.filesystem.create_dir(target, recursive=True)
        pyarrow.fs.copy_files(
            os.fspath(local), target, source_filesystem=pyarrow.fs.LocalFileSystem(),
            destination_filesystem=self.filesystem,
        )
        return f"{self.uri}/{relative}" if relative else self.uri

    def upload_checkpoint(self, folder: str | os.PathLike[str], relative: str) -> str:
        """Upload one complete checkpoint folder (its marker and policy folder must be on this node)."""
        from flashrl.checkpoints import MARKER, POLICY_DIR

        folder = Path(folder)
        missing = [name for name in (MARKER, POLICY_DIR) if not (folder / name).exists()]
        if missing:
            raise StorageError(
                f"checkpoint {folder}: expected {missing} on the driver's node to upload to {self.uri}, found "
                "none: learner rank 0 writes the policy folder on its own node. Fix: on a multi-node cluster "
                "write to a folder every node mounts (--output /shared/...) instead of a URI"
            )
        return self.upload(folder, relative)

    def sync_checkpoints(self, local_dir: str | os.PathLike[str], relative: str = "checkpoints") -> list[str]:
        """Upload the checkpoints of ``local_dir`` not yet there; delete there those pruned here."""
        import pyarrow.fs

        local = {p.name for p in Path(local_dir).glob("checkpoint_*") if p.is_dir()}
        base = f"{self.root}/{relative}"
        self.filesystem.create_dir(base, recursive=True)
        infos = self.filesystem.get_file_info(pyarrow.fs.FileSelector(base))
        remote = {Path(info.path).name for info in infos if info.type == pyarrow.fs.FileType.Directory}
        for name in sorted(remote - local):
            self.filesystem.delete_dir(f"{base}/{name}")
        return [self.upload_checkpoint(Path(local_dir) / name, f"{relative}/{name}") for name in sorted(local - remote)]

    def upload_run(self, out: str | os.PathLike[str]) -> str:
        """Everything of a run folder: new checkpoints (pruned ones deleted there), then every other entry."""
        out = Path(out)
        if (out / "checkpoints").is_dir():
            self.sync_checkpoints(out / "checkpoints")
        for entry in sorted(out.iterdir()):
            if entry.name == "checkpoints":
                continue
            if entry.is_dir() and entry.name.startswith("checkpoint_"):
                self.upload_checkpoint(entry, entry.name)
            else:
                self.upload(entry, entry.name)
        return self.uri
