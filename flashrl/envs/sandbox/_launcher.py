"""In-sandbox entry point: confine this very process, then run the untrusted code read from stdin.

Run as ``python -I -S -B _launcher.py`` by :mod:`flashrl.envs.sandbox.runner` (never imported as
part of the package, and importing only the standard library and its three sibling modules). Order:
read the settings, the seccomp program and the code from stdin, enter private mount, IPC and network
namespaces with a size-capped tmpfs work dir (Landlock backend, where the machine allows it), cap
the run's tasks (a user namespace of its own, as root under a per-run uid), set resource limits, drop
capabilities, apply Landlock, load the seccomp filter, remove this folder from ``sys.path``, then
execute the code as ``__main__``. If any requested layer fails the process exits with
:data:`SETUP_FAILED_EXIT` before a single line of untrusted code runs.

Agent mode (the settings hold ``"agent"``: a command agent run in the sandbox,
`flashrl.envs.sandbox.agent_command`): what follows the seccomp program on stdin is the task, given
to the command as its stdin; the endpoint's relay (``_agent_relay.py``) starts once the tasks are
capped and the limits set, before the capabilities are dropped; Landlock allows TCP ``connect`` to the
endpoint's port only; then the launcher replaces itself with the command (``execve``, which keeps
every layer), with the environment the settings give.
"""

from __future__ import annotations

import ctypes
import marshal
import os
import resource
import sys

SETUP_FAILED_EXIT = 121
_HERE = os.path.dirname(os.path.abspath(__file__))
_PR_SET_PDEATHSIG = 1
_SIGKILL = 9  # Linux; `import signal` would import enum, a tenth of the start-up
_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAP_LAST = 63
_SYS_CAPSET = 126


def _drop_capabilities() -> None:
    """Empty the bounding, ambient, effective, permitted and inheritable capability sets."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    for cap in range(_CAP_LAST + 1):
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the kernel's last cap; EPERM if none
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # two __user_cap_data_struct, all zero
    if libc.syscall(_SYS_CAPSET, header, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capset failed: {os.strerror(err)}")


def _confine(config: dict, expected_pid: int, bpf: bytes) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)  # die with the parent, like bwrap's child
    parent = os.getppid()
    if config["cgroup_fd"] >= 0:  # join the run's cgroup (see _cgroup.py) before anything else
        os.write(config["cgroup_fd"], b"0")
        os.close(config["cgroup_fd"])
    sys.path.insert(0, _HERE)
    try:
        own_user_ns = False
        if config["namespaces"]:
            import _namespaces

            own_user_ns = _namespaces.enter(config["workdir"], config["workdir_bytes"])
        # The work dir may just have been covered by a tmpfs: enter the folder that is now there.
        os.chdir(config["workdir"])
        if config.get("agent") is not None:
            # The command runs with the file-system uid of its real uid (execve resets it), which, as root,
            # is the per-run uid below: the work dir (bwrap's, private to this run) must be writable to it.
            os.chmod(config["workdir"], 0o777)
        if config["max_tasks"]:
            import _namespaces

            _namespaces.cap_tasks(config["max_tasks"], config["run_uid"], own_user_ns)
            # A change of uid clears the parent-death signal: set it again, and leave if the parent
            # already died meanwhile (this process would then have a new parent).
            libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
            if os.getppid() != parent:
                raise OSError(f"the parent (pid {parent}) exited during setup")
        for name, (soft, hard) in config["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        agent = config.get("agent")
        if agent is not None:
            import _agent_relay

            _agent_relay.start(agent["port"], agent["socket"])
        _drop_capabilities()
        if config["landlock"]:
            import _landlock

            _landlock.restrict(config["writable_dirs"], config["writable_files"], config["readable"],
                               (agent["port"],) if agent is not None else ())
        if config["seccomp"]:
            import _seccomp_policy

            if os.getpid() != expected_pid:  # the filter's "signal only yourself" rule names this pid
                raise OSError(f"seccomp filter compiled for pid {expected_pid}, running as {os.getpid()}")
            _seccomp_policy.load_bpf(bpf)
    finally:
        sys.path.remove(_HERE)


def main() -> None:
    # stdin: b"<pid> <n> <m>\n", the m-byte marshal dump of the settings, the n-byte seccomp BPF program
    # the parent compiled for that pid, the code. The settings come on stdin, not in argv: the code
    # can read this process's /proc/self/cmdline, and they name host paths.
    header, _, rest = sys.stdin.buffer.read().partition(b"\n")
    expected_pid, bpf_len, config_len = (int(x) for x in header.split())
    config = marshal.loads(rest[:config_len])
    bpf, code = rest[config_len:config_len + bpf_len], rest[config_len + bpf_len:]
    # Started with -S (site's .pth processing costs more than everything else here): use the
    # interpreter's normal module path, found once by the parent, and restore exit()/quit()/help().
    sys.path[:] = config["sys_path"]
    import site

    site.setquit()
    site.sethelper()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        _confine(config, expected_pid, bpf)
        if config.get("agent") is not None:
            _stdin_from(code)
    except BaseException as exc:  # noqa: BLE001 - any failure must stop before untrusted code runs
        sys.stderr.write(f"sandbox setup failed: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        os._exit(SETUP_FAILED_EXIT)
    if config.get("agent") is not None:
        argv, env = config["agent"]["argv"], config["agent"]["env"]
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as err:
            sys.stderr.write(f"{argv[0]}: {err.strerror} (in the sandbox, on PATH={env.get('PATH')})\n")
            os._exit(127 if isinstance(err, FileNotFoundError) else 126)
    _run(code.decode("utf-8", errors="replace"))


def _stdin_from(data: bytes) -> None:
    """Make ``data`` this process's stdin: a file in the work dir, unlinked once open (a pipe holds 64 KiB)."""
    path = os.path.join(os.getcwd(), ".flashrl-task")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(path)
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
        os.dup2(fd, 0)
    finally:
        os.close(fd)


def _run(source: str) -> None:
    filename = "<main>"
    sys.argv = [filename]
    sys.path.insert(0, os.getcwd())
    namespace = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": filename}
    try:
        exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - this is the sandbox
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - report like the interpreter, without our frame
        import linecache  # imported only now: it costs more than the rest of the start-up
        import traceback

        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None)
        sys.exit(1)


if __name__ == "__main__":
    main()
