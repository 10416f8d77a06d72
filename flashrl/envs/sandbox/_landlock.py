"""Landlock (Linux security module) through raw system calls.

Self-contained (standard library only): the in-sandbox launcher imports it by path before any
untrusted code runs, and the parent imports it to probe the kernel's Landlock ABI.

A process that calls :func:`restrict` can afterwards (a) write, create, remove, rename or truncate
files only beneath the allowed directories, (b) neither bind nor connect TCP sockets (ABI >= 4) but ``connect`` to the ports it is given,
(c) neither send signals to nor connect to abstract unix sockets of processes outside its domain
(ABI >= 6), and (d) never ptrace or read ``/proc/<pid>/environ`` of processes outside its domain
(every ABI), and (e) optionally read and execute only files beneath an allow-list.
"""

from __future__ import annotations

import ctypes
import os

_SYS_CREATE_RULESET = 444
_SYS_ADD_RULE = 445
_SYS_RESTRICT_SELF = 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_RULE_NET_PORT = 2
_PR_SET_NO_NEW_PRIVS = 38

# Filesystem access rights (uapi/linux/landlock.h) and the ABI that introduced them.
FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13  # ABI 2
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5
NET_BIND_TCP = 1 << 0  # ABI 4
NET_CONNECT_TCP = 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1  # ABI 6

_WRITE_RIGHTS_ABI1 = (
    FS_WRITE_FILE | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE_CHAR | FS_MAKE_DIR | FS_MAKE_REG
    | FS_MAKE_SOCK | FS_MAKE_FIFO | FS_MAKE_BLOCK | FS_MAKE_SYM
)
_FILE_ONLY_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _NetPortAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def abi_version() -> int:
    """The kernel's Landlock ABI version, or 0 when Landlock is unsupported or disabled."""
    version = _libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0),
                            ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(int(version), 0)


def handled_write_rights(abi: int) -> int:
    """Every write-like filesystem right the given ABI knows."""
    rights = _WRITE_RIGHTS_ABI1
    if abi >= 2:
        rights |= FS_REFER
    if abi >= 3:
        rights |= FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


def _fail(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"landlock {what} failed: {os.strerror(err)}")


def restrict(writable_dirs: list[str], writable_files: list[str], readable: list[str] | None = None,
             connect_ports: tuple[int, ...] = ()) -> int:
    """Restrict the calling process (and its future children) for good; returns the ABI applied.

    Writes are allowed only beneath ``writable_dirs`` and to ``writable_files``. With ``readable``
    (files or folders), reading and executing are allowed only there (and in the writable paths);
    without it, reading stays unrestricted. Paths that do not exist are skipped. TCP ``connect`` is
    allowed to ``connect_ports`` only (a port on any address: Landlock knows no hosts), ``bind`` never
    (ABI >= 4; below, TCP is not restricted). Raises OSError when Landlock is unavailable or a call
    fails; the caller must then not run untrusted code.
    """
    abi = abi_version()
    if abi < 1:
        raise OSError("Landlock is not available in this kernel (ABI 0)")
    write = handled_write_rights(abi)
    read = FS_READ_FILE | FS_READ_DIR | FS_EXECUTE if readable is not None else 0
    handled_fs = write | read
    attr = _RulesetAttr(handled_fs, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
                        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else (16 if abi >= 4 else 8)
    ruleset_fd = _libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                               ctypes.c_uint32(0))
    if ruleset_fd < 0:
        raise _fail("create_ruleset")
    rules = [(d, handled_fs) for d in writable_dirs]
    rules += [(f, (write | read) & ~FS_EXECUTE) for f in writable_files]
    rules += [(p, read) for p in readable or []]
    try:
        for port in connect_ports if abi >= 4 else ():
            net_rule = _NetPortAttr(NET_CONNECT_TCP, port)
            if _libc.syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset_fd), ctypes.c_int(_RULE_NET_PORT),
                             ctypes.byref(net_rule), ctypes.c_uint32(0)) != 0:
                raise _fail(f"add_rule(tcp connect port {port})")
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                if not os.path.isdir(path):
                    rights &= _FILE_ONLY_RIGHTS
                rule = _PathBeneathAttr(rights, fd)
                if _libc.syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset_fd), ctypes.c_int(_RULE_PATH_BENEATH),
                                 ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    raise _fail(f"add_rule({path!r})")
            finally:
                os.close(fd)
        if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise _fail("prctl(PR_SET_NO_NEW_PRIVS)")
        if _libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(ruleset_fd), ctypes.c_uint32(0)) != 0:
            raise _fail("restrict_self")
    finally:
        os.close(ruleset_fd)
    return abi
