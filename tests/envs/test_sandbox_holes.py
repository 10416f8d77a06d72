"""Holes found by trying the sandbox as a hostile user would (running as root), one test each.

Every test runs under both backends, and the read tests also under bubblewrap on a kernel without
Landlock (simulated: the parent's Landlock probe answers ABI 0, so the launcher never applies it and
the mounts alone must hide the host). A backend that does not work here skips with the reason, or
fails under CI (``CI`` / ``FLASHRL_REQUIRE_OPTIONAL`` set), where both are expected to work.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import flashrl
from flashrl.envs.sandbox import (
    Sandbox,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailableError,
    _cgroup,
    available_backends,
    backends,
    runner,
)

REPO = Path(flashrl.__file__).resolve().parents[1]
LIMITS = {"wall_time_s": 20.0, "cpu_time_s": 5, "memory_bytes": 512 << 20, "max_file_bytes": 4 << 20,
          "workdir_bytes": 8 << 20}


def _require_optional() -> bool:
    flag = os.environ.get("FLASHRL_REQUIRE_OPTIONAL", os.environ.get("CI", ""))
    return flag.strip().lower() not in ("", "0", "false", "no")


def _sandbox_or_skip(backend: str) -> Sandbox:
    if backend not in available_backends():
        reason = f"the {backend!r} sandbox backend does not work on this machine"
        if _require_optional():
            pytest.fail(f"{reason}; CI runs as root on a kernel with Landlock, where both must work.")
        pytest.skip(reason)
    return Sandbox(SandboxConfig(backend=backend, **LIMITS))  # type: ignore[arg-type]


@pytest.fixture(params=["bubblewrap", "landlock"])
def sandbox(request: pytest.FixtureRequest) -> Sandbox:
    return _sandbox_or_skip(request.param)


@pytest.fixture
def no_landlock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Pretend the kernel has no Landlock: the parent's probe says ABI 0 and every probe reruns."""
    monkeypatch.setattr(backends, "landlock_abi", lambda: 0)
    monkeypatch.setattr(runner, "_PROBE_CACHE", {})
    yield


@pytest.fixture(params=["bubblewrap", "landlock", "bubblewrap-without-landlock"])
def any_sandbox(request: pytest.FixtureRequest) -> Sandbox:
    if request.param == "bubblewrap-without-landlock":
        request.getfixturevalue("no_landlock")
        return _sandbox_or_skip("bubblewrap")
    return _sandbox_or_skip(request.param)


@pytest.fixture
def canaries(tmp_path: Path) -> Iterator[list[Path]]:
    """Secret files outside the allow-list: one in a host temp dir, one in the checkout itself."""
    token = uuid.uuid4().hex
    paths = [tmp_path / "canary.txt", REPO / f".flashrl-canary-{token}"]
    for path in paths:
        path.write_text(f"secret-{token}")
    try:
        yield paths
    finally:
        paths[1].unlink()


_READ_PROBE = """
import os
leaks = []
for path in {paths!r}:
    try:
        with open(path, 'rb') as f:
            f.read(1)
        leaks.append(path)
    except OSError:
        pass
for folder, allowed in {folders!r}.items():
    try:
        extra = set(os.listdir(folder)) - set(allowed)
    except OSError:
        continue
    if extra:
        leaks.append(folder + '/' + ','.join(sorted(extra)))
print('leaks', leaks)
"""


def _visible_names(folder: str) -> list[str]:
    """What a listing of ``folder`` may show: only the first step towards the interpreter's folders
    (bubblewrap creates those steps to bind the interpreter; a venv inside the checkout is one)."""
    names = []
    for path in backends.interpreter_layout(sys.executable).folders:
        rel = os.path.relpath(path, folder)
        if not rel.startswith(".."):
            names.append(rel.split(os.sep)[0])
    return names


def _git_config() -> str:
    """The checkout's git config: ``.git/config``, or in a linked checkout the file ``.git`` itself."""
    git = REPO / ".git"
    return str(git / "config") if git.is_dir() else str(git)


def test_reads_of_host_secrets_and_canaries_are_refused(any_sandbox: Sandbox, canaries: list[Path]) -> None:
    paths = ["/etc/shadow", "/etc/hostname", _git_config(), str(REPO / "pyproject.toml"), *map(str, canaries),
             "/sys/kernel/mm/transparent_hugepage/enabled", "/proc/1/cmdline" if any_sandbox.backend == "landlock"
             else "/proc/self/mountinfo-does-not-exist"]
    folders = {f: _visible_names(f) for f in ["/opt", "/var/log", "/sys", "/root", "/home", str(REPO), "/etc/ssh"]}
    result = any_sandbox.run(_READ_PROBE.format(paths=paths, folders=folders))
    assert (result.exit_code, result.stdout) == (0, "leaks []\n"), result.stderr


def test_etc_holds_only_what_the_interpreter_needs(any_sandbox: Sandbox) -> None:
    code = "import os\ntry:\n    print(sorted(os.listdir('/etc')))\nexcept OSError as e:\n    print('denied')\n"
    result = any_sandbox.run(code)
    assert result.exit_code == 0, result.stderr
    seen = result.stdout.strip()
    # bubblewrap: a fresh /etc of bound files only; Landlock: /etc itself is not listable.
    assert seen in ("denied", repr(sorted(backends.ETC_FILES_PRESENT))), seen


def test_the_interpreter_and_numpy_still_work(any_sandbox: Sandbox) -> None:
    result = any_sandbox.run("import numpy, json, time\nprint(int(numpy.ones(3).sum()), time.localtime().tm_year > 2000)")
    assert (result.exit_code, result.stdout) == (0, "3 True\n"), result.stderr


def test_unix_datagram_to_a_host_socket_is_refused(sandbox: Sandbox, tmp_path: Path) -> None:
    path = str(tmp_path / "host.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.setblocking(False)
    code = f"""
import socket
sent = []
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
for how, send in [
    ("sendto", lambda: a.sendto(b"pwned", {path!r})),
    ("sendmsg", lambda: a.sendmsg([b"pwned"], [], 0, {path!r})),
    ("connect", lambda: (a.connect({path!r}), a.send(b"pwned"))),
]:
    try:
        send()
        sent.append(how)
    except OSError:
        pass
b.send(b"inside")  # the pair itself still works: asyncio's self-pipe needs it
print(sent, a.recv(16))
"""
    try:
        result = sandbox.run(code)
        with pytest.raises(BlockingIOError):
            print("host received", server.recv(64))
    finally:
        server.close()
    assert (result.exit_code, result.stdout) == (0, "[] b'inside'\n"), result.stderr


def _sysv_objects() -> set[tuple[str, str]]:
    """(table, id) of every SysV IPC object of the host's IPC namespace."""
    found = set()
    for table in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{table}") as f:
            found |= {(table, line.split()[1]) for line in f.readlines()[1:]}
    return found


def _remove_sysv(objects: set[tuple[str, str]]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    ctl = {"shm": libc.shmctl, "msg": libc.msgctl, "sem": libc.semctl}
    for table, ident in objects:
        ctl[table](int(ident), 0, 0)  # IPC_RMID (semctl's semnum is ignored)


def test_sysv_ipc_leaves_nothing_on_the_host(sandbox: Sandbox) -> None:
    before = _sysv_objects()
    code = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
made = []
for i in range(3):
    if libc.shmget(0x5A5A0000 + i, 64 << 20, 0o1600) >= 0:  # IPC_CREAT | 0600
        made.append('shm')
if libc.msgget(0x5A5A1000, 0o1600) >= 0:
    made.append('msg')
if libc.semget(0x5A5A2000, 1, 0o1600) >= 0:
    made.append('sem')
print(made)
"""
    try:
        result = sandbox.run(code)
    finally:
        leaked = _sysv_objects() - before
        _remove_sysv(leaked)  # a failing run must not leave 192 MiB on the machine
    assert result.exit_code == 0, result.stderr
    assert leaked == set(), f"SysV IPC objects left on the host: {sorted(leaked)}"
    # The IPC calls themselves are refused (bubblewrap's private IPC namespace would also drop them).
    assert result.stdout == "[]\n"


def test_workdir_bytes_are_capped(sandbox: Sandbox) -> None:
    # 1 MiB files (under max_file_bytes) until the disk refuses: at most workdir_bytes (8 MiB) fit.
    code = """
import os
written = 0
try:
    for i in range(64):
        with open('f%d' % i, 'wb') as f:
            f.write(b'0' * (1 << 20))
        written += 1 << 20
except OSError as e:
    print('refused', e.errno)
print(written)
"""
    result = sandbox.run(code)
    lines = result.stdout.split()
    assert result.exit_code == 0 and lines[:2] == ["refused", "28"], (result.stdout, result.stderr)  # ENOSPC
    assert int(lines[2]) <= LIMITS["workdir_bytes"]


def test_workdir_is_measured_where_no_private_tmpfs_is_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulated machine without root or user namespaces: the host work dir is watched instead.
    monkeypatch.setattr(backends, "private_namespaces_available", lambda python: False)
    sandbox = _sandbox_or_skip("landlock")
    endless = "i = 0\nwhile True:\n    open('f%d' % i, 'wb').write(b'0' * (1 << 20))\n    i += 1\n"
    result = sandbox.run(endless)
    assert (result.killed_by, result.exit_code) == ("workdir_limit", None), (result.stdout, result.stderr)
    quick = "for i in range(12):\n    open('f%d' % i, 'wb').write(b'0' * (1 << 20))\nprint('done')\n"
    result = sandbox.run(quick)  # 12 MiB, perhaps written before the first measurement
    assert (result.stdout, result.killed_by, result.exit_code) == ("done\n", "workdir_limit", None)
    small = sandbox.run("open('f', 'wb').write(b'0' * (1 << 20))\nprint('done')\n")
    assert (small.stdout, small.killed_by, small.exit_code) == ("done\n", None, 0)


def test_the_python_tool_names_the_workdir_limit() -> None:
    from flashrl.envs.python_tool import format_observation

    result = SandboxResult(stdout="", stderr="", exit_code=None, timed_out=False, output_truncated=False,
                           killed_by="workdir_limit", duration_s=0.2, backend="landlock")
    assert format_observation(result, max_chars=100, wall_time_s=5.0) == (
        "Disk limit of the work dir exceeded; the program was stopped.\n(no output; use print() to see values)"
    )


def test_other_processes_are_invisible(any_sandbox: Sandbox) -> None:
    sandbox = any_sandbox
    code = f"""
import os
try:
    pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
except OSError:
    pids = []
foreign = []
for pid in set(pids) | {{1, {os.getpid()}, {os.getppid()}}}:
    if pid == os.getpid():
        continue
    try:
        with open('/proc/%d/cmdline' % pid, 'rb') as f:
            foreign.append((pid, f.read()[:40]))
    except OSError:
        pass
print(len([p for p in pids if p != os.getpid()]), foreign)
"""
    result = sandbox.run(code)
    assert result.exit_code == 0, result.stderr
    if sandbox.backend == "bubblewrap" and backends.landlock_abi() == 0:
        # Its own pid namespace: only bwrap's init (pid 1, part of the sandbox) besides the code.
        count, foreign = result.stdout.split(" ", 1)
        bwrap = backends.find_bwrap()
        assert bwrap is not None
        assert (count, foreign) == ("1", f"{[(1, bwrap.encode()[:40])]}\n"), result.stdout
    else:
        # Landlock (in both backends) lets the code read its own /proc entry only, not the listing.
        assert result.stdout == "0 []\n"


def test_sys_is_not_readable(any_sandbox: Sandbox) -> None:
    code = "import os\ntry:\n    print(os.listdir('/sys'))\nexcept OSError:\n    print('hidden')\n"
    result = any_sandbox.run(code)
    assert (result.exit_code, result.stdout) in ((0, "hidden\n"), (0, "[]\n")), result.stdout


def test_kernel_attack_surface_syscalls_are_refused(sandbox: Sandbox) -> None:
    # x86_64 / aarch64 numbers differ; ask libc by name where it has a wrapper, else by number.
    code = """
import ctypes, os, platform
libc = ctypes.CDLL(None, use_errno=True)
nr = {'x86_64': {'bpf': 321, 'perf_event_open': 298, 'userfaultfd': 323, 'keyctl': 250, 'add_key': 248},
      'aarch64': {'bpf': 280, 'perf_event_open': 241, 'userfaultfd': 282, 'keyctl': 219, 'add_key': 217}}[platform.machine()]
allowed = []
for name, args in [('bpf', (0, 0, 0)), ('perf_event_open', (0, 0, -1, -1, 0)), ('userfaultfd', (0,)),
                   ('keyctl', (0, -3, 0)), ('add_key', (b'user', b'k', b'v', 1, -3))]:
    if libc.syscall(nr[name], *args) >= 0 or ctypes.get_errno() != 1:  # EPERM expected
        allowed.append(name)
for name, call in [('ptrace', lambda: libc.ptrace(0, 0, 0, 0)), ('mount', lambda: libc.mount(b'x', b'/tmp', b'tmpfs', 0, None)),
                   ('mq_open', lambda: libc.mq_open(b'/flashrl-$token', 0o100 | 2, 0o600, None))]:
    if call() >= 0 or ctypes.get_errno() != 1:
        allowed.append(name)
print(allowed)
"""
    token = uuid.uuid4().hex
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        result = sandbox.run(code.replace("$token", token))
    finally:
        libc.mq_unlink(f"/flashrl-{token}".encode())  # removes what a failing run created
    assert (result.exit_code, result.stdout) == (0, "[]\n"), (result.stdout, result.stderr)


def test_landlock_backend_refuses_without_landlock(no_landlock: None) -> None:
    with pytest.raises(SandboxUnavailableError, match="landlock: the kernel has no Landlock support"):
        Sandbox(SandboxConfig(backend="landlock"))


def test_probe_rejects_a_backend_that_reads_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    # A launcher that applies neither Landlock nor mounts (the unconfined path) must fail the probe on
    # the read check too, not only on sockets, fork and writes.
    failure = runner._probe_uncached(SandboxConfig(), "unconfined", None)
    assert failure is not None and "read outside allowed" in failure


def test_cgroup_limits_follow_the_machines_delegation() -> None:
    parent, reason = _cgroup.delegated_parent()
    own = _cgroup._own_cgroup_folder()
    enabled: list[str] = []
    if own is not None and os.path.exists(os.path.join(own, "cgroup.subtree_control")):
        enabled = Path(own, "cgroup.subtree_control").read_text().split()
    delegated = {"memory", "pids"} <= set(enabled) and own is not None and os.access(own, os.W_OK)
    assert (parent is not None) == delegated, (parent, reason, enabled)
    if parent is None:
        assert reason and ("not delegated" in reason or "no cgroup v2" in reason or "not writable" in reason)


def test_each_run_joins_its_own_cgroup_with_limits(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    # A stand-in cgroup folder (the machine may delegate none): checks the limits written, that the
    # sandboxed launcher itself wrote to the cgroup.procs descriptor (even from inside bubblewrap),
    # and that the cgroup is removed after the run.
    seen: list[dict[str, str]] = []

    def remove(self: _cgroup.RunCgroup) -> None:
        seen.append({name: (Path(self.path) / name).read_text() for name in os.listdir(self.path)})
        shutil.rmtree(self.path)

    monkeypatch.setattr(_cgroup, "delegated_parent", lambda: (str(tmp_path), ""))
    monkeypatch.setattr(_cgroup.RunCgroup, "_remove", remove)
    result = sandbox.run("print('ran')")
    assert (result.exit_code, result.stdout) == (0, "ran\n"), result.stderr
    memory = str(LIMITS["memory_bytes"] + LIMITS["workdir_bytes"])
    assert seen == [{"memory.max": memory, "pids.max": "64", "cgroup.procs": "0"}]
    assert list(tmp_path.iterdir()) == []


def test_seccomp_is_an_allow_list(sandbox: Sandbox) -> None:
    # landlock_create_ruleset (444 on every architecture) is harmless and on no list: under an
    # allow-list it fails as if the kernel lacked it (ENOSYS); outside the sandbox it answers the ABI.
    code = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.syscall(444, None, 0, 1), ctypes.get_errno())\n"
    result = sandbox.run(code)
    assert (result.exit_code, result.stdout) == (0, "-1 38\n"), result.stderr


_NET_PROBE = """
import json
readable, found = [], set()
for name in ("tcp", "tcp6", "udp", "udp6", "unix", "raw", "packet"):
    for root in ("/proc/self/net", "/proc/net", "/proc/thread-self/net"):
        try:
            with open(f"{{root}}/{{name}}") as f:
                text = f.read()
        except OSError:
            continue
        readable.append(f"{{root}}/{{name}}")
        found |= {{needle for needle in {needles!r} if needle in text}}
print(json.dumps([readable, sorted(found)]))
"""


def _probe_host_listeners(sandbox: Sandbox, tmp_path: Path) -> tuple[list[str], list[str]]:
    """(the net tables the code could read, which of the host's listeners they showed): a listening TCP
    port and a listening unix socket of the host, as the runner's agent endpoint has."""
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix_path = str(tmp_path / f"endpoint-{uuid.uuid4().hex[:8]}.sock")
    unix.bind(unix_path)
    unix.listen()
    try:
        result = sandbox.run(_NET_PROBE.format(needles=[f"0100007F:{tcp.getsockname()[1]:04X}", unix_path]))
    finally:
        tcp.close()
        unix.close()
    assert result.exit_code == 0, result.stderr
    readable, found = json.loads(result.stdout)
    return readable, found


def test_the_host_s_listening_ports_are_invisible_in_proc_net(sandbox: Sandbox, tmp_path: Path) -> None:
    """/proc/self/net shows the net namespace of the reader: bubblewrap's own, and under Landlock the one
    the launcher enters with its private mount namespace. Where the machine allows no namespaces (no
    root, no unprivileged user namespaces) Landlock cannot hide it: documented, and tested below."""
    readable, found = _probe_host_listeners(sandbox, tmp_path)
    assert "/proc/self/net/tcp" in readable and "/proc/self/net/unix" in readable  # readable, but not ours
    if sandbox.backend == "bubblewrap" or backends.private_namespaces_available(sandbox.config.python):
        assert found == []
    else:
        assert len(found) == 2  # the documented gap, on a machine without namespaces


def test_the_landlock_backend_shows_the_host_s_ports_without_namespaces(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """The documented gap: without private namespaces Landlock's /proc/self rule covers /proc/self/net."""
    sandbox = _sandbox_or_skip("landlock")
    monkeypatch.setattr(backends, "private_namespaces_available", lambda python: False)
    readable, found = _probe_host_listeners(sandbox, tmp_path)
    assert "/proc/self/net/tcp" in readable and len(found) == 2, (readable, found)


_CMDLINE_PROBE = """
def argv(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode().split("\\0")[:-1]
    except OSError:
        return None
import json, os
print(json.dumps([argv("self"), argv(1), os.getcwd()]))
"""


def test_the_command_lines_the_code_can_read_name_no_host_path_but_the_interpreter(any_sandbox: Sandbox) -> None:
    """The launcher's settings (work dir, allow-list, module path) come on stdin and bubblewrap's
    options through a pipe. What stays: the interpreter's path (its ``sys.executable`` anyway) and,
    under Landlock, flashrl's own folder (the launcher's path, which Landlock lets it read)."""
    result = any_sandbox.run(_CMDLINE_PROBE)
    assert result.exit_code == 0, result.stderr
    own, init, cwd = json.loads(result.stdout)
    python = any_sandbox.config.python
    if any_sandbox.backend == "bubblewrap":
        launcher = f"{backends.BWRAP_LAUNCHER_DIR}/_launcher.py"
        assert cwd == backends.BWRAP_WORKDIR
    else:
        launcher = backends.LAUNCHER
        assert cwd.startswith(os.path.join(tempfile.gettempdir(), "flashrl-sandbox-"))  # the host's, documented
    assert own == [python, "-I", "-S", "-B", launcher]
    if any_sandbox.backend == "bubblewrap" and backends.landlock_abi() == 0:  # bwrap's init shows
        assert init is not None and init[1:3] == ["--args", init[2]] and init[3:] == ["--", *own], init
        assert init[0] == backends.find_bwrap() and init[2].isdigit()
    else:
        assert init is None  # Landlock: no other process's /proc entry
