"""Private mount and IPC namespaces for the Landlock backend, through raw system calls.

Self-contained (standard library only): the in-sandbox launcher imports it by path before any
untrusted code runs. :func:`enter` moves the calling (single-threaded) process into new mount, IPC
and UTS namespaces, as root directly, otherwise inside a new user namespace that maps only the
caller's own uid and gid, and mounts a size-capped tmpfs over the work dir there. The host never sees
what the code writes (the tmpfs dies with the process) nor any SysV IPC object it makes.
"""

from __future__ import annotations

import ctypes
import errno
import os

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
_MS_NOSUID = 1 << 1
_MS_NODEV = 1 << 2
_MS_REC = 1 << 14
_MS_PRIVATE = 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what} failed: {os.strerror(err)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def enter(workdir: str, workdir_bytes: int) -> None:
    """Enter private namespaces and put a tmpfs of ``workdir_bytes`` over ``workdir``; OSError if not."""
    flags = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS
    if _libc.unshare(flags) != 0:
        if ctypes.get_errno() != errno.EPERM:
            raise _fail("unshare(mount, ipc, uts)")
        uid, gid = os.getuid(), os.getgid()  # read before: afterwards they read as the overflow ids
        if _libc.unshare(flags | CLONE_NEWUSER) != 0:
            raise _fail("unshare(user, mount, ipc, uts)")
        _write("/proc/self/setgroups", "deny")  # required before an unprivileged gid_map
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    # Nothing mounted from here on propagates back to the host's mount namespace.
    if _libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        raise _fail("mount(/, MS_REC | MS_PRIVATE)")
    options = f"size={int(workdir_bytes)},mode=0700".encode()
    if _libc.mount(b"tmpfs", os.fsencode(workdir), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
        raise _fail(f"mount(tmpfs on {workdir!r})")
