"""Configuration and result types of the code sandbox."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Literal

BackendName = Literal["bubblewrap", "landlock", "unconfined"]


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and isolation choice for one :class:`~flashrl.envs.sandbox.Sandbox`."""

    backend: Literal["auto", "bubblewrap", "landlock", "unconfined"] = "auto"
    """Isolation backend; "auto" takes the first that works of bubblewrap, then landlock (+seccomp)."""
    allow_unconfined: bool = False
    """Permit running with resource limits only when no isolation works (unsafe; warns loudly)."""
    wall_time_s: float = 10.0
    """Wall-clock limit of one run; the whole process group is killed past it."""
    cpu_time_s: int = 10
    """CPU-seconds limit (RLIMIT_CPU) of the sandboxed process."""
    memory_bytes: int = 1 << 30
    """Address-space limit (RLIMIT_AS) of the sandboxed process, threads included."""
    max_file_bytes: int = 16 << 20
    """Largest file the code may write (RLIMIT_FSIZE)."""
    workdir_bytes: int = 64 << 20
    """Bytes the work dir may hold: the size of its private tmpfs (bubblewrap; Landlock where the
    machine allows private namespaces), else the runner's kill threshold for it (Landlock)."""
    max_open_files: int = 64
    """Open file descriptors limit (RLIMIT_NOFILE)."""
    max_tasks: int = 64
    """Tasks (threads; processes cannot be started) one run may hold at once, its main thread
    included: RLIMIT_NPROC counted in a user namespace of the run's own, so past it ``clone`` fails
    with EAGAIN inside the sandbox (``RuntimeError: can't start new thread``) and the host's pid space
    is never at stake. Also the run's ``pids.max`` where a cgroup is delegated."""
    max_output_bytes: int = 16 << 10
    """Bytes kept from each of stdout and stderr; past it the run is killed and the text truncated."""
    max_code_bytes: int = 1 << 20
    """Largest accepted program, in UTF-8 bytes."""
    python: str = field(default_factory=lambda: sys.executable)
    """Interpreter that runs the code (its standard library and site-packages are importable)."""

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "bubblewrap", "landlock", "unconfined"):
            raise ValueError(
                f"SandboxConfig.backend: expected 'auto', 'bubblewrap', 'landlock' or 'unconfined', "
                f"got {self.backend!r}."
            )
        if self.backend == "unconfined" and not self.allow_unconfined:
            raise ValueError(
                "SandboxConfig.backend='unconfined' runs untrusted code without isolation; set "
                "allow_unconfined=True as well if that is really intended."
            )
        for name in ("wall_time_s", "cpu_time_s", "memory_bytes", "max_file_bytes", "workdir_bytes",
                     "max_open_files", "max_tasks", "max_output_bytes", "max_code_bytes"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"SandboxConfig.{name}: expected a positive number, got {value!r}.")


@dataclass(frozen=True)
class SandboxResult:
    """What one run produced.

    ``stdout`` and ``stderr`` are kept exact (terminal controls included): they are what the model reads
    back and is trained on, and escaping them would change that data. What shows them to a person
    escapes them there (``flashrl.terminal_text.escape_terminal``: ``flashrl show``, log records); the
    dataclass's repr escapes them too (``repr`` of a str writes controls as escapes).
    """

    stdout: str
    """Standard output (UTF-8, invalid bytes replaced), truncated with a marker past the limit."""
    stderr: str
    """Standard error, same treatment."""
    exit_code: int | None
    """Exit status; -N: killed by signal N (under bubblewrap a status 129..192 is read as a signal,
    shell style); None: killed by the sandbox itself (see ``killed_by``)."""
    timed_out: bool
    """Whether the wall-clock limit killed the run."""
    output_truncated: bool
    """Whether stdout or stderr passed ``max_output_bytes`` (the run was then killed)."""
    killed_by: Literal["wall_time", "output_limit", "workdir_limit"] | None
    """Why the sandbox killed the process group, if it did ("workdir_limit": only under Landlock on a
    machine that allows no private tmpfs, where the runner measures the work dir instead)."""
    duration_s: float
    """Wall-clock seconds from start to exit."""
    backend: BackendName
    """Backend that ran the code."""

    @property
    def ok(self) -> bool:
        """Exited normally with status 0."""
        return self.exit_code == 0 and self.killed_by is None
