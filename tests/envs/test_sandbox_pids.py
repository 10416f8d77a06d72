"""Tasks and other processes' pids, attacked from inside the sandbox as root and as an unprivileged uid.

Each test runs its scenario in a child interpreter (this file run as a script), once as this process's
uid and, when that is root, once more as :data:`UNPRIVILEGED_UID` with no capabilities. The child
starts the stand-in victim itself, so victim and sandbox always share a uid. Where this interpreter
lives behind a folder other users cannot enter (a home of mode 0700), the unprivileged child gets a
private mount namespace in which that folder is a world-enterable tmpfs holding the needed entries.

The thread bomb is bounded (:data:`BOMB_BOUND` threads): on a sandbox without a task cap it stops
there instead of taking the machine's pid space, and the test fails on the count alone.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import flashrl
from flashrl.envs.sandbox import Sandbox, SandboxConfig, available_backends, backends

REPO = Path(flashrl.__file__).resolve().parents[1]
UNPRIVILEGED_UID = 0x7E00_0000
"""The uid the unprivileged runs take (no account owns it; distinct from the sandbox's own run uids)."""
MAX_TASKS = 24
BOMB_BOUND = 600
LIMITS = {"wall_time_s": 30.0, "cpu_time_s": 10, "max_tasks": MAX_TASKS}
USERS = ["self", "unprivileged"]


def _require_optional() -> bool:
    flag = os.environ.get("FLASHRL_REQUIRE_OPTIONAL", os.environ.get("CI", ""))
    return flag.strip().lower() not in ("", "0", "false", "no")


# --- scenarios (run in the child) -----------------------------------------------------------------

THREAD_BOMB = f"""
import ctypes, json, os, threading
threading.stack_size(32768)  # the smallest CPython takes: the address-space limit is no cap here
hold = threading.Event()
started = 0
try:
    while started < {BOMB_BOUND}:
        threading.Thread(target=hold.wait, daemon=True).start()
        started += 1
except RuntimeError:
    pass
libc = ctypes.CDLL(None, use_errno=True)
thread = ctypes.c_ulong()
# One more, straight through pthread_create, to read the error the kernel gave (pause() never returns).
refused = libc.pthread_create(ctypes.byref(thread), None, ctypes.cast(libc.pause, ctypes.c_void_p), None)
print(json.dumps({{"tasks": len(os.listdir('/proc/self/task')), "pthread_create": refused}}))
hold.set()
"""


def _thread_bomb(sandbox: Sandbox) -> dict:
    """Run the bomb while this (host) side keeps starting processes; report both sides."""
    host_failures: list[str] = []
    done = threading.Event()

    def spawn() -> None:
        while not done.is_set():
            try:
                subprocess.run(["/bin/true"], check=True)
            except (OSError, subprocess.CalledProcessError) as exc:
                host_failures.append(repr(exc))
            done.wait(0.02)

    spawner = threading.Thread(target=spawn)
    spawner.start()
    try:
        result = sandbox.run(THREAD_BOMB)
    finally:
        done.set()
        spawner.join()
    after = subprocess.run(["/bin/true"], check=False).returncode
    return {"exit_code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr[-2000:],
            "host_failures": host_failures[:3], "host_spawn_after": after}


PID_ATTACK = """
import fcntl, json, os, resource, socket, struct, ctypes
pid = $victim
def attempt(call):
    try:
        call()
        return 0
    except OSError as e:
        return e.errno
libc = ctypes.CDLL(None, use_errno=True)
a, b = socket.socketpair()
nr_fcntl = {'x86_64': 72, 'aarch64': 25}[os.uname().machine]
def raw_setown():  # F_SETOWN with high bits set: the kernel reads the command's low 32 bits only
    if libc.syscall(nr_fcntl, a.fileno(), ctypes.c_long((1 << 32) | fcntl.F_SETOWN), pid) != 0:
        raise OSError(ctypes.get_errno(), 'fcntl')
other = {
    "setpriority": attempt(lambda: os.setpriority(os.PRIO_PROCESS, pid, 19)),
    # PRIO_USER and PRIO_PGRP read only: where they pass (before the fix, as root) a write would
    # renice every process of the uid on the machine.
    "getpriority_user": attempt(lambda: os.getpriority(os.PRIO_USER, 0)),
    "getpriority_pgrp": attempt(lambda: os.getpriority(os.PRIO_PGRP, pid)),
    "sched_setaffinity": attempt(lambda: os.sched_setaffinity(pid, {0})),
    "getpriority": attempt(lambda: os.getpriority(os.PRIO_PROCESS, pid)),
    "sched_getaffinity": attempt(lambda: os.sched_getaffinity(pid)),
    "sched_getscheduler": attempt(lambda: os.sched_getscheduler(pid)),
    "prlimit": attempt(lambda: resource.prlimit(pid, resource.RLIMIT_NOFILE)),
    "getsid": attempt(lambda: os.getsid(pid)),
    "getpgid": attempt(lambda: os.getpgid(pid)),
    "kill": attempt(lambda: os.kill(pid, 0)),
    "fcntl_setown": attempt(lambda: fcntl.fcntl(a, fcntl.F_SETOWN, pid)),
    "fcntl_setown_high_bits": attempt(raw_setown),
    "ioctl_fiosetown": attempt(lambda: fcntl.ioctl(a, 0x8901, struct.pack('i', pid))),
}
nr = {'x86_64': {'ioprio_set': 251, 'migrate_pages': 256, 'process_madvise': 440, 'kcmp': 312},
      'aarch64': {'ioprio_set': 30, 'migrate_pages': 238, 'process_madvise': 440, 'kcmp': 272}}[os.uname().machine]
def raw(name, *args):
    def call():
        if libc.syscall(nr[name], *args) < 0:
            raise OSError(ctypes.get_errno(), name)
    return call
absent = {  # not on the allow-list at all: ENOSYS (38), or a listed escape route: EPERM (1)
    "sched_setscheduler": attempt(lambda: os.sched_setscheduler(pid, os.SCHED_BATCH, os.sched_param(0))),
    "ioprio_set": attempt(raw('ioprio_set', 1, pid, 0)),
    "migrate_pages": attempt(raw('migrate_pages', pid, 0, None, None)),
    "process_madvise": attempt(raw('process_madvise', -1, None, 0, 0, 0)),
    "kcmp": attempt(raw('kcmp', pid, os.getpid(), 0, 0, 0)),
    "pidfd_open": attempt(lambda: os.pidfd_open(pid)),
}
me = os.getpid()
nicer = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 3)
own = {
    # Three steps nicer than it started (capped at 19): lowering it back needs CAP_SYS_NICE, and a
    # suite run under `nice` starts above 0.
    "nice": [attempt(lambda: os.setpriority(os.PRIO_PROCESS, 0, nicer)),
             os.getpriority(os.PRIO_PROCESS, me) - nicer],
    "affinity": attempt(lambda: os.sched_setaffinity(me, os.sched_getaffinity(0))),
    "prlimit": resource.prlimit(me, resource.RLIMIT_NOFILE) == resource.getrlimit(resource.RLIMIT_NOFILE),
    "session": os.getsid(0) == os.getsid(me) == os.getpgid(0),
    "fcntl": fcntl.fcntl(a, fcntl.F_GETFL) & os.O_RDWR,
    "ioctl_fionread": len(fcntl.ioctl(a, 0x541B, b"\\0" * 4)),
}
print(json.dumps({"other": other, "absent": absent, "own": own}))
"""


def _pid_attack(sandbox: Sandbox) -> dict:
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        before = (os.getpriority(os.PRIO_PROCESS, victim.pid), sorted(os.sched_getaffinity(victim.pid)))
        result = sandbox.run(PID_ATTACK.replace("$victim", str(victim.pid)))
        after = (os.getpriority(os.PRIO_PROCESS, victim.pid), sorted(os.sched_getaffinity(victim.pid)))
        alive = victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
    return {"exit_code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr[-2000:],
            "victim_before": before, "victim_after": after, "victim_alive": alive, "uid": os.getuid()}


SCENARIOS = {"thread_bomb": _thread_bomb, "pid_attack": _pid_attack}


def _child_main(scenario: str, backend: str) -> None:
    if backend not in available_backends():
        print(json.dumps({"skip": f"the {backend!r} sandbox backend does not work here as uid {os.getuid()}"}))
        return
    sandbox = Sandbox(SandboxConfig(backend=backend, **LIMITS))  # type: ignore[arg-type]
    print(json.dumps(SCENARIOS[scenario](sandbox)))


# --- running a scenario as a given user (the parent, under pytest) ---------------------------------

_CLONE_NEWNS = 0x00020000
_MS_BIND, _MS_REC, _MS_PRIVATE = 1 << 12, 1 << 14, 1 << 18
_O_PATH = 0o10000000


def _hidden_folders() -> dict[str, set[str]]:
    """Folders on the way to the interpreter and the checkout that other users cannot enter, each
    with the entries beneath it the unprivileged child needs."""
    targets = {*backends.interpreter_layout(sys.executable).folders, str(REPO), os.path.realpath(sys.executable)}
    hidden: dict[str, set[str]] = {}
    for target in targets:
        parts = Path(os.path.realpath(target)).parts
        for depth in range(1, len(parts) - 1):
            folder = os.path.join(*parts[: depth + 1])
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                hidden.setdefault(folder, set()).add(parts[depth + 1])
                break
    return hidden


def _unprivileged_preexec(hidden: dict[str, set[str]], uid: int):
    def preexec() -> None:  # in the forked child, still root, before exec
        libc = ctypes.CDLL(None, use_errno=True)

        def check(ok: bool, what: str) -> None:
            if not ok:
                raise OSError(ctypes.get_errno(), what)

        check(libc.unshare(_CLONE_NEWNS) == 0, "unshare(CLONE_NEWNS)")
        check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) == 0, "mount(/, private)")
        for folder, entries in hidden.items():
            fds = {entry: os.open(os.path.join(folder, entry), _O_PATH) for entry in entries}
            check(libc.mount(b"tmpfs", folder.encode(), b"tmpfs", 0, b"mode=0755") == 0, f"mount(tmpfs, {folder})")
            for entry, fd in fds.items():
                path = os.path.join(folder, entry)
                if os.path.isdir(f"/proc/self/fd/{fd}"):
                    os.mkdir(path)
                else:
                    open(path, "w").close()
                source = f"/proc/self/fd/{fd}".encode()
                check(libc.mount(source, path.encode(), None, _MS_BIND | _MS_REC, None) == 0, f"bind {path}")
                os.close(fd)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # clears every capability

    return preexec


def _run_python(args: list[str], user: str, uid: int = UNPRIVILEGED_UID) -> dict:
    """Run the interpreter with ``args`` as ``user`` ("self", or "unprivileged": ``uid`` when this
    process is root); its last line of output, as JSON."""
    preexec = None
    if user == "unprivileged" and os.getuid() == 0:
        preexec = _unprivileged_preexec(_hidden_folders(), uid)
    elif user == "self" and os.getuid() != 0:
        pytest.skip(f"runs as root only (this process is uid {os.getuid()}); the unprivileged run covers it")
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8"}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env=env, cwd="/", preexec_fn=preexec, timeout=240, check=False)
    assert proc.returncode == 0 and proc.stdout.strip(), (proc.stdout, proc.stderr[-3000:])
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if preexec is not None:
        assert report.get("uid", uid) == uid
    return report


def _run_scenario(scenario: str, backend: str, user: str) -> dict:
    report = _run_python([__file__, scenario, backend], user)
    if "skip" in report:
        if _require_optional():
            pytest.fail(report["skip"])
        pytest.skip(report["skip"])
    return report


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("backend", ["bubblewrap", "landlock"])
def test_thread_bomb_stops_at_max_tasks(backend: str, user: str) -> None:
    report = _run_scenario("thread_bomb", backend, user)
    assert report["exit_code"] == 0, report
    # The main thread and MAX_TASKS - 1 others, then EAGAIN inside the sandbox; the host never failed.
    assert json.loads(report["stdout"]) == {"tasks": MAX_TASKS, "pthread_create": errno.EAGAIN}, report
    assert (report["host_failures"], report["host_spawn_after"]) == ([], 0), report


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("backend", ["bubblewrap", "landlock"])
def test_other_processes_cannot_be_reached_by_pid(backend: str, user: str) -> None:
    report = _run_scenario("pid_attack", backend, user)
    assert report["exit_code"] == 0, report
    seen = json.loads(report["stdout"])
    assert seen["other"] == dict.fromkeys(seen["other"], errno.EPERM), report
    assert len(seen["other"]) == 14
    assert seen["absent"] == {"sched_setscheduler": errno.ENOSYS, "ioprio_set": errno.ENOSYS,
                              "migrate_pages": errno.ENOSYS, "process_madvise": errno.EPERM,
                              "kcmp": errno.EPERM, "pidfd_open": errno.EPERM}, report
    # Its own process stays reachable through the same calls (pid 0 or its own pid).
    assert seen["own"] == {"nice": [0, 0], "affinity": 0, "prlimit": True, "session": True, "fcntl": os.O_RDWR,
                           "ioctl_fionread": 4}, report
    assert report["victim_after"] == report["victim_before"] and report["victim_alive"], report


NPROC_FALLBACK = """
import json, os, subprocess, sys, threading
sys.path.insert(0, sys.argv[1])  # imported by path, as the launcher does
import _namespaces
stand_in = subprocess.Popen(['/bin/sleep', '60'])  # another task of the same uid
_namespaces._unshare_user = lambda flags=0, required=True: False  # a machine without user namespaces
limit = _namespaces.cap_tasks(5, run_uid=0, in_own_user_ns=False)
hold = threading.Event()
try:
    for _ in range(100):
        threading.Thread(target=hold.wait, daemon=True).start()
except RuntimeError:
    pass
tasks = len(os.listdir('/proc/self/task'))
hold.set()
stand_in.kill()
print(json.dumps({"limit": limit, "tasks": tasks, "uid": os.getuid()}))
"""


def test_task_cap_without_user_namespaces_counts_the_uids_other_tasks() -> None:
    # Unprivileged (root is exempt from the limit), under a uid of its own (a process of the other
    # tests may still be exiting): the uid's tasks are this single-threaded interpreter and the
    # stand-in, so the limit is 1 other + 5, and the interpreter reaches 5.
    if os.getuid() != 0:
        pytest.skip(f"needs a uid that runs no other task, which only root can pick (this is uid {os.getuid()})")
    sandbox_dir = str(REPO / "flashrl" / "envs" / "sandbox")
    report = _run_python(["-I", "-S", "-c", NPROC_FALLBACK, sandbox_dir], "unprivileged", UNPRIVILEGED_UID + 1)
    assert (report["limit"], report["tasks"]) == (6, 5), report


@pytest.mark.parametrize(("extents", "expected"), [
    ([(0, 0, 4294967295)], 0x7F12_3456),  # the initial namespace: the drawn run uid
    ([(0, 100000, 65536)], 65535),  # a rootless container: its highest uid
    ([(0, 100000, 65534), (65534, 0, 1)], 65533),  # not the one mapped onto the host's root
    ([(0, 1000, 1)], None),  # uid 0 alone (of a host user: the cap holds without a switch)
    ([(0, 0, 1)], None),  # uid 0 alone, the host's root: the launcher refuses to run
])
def test_root_takes_a_uid_its_namespace_maps(extents: list[tuple[int, int, int]], expected: int | None) -> None:
    sys.path.insert(0, str(REPO / "flashrl" / "envs" / "sandbox"))
    try:
        import _namespaces
    finally:
        sys.path.pop(0)
    assert _namespaces._run_uid_for_root(0x7F12_3456, extents) == expected


@pytest.mark.parametrize(("release", "expected"), [
    ("6.18.44-fc-v1147", True), ("5.14.0-362.el9.x86_64", True), ("5.13.19", False), ("5.10.0-28-amd64", False),
    ("4.18.0-553.el8_10.x86_64", False), ("10.0", True),
])
def test_the_kernels_that_count_tasks_per_user_namespace(release: str, expected: bool) -> None:
    sys.path.insert(0, str(REPO / "flashrl" / "envs" / "sandbox"))
    try:
        import _namespaces
    finally:
        sys.path.pop(0)
    assert _namespaces.per_namespace_nproc(release) is expected


def test_max_tasks_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"SandboxConfig.max_tasks: expected a positive number, got 0"):
        SandboxConfig(max_tasks=0)


if __name__ == "__main__":
    _child_main(*sys.argv[1:3])
