"""cgroup v2 limits (pids, memory) of one sandboxed run, where the machine delegates the controllers.

Used by the parent only. The kernel's own accounting adds to the rlimits (which stay the floor on
every machine): ``memory.max`` counts resident memory and the tmpfs pages the code writes, which the
address-space limit does not, and ``pids.max`` caps tasks as RLIMIT_NPROC does (``max_tasks``). Delegation means: this process's cgroup
v2 folder already has ``memory`` and ``pids`` in its ``cgroup.subtree_control`` and is writable
(the operator delegated it, e.g. systemd's ``Delegate=yes``); nothing here enables controllers on
the host. The sandboxed launcher moves itself into the run's cgroup (by writing to a
``cgroup.procs`` descriptor opened here, so the move is checked against this process's rights even
from inside bubblewrap's namespaces) before any untrusted code runs.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid

logger = logging.getLogger(__name__)

CONTROLLERS = ("memory", "pids")
_EMPTY_WAIT_S = 2.0


def _own_cgroup_folder() -> str | None:
    """This process's folder in the cgroup v2 hierarchy, or None when none is mounted."""
    mount = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, _, fs = line.partition(" - ")
            if fs.split(" ", 1)[0] == "cgroup2":
                mount = fields.split()[4]
                break
    if mount is None:
        return None
    with open("/proc/self/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return os.path.join(mount, line[3:].strip().lstrip("/"))
    return None


@functools.cache
def delegated_parent() -> tuple[str | None, str]:
    """(the folder to create run cgroups in, or None; why not, when None)."""
    try:
        own = _own_cgroup_folder()
        if own is None:
            return None, "no cgroup v2 hierarchy is mounted"
        with open(os.path.join(own, "cgroup.subtree_control")) as f:
            enabled = f.read().split()
    except OSError as exc:
        return None, f"the cgroup v2 hierarchy is not readable ({exc})"
    missing = [c for c in CONTROLLERS if c not in enabled]
    if missing:
        return None, (f"the cgroup v2 controllers {' and '.join(missing)} are not delegated to {own} "
                      f"(its cgroup.subtree_control holds {enabled or 'nothing'})")
    if not os.access(own, os.W_OK):
        return None, f"the cgroup v2 folder {own} is not writable"
    return own, ""


class RunCgroup:
    """A fresh cgroup for one run: made with its limits, emptied and removed by :meth:`close`."""

    def __init__(self, parent: str, memory_bytes: int, pids_max: int) -> None:
        self.path = os.path.join(parent, f"flashrl-sandbox-{uuid.uuid4().hex[:16]}")
        os.mkdir(self.path)
        try:
            self._write("memory.max", str(memory_bytes))
            if os.path.exists(os.path.join(self.path, "memory.swap.max")):
                self._write("memory.swap.max", "0")  # else the limit would page out to swap
            self._write("pids.max", str(pids_max))
            self.procs_fd = os.open(os.path.join(self.path, "cgroup.procs"), os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError:
            self._remove()
            raise

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def close(self) -> None:
        """Kill whatever is left in it, then remove it (a cgroup folder goes only once empty)."""
        os.close(self.procs_fd)
        if os.path.exists(os.path.join(self.path, "cgroup.kill")):
            self._write("cgroup.kill", "1")
        self._remove()

    def _remove(self) -> None:
        deadline = time.monotonic() + _EMPTY_WAIT_S
        while True:
            try:
                os.rmdir(self.path)
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    logger.error("could not remove the sandbox cgroup %s: %s", self.path, exc)
                    return
                time.sleep(0.01)
