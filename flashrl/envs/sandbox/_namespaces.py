"""Private namespaces of the sandboxed process, through raw system calls.

Self-contained (standard library only): the in-sandbox launcher imports it by path before any
untrusted code runs.

- :func:`enter` (Landlock backend) moves the calling (single-threaded) process into new mount, IPC,
  UTS and network namespaces, as root directly, otherwise inside a new user namespace that maps only
  the caller's own uid and gid, and mounts a size-capped tmpfs over the work dir there. The host never
  sees what the code writes (the tmpfs dies with the process) nor any SysV IPC object it makes, and
  the code's ``/proc/self/net`` (``tcp``, ``udp``, ``unix``: readable under Landlock's ``/proc/self``
  rule) shows the empty network namespace, not the host's listening ports.
- :func:`cap_tasks` (both backends) caps the tasks of the run with RLIMIT_NPROC. Since Linux 5.14
  the kernel counts RLIMIT_NPROC per (user namespace, real uid) (``ucounts``), so in a user namespace
  of its own the limit counts this run's tasks only, not the uid's other processes. The kernel skips
  the check for a real uid of 0 (``INIT_USER``) and for CAP_SYS_RESOURCE / CAP_SYS_ADMIN in the
  initial namespace, so root first takes a per-run real and effective uid (``run_uid``, no process
  owns it; inside a container's user namespace, the highest uid that namespace maps) while keeping
  file-system uid 0: files read and written exactly as before, tasks counted apart. Where no user
  namespace can be made (unprivileged, none allowed), and on kernels before 5.14 (which count per uid
  only), the limit counts every task of the uid, so it is set to the uid's tasks now plus the cap.
"""

from __future__ import annotations

import ctypes
import errno
import os

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
_MS_NOSUID = 1 << 1
_MS_NODEV = 1 << 2
_MS_REC = 1 << 14
_MS_PRIVATE = 1 << 18
_PR_SET_DUMPABLE = 4

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what} failed: {os.strerror(err)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _unshare_user(flags: int = 0, required: bool = True) -> bool:
    """Enter a new user namespace (and ``flags``' others) mapping only the caller's own uid and gid.

    False when the kernel refuses the namespace and it is not ``required``."""
    uid, gid = os.geteuid(), os.getegid()  # read before: afterwards they read as the overflow ids
    if _libc.unshare(flags | CLONE_NEWUSER) != 0:
        if not required:
            return False
        raise _fail("unshare(CLONE_NEWUSER)")
    _write("/proc/self/setgroups", "deny")  # required before an unprivileged gid_map
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    return True


def enter(workdir: str, workdir_bytes: int) -> bool:
    """Enter private namespaces (mount, IPC, UTS, network) and put a tmpfs of ``workdir_bytes`` over ``workdir``; OSError if not.

    Returns whether a user namespace was entered too (always, except as root)."""
    flags = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET
    user_ns = False
    if _libc.unshare(flags) != 0:
        if ctypes.get_errno() != errno.EPERM:
            raise _fail("unshare(mount, ipc, uts)")
        _unshare_user(flags)
        user_ns = True
    # Nothing mounted from here on propagates back to the host's mount namespace.
    if _libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        raise _fail("mount(/, MS_REC | MS_PRIVATE)")
    options = f"size={int(workdir_bytes)},mode=0700".encode()
    if _libc.mount(b"tmpfs", os.fsencode(workdir), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
        raise _fail(f"mount(tmpfs on {workdir!r})")
    return user_ns


def _tasks_of(uid: int) -> int:
    """Threads of every process whose real uid is ``uid`` (racy, read once)."""
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # exited meanwhile
            continue
        if int(fields["Uid"].split()[0]) == uid:
            total += int(fields["Threads"])
    return total


def _uid_map() -> list[tuple[int, int, int]]:
    """This process's user namespace's uid map: (first uid, first uid in the parent, count) extents."""
    with open("/proc/self/uid_map") as f:
        return [(int(a), int(b), int(c)) for a, b, c in (line.split() for line in f if line.strip())]


def per_namespace_nproc(release: str) -> bool:
    """Whether a kernel of this release counts RLIMIT_NPROC per user namespace (Linux 5.14 on)."""
    numbers = [int(part) for part in release.split("-")[0].split(".")[:2] if part.isdigit()]
    return tuple(numbers) >= (5, 14)


def _run_uid_for_root(run_uid: int, extents: list[tuple[int, int, int]]) -> int | None:
    """The uid root takes for the run: ``run_uid`` in the initial user namespace (every uid is
    mapped there); inside another one (a container's), the highest uid it maps onto a uid other than
    the parent namespace's 0; None when there is none."""
    if extents == [(0, 0, 4294967295)]:
        return run_uid
    # An extent's last uid is the candidate, unless it is 0 or maps onto the parent's 0.
    candidates = [first + count - 1 for first, lower, count in extents if first + count - 1 and lower + count - 1]
    return max(candidates, default=None)


def _take_run_uid(run_uid: int) -> None:
    """As root: real and effective uid ``run_uid`` (saved uid and file-system uid stay 0)."""
    import resource

    # A user namespace made next is checked, one level up, against the soft limit at unshare time.
    _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))
    _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # /proc/self stays owned by uid 0, the fs uid
    if _libc.setresuid(run_uid, run_uid, 0) != 0:
        raise _fail(f"setresuid({run_uid}, {run_uid}, 0)")
    _libc.setfsuid(0)  # files: read and written as uid 0 (no capabilities), as before
    if _libc.setfsuid(-1) != 0:  # setfsuid answers the previous value; -1 changes nothing
        raise OSError(f"setfsuid(0) did not hold under run uid {run_uid}")


def cap_tasks(max_tasks: int, run_uid: int, in_own_user_ns: bool) -> int:
    """Cap the tasks (threads and processes) this process and its descendants may hold at
    ``max_tasks``; returns the RLIMIT_NPROC set. Call before dropping capabilities.

    ``in_own_user_ns``: the process already sits in a user namespace made for this run alone.
    """
    import resource

    if os.getuid() == 0:
        extents = _uid_map()
        uid = _run_uid_for_root(run_uid, extents)
        if uid is not None:
            _take_run_uid(uid)
        elif (0, 0) in {(first, lower) for first, lower, _ in extents}:  # this root may be the host's
            raise OSError("cannot cap the run's tasks: uid 0 here may be the host's root (exempt from "
                          "RLIMIT_NPROC) and this user namespace maps no other uid to run under")
        in_own_user_ns = False
    others = 0
    own_ns = in_own_user_ns or _unshare_user(required=False)
    if not own_ns or not per_namespace_nproc(os.uname().release):
        # The limit counts every task of the uid here (no user namespace of its own, or a kernel
        # that counts per uid only): allow the uid's other tasks now, less this process, plus the cap.
        others = _tasks_of(os.getuid()) - 1
    limit = others + max_tasks
    resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
    return limit
