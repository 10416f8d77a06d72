"""The seccomp system-call policy of the sandbox (built with the ``pyseccomp`` bindings of libseccomp).

The parent compiles the policy to a BPF program (:func:`compile_bpf`, needs pyseccomp); the
in-sandbox launcher imports this file by path and loads the program (:func:`load_bpf`, standard
library only) before any untrusted code runs.

An allow-list. :data:`ALLOWED_SYSCALLS` (files, memory, threads, time, pipes, polling, signals
to itself: what CPython, numpy and the standard library call) pass; a few pass only with safe
arguments (below); every other system call fails with ENOSYS, as on a kernel that lacks it, so libc
falls back where it can (``clone3`` -> ``clone``, ``faccessat2`` -> ``faccessat``). On top, these
fail with EPERM, the error a program expects from a refused operation, because each one is an
escape or a resource-exhaustion route:

- ``socket``: every address family (TCP, UDP, raw, netlink, unix). ``socketpair`` stays allowed for
  AF_UNIX only (asyncio's self-pipe), and its sockets cannot reach anything else: ``connect``,
  ``bind``, ``listen``, ``accept*``, ``sendmsg``/``sendmmsg`` and ``sendto`` with an address are
  denied, so a datagram can never be addressed to a socket of the host.
- System V IPC (``shm*``, ``msg*``, ``sem*``) and POSIX message queues (``mq_*``): their objects
  outlive the process on the host, outside the address-space limit, and ``shmat`` would reach the
  host's segments.
- process creation: ``fork``, ``vfork``, ``clone`` without ``CLONE_THREAD`` (``clone3`` is not
  allowed: ENOSYS, so libc falls back to ``clone`` for threads). Threads stay allowed up to
  ``max_tasks`` (RLIMIT_NPROC in a user namespace of the run's own, see ``_namespaces.py``).
- signals to any process but the sandboxed one: ``kill``/``tgkill``/``rt_(tg)sigqueueinfo`` whose
  target is not the caller's own pid, ``tkill``, ``pidfd_open``, ``pidfd_send_signal``, and a SIGIO
  owner set by ``fcntl(F_SETOWN/F_SETOWN_EX)`` or ``ioctl(FIOSETOWN/SIOCSPGRP)``.
- reaching another process by pid: ``setpriority``/``getpriority`` (``PRIO_PROCESS`` only),
  ``sched_{set,get}affinity``, ``sched_get{param,scheduler,attr}``, ``prlimit64``, ``getsid``,
  ``getpgid``, ``setpgid`` and ``get_robust_list`` pass for pid 0 or the caller's own pid only;
  ``capget`` (its pid hides in memory) is refused. With the Landlock backend the code shares the
  host's pid namespace: without this it could renice or pin a trainer of the same uid.
- raising resource limits: ``setrlimit``, ``prlimit64`` with a new limit (reading one passes).
- changing metadata of files Landlock does not cover: ``chmod``/``chown``/``*xattr``/``utime*``.
- kernel attack surface and namespace/ptrace tricks: ``ptrace``, ``process_vm_*``, ``mount``,
  ``unshare``, ``setns``, ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring_*`` (it would
  bypass this filter), ``keyctl``, module loading, ``kexec``, ``reboot``, ...
Syscalls of a foreign architecture (32-bit entry points) kill the process (libseccomp's default).

The *agent* profile (``agent=True``: a command agent run in the sandbox, `flashrl.envs.sandbox.agent_command`)
runs only under bubblewrap, in pid and net namespaces of its own, and allows what an agent program
needs: processes (``fork``, ``vfork``, ``clone`` without a namespace flag; tasks capped by RLIMIT_NPROC),
sockets of every family and ``connect``/``bind``/``sendmsg`` (its net namespace holds only loopback and
the endpoint's relay; Landlock allows TCP ``connect`` to the endpoint's port only), and signals and
pid arguments to any pid (its pid namespace holds only its own processes). The rest is as above.
"""

from __future__ import annotations

import ctypes
import errno
import os

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2

CLONE_THREAD = 0x00010000

ALLOWED_SYSCALLS: tuple[str, ...] = (
    # files and folders (Landlock and the mounts decide which ones)
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "preadv2", "pwritev2",
    "open", "openat", "openat2", "creat", "close", "close_range", "lseek", "stat", "fstat", "lstat",
    "newfstatat", "statx", "statfs", "fstatfs", "access", "faccessat", "faccessat2", "getdents",
    "getdents64", "getcwd", "chdir", "fchdir", "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat",
    "rename", "renameat", "renameat2", "link", "linkat", "symlink", "symlinkat", "readlink",
    "readlinkat", "truncate", "ftruncate", "fallocate", "fsync", "fdatasync", "sync_file_range",
    "fadvise64", "flock", "dup", "dup2", "dup3", "pipe", "pipe2", "sendfile",
    "copy_file_range", "splice", "tee", "umask", "getxattr", "lgetxattr", "fgetxattr", "listxattr",
    "llistxattr", "flistxattr", "mknod", "mknodat", "readahead", "execve",
    "execveat",
    # memory
    "brk", "mmap", "munmap", "mremap", "mprotect", "madvise", "msync", "mincore", "mlock", "mlock2",
    "munlock", "membarrier", "mbind", "get_mempolicy", "set_mempolicy", "pkey_alloc", "pkey_free",
    "pkey_mprotect",
    # threads, scheduling, identity (read-only)
    "futex", "futex_waitv", "set_robust_list", "set_tid_address", "rseq",
    "arch_prctl", "prctl", "gettid", "getpid", "getppid", "getpgrp", "setsid",
    "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups",
    "getrlimit", "getrusage", "sched_yield",
    "sched_get_priority_max", "sched_get_priority_min", "uname", "sysinfo", "times",
    "getrandom", "getcpu", "restart_syscall", "wait4", "waitid", "exit", "exit_group",
    # time
    "clock_gettime", "clock_getres", "clock_nanosleep", "nanosleep", "gettimeofday", "time",
    "getitimer", "setitimer", "alarm", "timer_create", "timer_settime", "timer_gettime",
    "timer_getoverrun", "timer_delete", "timerfd_create", "timerfd_settime", "timerfd_gettime",
    # waiting and events
    "poll", "ppoll", "select", "pselect6", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait",
    "epoll_pwait", "epoll_pwait2", "eventfd", "eventfd2", "pause",
    # signals (delivery to itself only: see SIGNAL_SYSCALLS)
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigtimedwait",
    "rt_sigsuspend", "sigaltstack", "signalfd", "signalfd4",
    # the sockets of a socketpair (see build_filter for socketpair and sendto)
    "recvfrom", "recvmsg", "recvmmsg", "shutdown", "getsockname", "getpeername", "getsockopt",
    "setsockopt",
)
"""System calls that pass with any arguments."""

DENIED_SYSCALLS: tuple[str, ...] = (
    "socket", "fork", "vfork", "tkill", "pidfd_open", "pidfd_send_signal", "setrlimit",
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat",
    "capget", "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "utime", "utimes", "utimensat", "futimesat",
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
    "unshare", "setns", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "keyctl", "add_key", "request_key", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct",
    "syslog", "quotactl", "name_to_handle_at", "open_by_handle_at", "fanotify_init",
    "move_mount", "open_tree", "fsopen", "fsmount", "fspick", "mount_setattr",
    "connect", "bind", "listen", "accept", "accept4", "sendmsg", "sendmmsg",
    "shmget", "shmat", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semtimedop",
    "semctl", "ipc", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups", "setfsuid", "setfsgid",
    "capset", "kcmp", "process_madvise", "memfd_secret", "sethostname", "setdomainname", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex", "iopl", "ioperm", "vhangup", "lookup_dcookie",
)
AF_UNIX = 1
SIGNAL_SYSCALLS: tuple[str, ...] = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")
SELF_PID_SYSCALLS: tuple[str, ...] = (
    "getpgid", "getsid", "setpgid", "get_robust_list", "sched_getaffinity", "sched_setaffinity",
    "sched_getparam", "sched_getscheduler", "sched_getattr",
)
"""System calls whose first argument names a process: they pass for 0 or the caller's own pid only."""
PRIO_SYSCALLS: tuple[str, ...] = ("getpriority", "setpriority")
PRIO_PROCESS = 0
F_SETOWN, F_SETOWN_EX = 8, 15
"""fcntl commands that name a process to receive SIGIO (or the signal F_SETSIG picks, SIGKILL too)."""
FCNTL_COMMANDS: tuple[int, ...] = (
    0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 16, 17, 36, 37, 38,  # F_DUPFD .. F_SETLKW, F_GETOWN .., F_OFD_*
    *range(1024, 1039),  # F_SETLEASE .. F_SET_FILE_RW_HINT (F_DUPFD_CLOEXEC, pipe sizes, seals, ...)
)
"""fcntl commands that pass: every one the kernel knows but F_SETOWN and F_SETOWN_EX."""
FIOSETOWN, SIOCSPGRP = 0x8901, 0x8902
"""ioctl commands that set a socket's SIGIO owner, like F_SETOWN."""
_LOW32 = 0xFFFF_FFFF


AGENT_ALLOWED_SYSCALLS: tuple[str, ...] = (
    "socket", "fork", "vfork", "connect", "bind", "listen", "accept", "accept4", "sendmsg", "sendmmsg", "sendto",
    "socketpair", "kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "tkill", "pidfd_open",
    "pidfd_send_signal", *SELF_PID_SYSCALLS,
)
"""What the agent profile allows on top of `ALLOWED_SYSCALLS` (its namespaces bound their reach)."""
CLONE_NEW_FLAGS = 0x7E02_0080
"""CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME: a clone that makes a namespace."""


def build_filter(self_pid: int, agent: bool = False):  # -> pyseccomp.SyscallFilter
    """The filter for a sandboxed process whose pid (as it sees itself) is ``self_pid`` (``agent``: the
    agent profile of the module docstring, for which ``self_pid`` is unused).

    Raises ImportError when pyseccomp is missing and OSError when libseccomp refuses a rule.
    """
    import pyseccomp as seccomp

    flt = seccomp.SyscallFilter(defaction=seccomp.ERRNO(errno.ENOSYS))
    allow = seccomp.ALLOW
    deny = seccomp.ERRNO(errno.EPERM)
    arch = seccomp.system_arch()

    def add(action: int, name: str, *args: object) -> None:
        if seccomp.resolve_syscall(arch, name) < 0:  # not a syscall on this architecture
            return
        flt.add_rule(action, name, *args)

    for name in ALLOWED_SYSCALLS:
        add(allow, name)
    if agent:
        for name in AGENT_ALLOWED_SYSCALLS:
            add(allow, name)
        for name in DENIED_SYSCALLS:
            if name not in AGENT_ALLOWED_SYSCALLS:
                add(deny, name)
        # processes and threads, but no new namespace (the default, ENOSYS, answers a clone with one)
        add(allow, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_NEW_FLAGS, 0))
        for name in PRIO_SYSCALLS:  # PRIO_PROCESS only: PRIO_USER reaches the uid's tasks outside the namespace
            add(allow, name, seccomp.Arg(0, seccomp.EQ, PRIO_PROCESS))
            add(deny, name, seccomp.Arg(0, seccomp.NE, PRIO_PROCESS))
        add(allow, "prlimit64", seccomp.Arg(2, seccomp.EQ, 0))  # reading a limit
        add(deny, "prlimit64", seccomp.Arg(2, seccomp.NE, 0))
        _fcntl_and_ioctl(add, allow, deny)
        return flt
    for name in DENIED_SYSCALLS:
        add(deny, name)
    # Threads (CLONE_THREAD) only; clone3 hides its flags in memory, so libc must fall back to clone.
    add(allow, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, CLONE_THREAD))
    add(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))
    for name in SIGNAL_SYSCALLS:
        add(allow, name, seccomp.Arg(0, seccomp.EQ, self_pid))
        add(deny, name, seccomp.Arg(0, seccomp.NE, self_pid))
    # A process argument must be 0 or the caller's own pid (compared on all 64 bits: a pid with high
    # bits set, which the kernel would truncate to another one, is refused). No host pid is reachable.
    for name in SELF_PID_SYSCALLS:
        _self_only(add, allow, deny, name, self_pid, pid_arg=0)
    for name in PRIO_SYSCALLS:  # which == PRIO_PROCESS only: PRIO_USER would reach every task of the uid
        _self_only(add, allow, deny, name, self_pid, pid_arg=1, prefix=(seccomp.Arg(0, seccomp.EQ, PRIO_PROCESS),))
        add(deny, name, seccomp.Arg(0, seccomp.NE, PRIO_PROCESS))
    for pid in (0, self_pid):  # reading one's own limit
        add(allow, "prlimit64", seccomp.Arg(0, seccomp.EQ, pid), seccomp.Arg(2, seccomp.EQ, 0))
        add(deny, "prlimit64", seccomp.Arg(0, seccomp.EQ, pid), seccomp.Arg(2, seccomp.NE, 0))
    add(deny, "prlimit64", seccomp.Arg(0, seccomp.NE, 0))
    _fcntl_and_ioctl(add, allow, deny)
    add(allow, "socketpair", seccomp.Arg(0, seccomp.EQ, AF_UNIX))
    add(deny, "socketpair", seccomp.Arg(0, seccomp.NE, AF_UNIX))
    add(allow, "sendto", seccomp.Arg(4, seccomp.EQ, 0))  # send() on a connected pair: no address
    add(deny, "sendto", seccomp.Arg(4, seccomp.NE, 0))
    return flt


def _fcntl_and_ioctl(add, allow: int, deny: int) -> None:
    """fcntl and ioctl pass, but for the commands that set a SIGIO owner."""
    import pyseccomp as seccomp

    # No SIGIO (or the signal F_SETSIG picks) to another process through a file or socket it owns.
    # The kernel reads a command as 32 bits, so only those are compared: a command with high bits set
    # is the command of its low 32 bits.
    for command in FCNTL_COMMANDS:
        add(allow, "fcntl", seccomp.Arg(1, seccomp.MASKED_EQ, _LOW32, command))
    for command in (F_SETOWN, F_SETOWN_EX):
        add(deny, "fcntl", seccomp.Arg(1, seccomp.MASKED_EQ, _LOW32, command))
    # ioctl's commands are too many to list: the two denials are added first, which makes libseccomp
    # test them before the catch-all (checked by tests/envs/test_sandbox_pids.py).
    for command in (FIOSETOWN, SIOCSPGRP):
        add(deny, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, _LOW32, command))
    add(allow, "ioctl", seccomp.Arg(1, seccomp.NE, FIOSETOWN))


def _self_only(add, allow: int, deny: int, name: str, self_pid: int, pid_arg: int, prefix: tuple = ()) -> None:
    """``name`` passes when its argument ``pid_arg`` is 0 or ``self_pid``, else fails with EPERM
    (libseccomp tests the equalities of one argument before its inequality, whatever the order)."""
    import pyseccomp as seccomp

    for pid in (0, self_pid):
        add(allow, name, *prefix, seccomp.Arg(pid_arg, seccomp.EQ, pid))
    add(deny, name, *prefix, seccomp.Arg(pid_arg, seccomp.NE, 0))


def compile_bpf(self_pid: int, agent: bool = False) -> bytes:
    """The filter as a classic-BPF program (``struct sock_filter`` array), ready for :func:`load_bpf`."""
    import tempfile

    with tempfile.TemporaryFile() as f:
        build_filter(self_pid, agent).export_bpf(f)
        f.seek(0)
        return f.read()


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_bpf(program: bytes) -> None:
    """Install a compiled filter into the calling thread's process for good (standard library only).

    The sandboxed process loads what the parent compiled, so it never imports pyseccomp (whose import
    would cost more than the rest of the start-up).
    """
    if not program or len(program) % 8:
        raise OSError(f"seccomp: expected a BPF program of 8-byte instructions, got {len(program)} bytes")
    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_SECCOMP) failed: {os.strerror(err)}")
