"""Runs one command agent and, when it ends, every process it started (run by path; the standard library only).

The EnvRunner starts ``python -I -S _agent_reaper.py PARENT_PID -- COMMAND...`` (`flashrl.envs.agent_env`),
in a new session. Why a process of its own, and what it guarantees without root (docs/agents.md,
"Command agents: keys and processes"):

* it makes itself a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``, Linux 3.4+): a descendant of the
  command whose parent exits, a double fork, a daemon that called ``setsid``, is re-parented to it,
  never to init, so all the command's processes stay its descendants, and a new session or process
  group does not hide one;
* when the command exits, it SIGKILLs every descendant (read from ``/proc/*/stat``, by parent) and
  reaps them, again until it has no child left, then exits with the command's status (a command
  killed by a signal: it kills itself with that signal);
* on SIGTERM (the runner cancelled the episode: its wall time, the runner stopping) it does the same
  at once, the command included; and it gets SIGTERM when the runner's thread that started it dies
  (``PR_SET_PDEATHSIG``), so no episode's processes outlive their runner.

A descendant cannot leave the subreaper's tree; what this does not stop is a process that is not a
descendant (one the command asks another service to start, such as a ``systemd-run`` unit or a
process started over a socket): that is the sandbox's part (`flashrl.envs.sandbox`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


class _Stop(Exception):
    """SIGTERM arrived: end the command and its processes now."""


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value}) failed")


def _descendants(root: int) -> list[int]:
    """The live (not yet zombie) descendants of ``root``, by the parents in ``/proc/*/stat``."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after "(comm)", which may hold spaces
        if fields and fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            found.append(pid)
            todo.append(pid)
    return found


def _kill_all() -> None:
    """SIGKILL every descendant and reap them until this process has no child left."""
    me = os.getpid()
    while True:
        for pid in _descendants(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)  # a child's end re-parents its own children here: the next round kills them
        except ChildProcessError:
            return


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write("usage: _agent_reaper.py PARENT_PID -- COMMAND...\n")
        return 2
    parent, command = int(argv[0]), argv[2:]
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    def stop(_signum: int, _frame: object) -> None:
        raise _Stop

    signal.signal(signal.SIGTERM, stop)
    status: int | None = None
    try:
        if os.getppid() != parent:  # the runner died before PR_SET_PDEATHSIG held
            raise _Stop
        child = subprocess.Popen(command, restore_signals=True)
        while status is None:
            pid, code = os.waitpid(-1, 0)  # the command, or an orphan it left (re-parented here)
            if pid == child.pid:
                status = code
    except _Stop:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _kill_all()
    if status is None:
        return 128 + signal.SIGTERM
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    return os.waitstatus_to_exitcode(status) if not os.WIFSIGNALED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
