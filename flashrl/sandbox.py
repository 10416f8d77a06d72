"""flashrl's sandbox for the tools of agents: run model-written Python or a command, async, confined.

An agent whose tools run code the model wrote gets the confinement ``flashrl/PythonTool-v0`` runs it
under: the same executor (:class:`flashrl.envs.sandbox.Sandbox`), the same backends (bubblewrap, else
Landlock + seccomp, never silently none) and by default the same limits (``PYTHON_TOOL_LIMITS``, the
env's ``DEFAULT_SANDBOX``). Each run is a fresh confined process; its guarantees are tabled in
:mod:`flashrl.envs.sandbox` (no network, no writes outside a size-capped work dir, no new processes,
wall and CPU time, memory, output caps). Use::

    from flashrl.sandbox import Sandbox

    sandbox = Sandbox()  # built once (it probes the backends), then shared by the agent's episodes

    async def python_tool(code: str) -> str:
        result = await sandbox.run_python(code)
        return result.stdout + result.stderr

A run blocks a thread, not the event loop: at most ``max_concurrent`` runs at once per ``Sandbox``
(the others wait in their threads), so the episodes in flight on a runner do not start a process each at once.

**Commands.** :meth:`Sandbox.run_command` runs one program with its arguments (``["ls", "-l"]`` or a
string split as a shell would, ``"ls -l"``) in the same confinement: the sandboxed interpreter replaces
itself with the program (``execve``, which keeps every limit, the seccomp filter and Landlock). No shell
runs it: the confinement forbids new processes (``fork``), so pipes, ``;``, ``&&``, redirections,
globs, ``$VARIABLES`` and subshells cannot work (words are passed as written, as by
``subprocess.run`` with a list). A command with a shell operator outside quotes gets exit status 2 and
says so on stderr, without running. Programs are found on the sandbox's ``PATH`` (``/usr/bin``, ``/bin``).
"""

from __future__ import annotations

import asyncio
import shlex
import threading
from collections.abc import Sequence

from flashrl.envs.python_tool import DEFAULT_SANDBOX as PYTHON_TOOL_LIMITS
from flashrl.envs.sandbox import Sandbox as CodeSandbox
from flashrl.envs.sandbox import SandboxConfig, SandboxResult

__all__ = ["PYTHON_TOOL_LIMITS", "Sandbox", "SandboxConfig", "SandboxResult", "command_argv"]
SHELL_SYNTAX = frozenset({"|", "||", "&", "&&", ";", ";;", "<", ">", ">>", "<<", "(", ")", "<&", ">&", "|&"})
"""Shell operators a command may not use: no shell runs it (see the module doc)."""
_EXEC = """import os, sys
argv = {argv!r}
try:
    os.execvp(argv[0], argv)
except OSError as err:
    sys.stderr.write(f"{{argv[0]}}: {{err.strerror}}\\n")
    sys.exit(127 if isinstance(err, FileNotFoundError) else 126)
"""


class Sandbox:
    """Async runs of Python code and commands in flashrl's sandbox; see the module docstring.

    Args:
        config: The limits and the backend; ``PythonTool-v0``'s limits by default.
        max_concurrent: Runs at once (each holds a thread and a process); the others wait.
    """

    def __init__(self, config: SandboxConfig | None = None, *, max_concurrent: int = 4) -> None:
        if not isinstance(max_concurrent, int) or max_concurrent < 1:
            raise ValueError(f"Sandbox: max_concurrent must be an int >= 1; got {max_concurrent!r}.")
        self._sandbox = CodeSandbox(config or PYTHON_TOOL_LIMITS)
        # a thread's semaphore, not asyncio's: one Sandbox may serve several event loops (one per runner thread)
        self._slots = threading.BoundedSemaphore(max_concurrent)

    @property
    def config(self) -> SandboxConfig:
        return self._sandbox.config

    @property
    def backend(self) -> str:
        """The backend the runs use (``bubblewrap`` or ``landlock``; ``unconfined`` only when allowed)."""
        return self._sandbox.backend

    async def run_python(self, code: str) -> SandboxResult:
        """Run ``code`` as ``__main__`` in a fresh confined interpreter; what it printed, its status, limit hits."""
        return await asyncio.to_thread(self._run, code)

    def _run(self, code: str) -> SandboxResult:
        with self._slots:
            return self._sandbox.run(code)

    async def run_command(self, command: str | Sequence[str]) -> SandboxResult:
        """Run one program (``argv`` or a string split as a shell would) confined; exit status 127 when it is not
        found, 2 (not run) when the string uses shell syntax (pipes, ``;``, redirections)."""
        argv, problem = command_argv(command)
        if problem is not None:
            return SandboxResult(stdout="", stderr=f"sandbox: {problem}\n", exit_code=2, timed_out=False,
                                 output_truncated=False, killed_by=None, duration_s=0.0,
                                 backend=self._sandbox.backend)
        return await self.run_python(_EXEC.format(argv=argv))


def command_argv(command: str | Sequence[str]) -> tuple[list[str], str | None]:
    """A command's argv, or why it cannot run without a shell (then ``([], reason)``)."""
    if isinstance(command, str):
        try:
            argv = shlex.split(command)
            # the operators outside quotes: a lexer that keeps the quotes in its words sees only those alone
            lexer = shlex.shlex(command, posix=False, punctuation_chars=True)
            lexer.whitespace_split = True
            operators = sorted({word for word in lexer if word in SHELL_SYNTAX})
        except ValueError as err:  # an unclosed quote
            return [], f"cannot split the command: {err}"
        if operators:
            return [], (f"the command uses shell syntax ({', '.join(operators)}), and no shell runs it here (the "
                        "sandbox allows no new processes): run one program with its arguments, or do the rest in "
                        "Python")
    else:
        argv = list(command)
    if not argv or not all(isinstance(word, str) and word and "\0" not in word for word in argv):
        return [], f"expected a program and its arguments (non-empty strings); got {command!r:.200}"
    return argv, None
