"""An object that lives in its own worker process, its methods called over a pipe.

Some environment engines keep module-level state and break when several instances run in threads of
one process (textworld's PDDL engine does: see :mod:`flashrl.envs.alfworld.engine`). An env then
hosts its engine in a :class:`WorkerProcess`: the engine is built in a fresh interpreter (no state
copied from the parent, no fork of a process that runs threads, and, unlike ``multiprocessing``'s
``spawn``, no re-import of the parent's ``__main__``, so scripts need no ``if __name__ ==
"__main__":`` guard), connected by a socket pair; each call sends
``(method, args, kwargs)`` down a pipe and waits for the answer, as verl-agent and other agentic
frameworks run ALFWorld. The env in the parent keeps the Gymnasium contract; the worker only runs
the engine.

Failures are errors, never hangs: every call waits at most ``timeout_s`` (the worker is then killed
and :class:`EnvWorkerTimeoutError` raised), a worker that dies mid-call raises
:class:`EnvWorkerCrashedError` with its exit code, and an exception raised by the hosted object comes
back as itself (its worker-side traceback attached as a note). The worker ends when :meth:`close`
is called, when the :class:`WorkerProcess` is garbage collected, when the parent closes the pipe,
and when the parent process dies (a watcher thread sees the worker re-parented).
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

#: Seconds between the worker's checks that its parent is still alive.
_PARENT_CHECK_S = 1.0
_CLOSE = "__close__"


class EnvWorkerError(RuntimeError):
    """The worker process of an environment failed: it crashed, timed out or could not start."""


class EnvWorkerCrashedError(EnvWorkerError):
    """The worker process died (or was killed) before answering."""


class EnvWorkerTimeoutError(EnvWorkerError, TimeoutError):
    """The worker process did not answer within the call's timeout; it was killed."""


def _watch_parent(parent_pid: int) -> None:
    # Re-parenting (to init or a subreaper) means the parent died without closing the pipe (SIGKILL).
    # PR_SET_PDEATHSIG is no substitute: it fires when the *thread* that started the worker exits,
    # and envs start their workers from short-lived pool threads.
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(_PARENT_CHECK_S)


def _answer_error(conn: Connection, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(exc))
    try:
        payload = pickle.dumps(exc)
        pickle.loads(payload)  # some exceptions pickle but cannot be rebuilt
    except Exception:  # noqa: BLE001  any failure to rebuild: send the text instead
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    conn.send(("error", exc, text))


def _worker_main(fd: int) -> None:
    """Entry point of the worker interpreter: read the setup from the pipe, then serve."""
    conn = Connection(fd)
    parent_pid, path = conn.recv()  # sys.path first, so that the factory can be unpickled
    sys.path[:] = path
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        factory, args = conn.recv()
    except BaseException as exc:  # noqa: BLE001  the worker answers every failure to its host
        _answer_error(conn, exc)
        return
    _serve(conn, factory, args)


def _serve(conn: Connection, factory: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """The worker's main loop: build the object, then answer calls until told to close or orphaned."""
    try:
        target = factory(*args)
    except BaseException as exc:  # noqa: BLE001  the worker answers every failure to its host
        _answer_error(conn, exc)
        return
    conn.send(("ok", None, ""))
    while True:
        try:
            method, call_args, call_kwargs = conn.recv()
        except (EOFError, OSError):  # the parent closed its end: nobody is left to answer
            break
        if method == _CLOSE:
            close = getattr(target, "close", None)
            try:
                if close is not None:
                    close()
            finally:
                conn.send(("ok", None, ""))
            break
        try:
            result = getattr(target, method)(*call_args, **call_kwargs)
        except Exception as exc:  # noqa: BLE001  the host re-raises it (the env's own error)
            _answer_error(conn, exc)
            continue
        try:
            conn.send(("ok", result, ""))  # pickles first: a failure writes nothing
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            _answer_error(conn, TypeError(f"{method}() returned an unpicklable result: {exc}"))


def _stop(process: subprocess.Popen[bytes], conn: Connection) -> None:
    conn.close()  # the worker sees EOF and leaves its loop
    try:
        process.wait(2.0)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(2.0)


class WorkerProcess:
    """``factory(*args)`` built in a worker process; :meth:`call` runs its methods there.

    Calls are serialised (one at a time per worker) and each waits at most ``timeout_s``. Arguments
    and results cross the pipe pickled. The worker runs ``sys.executable`` with the parent's
    environment and ``sys.path``.

    Args:
        factory: A picklable callable (a module-level class or function) that builds the hosted object.
        args: Its positional arguments (picklable).
        timeout_s: Default limit of one call, in seconds (also the limit of the start).
        name: The worker's process name (shows in ``ps`` and in error messages).
    """

    def __init__(
        self,
        factory: Callable[..., Any],
        *args: Any,
        timeout_s: float = 120.0,
        name: str = "flashrl-env-worker",
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds; got {timeout_s!r}.")
        self.timeout_s = float(timeout_s)
        self.name = name
        ours, theirs = socket.socketpair()
        with ours, theirs:
            self._conn = Connection(os.dup(ours.fileno()))
            child_fd = theirs.fileno()
            self._process = subprocess.Popen(
                [sys.executable, "-c", f"from {__name__} import _worker_main; _worker_main({child_fd})"],
                pass_fds=(child_fd,),
                stdin=subprocess.DEVNULL,
            )
        # Only the worker holds its end now, so its death reads as EOF here. The finalizer also runs
        # at the interpreter's exit, which thus ends the worker.
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop, self._process, self._conn)
        try:
            self._conn.send((os.getpid(), list(sys.path)))
            self._conn.send((factory, args))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            self.kill()
            raise TypeError(f"WorkerProcess: the factory and its args must be picklable: {exc}") from exc
        self._receive(self.timeout_s, "start")

    @property
    def alive(self) -> bool:
        """Whether the worker process is running."""
        return self._finalizer.alive and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        """The worker's process id."""
        return self._process.pid

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Run ``method(*args, **kwargs)`` on the hosted object and return its result.

        Raises:
            EnvWorkerCrashedError: the worker died (or had been closed) before answering.
            EnvWorkerTimeoutError: no answer within ``timeout_s`` (default: the worker's); it was killed.
            Exception: what the hosted method raised, re-raised here.
        """
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        with self._lock:
            if not self.alive:
                raise EnvWorkerCrashedError(self._dead(f"cannot call {method}()"))
            try:
                self._conn.send((method, args, kwargs))
            except (BrokenPipeError, ConnectionError, OSError) as exc:
                raise EnvWorkerCrashedError(self._dead(f"{method}() could not be sent")) from exc
            return self._receive(limit, f"{method}()")

    def _receive(self, limit: float, what: str) -> Any:
        try:
            ready = self._conn.poll(limit)
        except (EOFError, OSError):
            ready = True  # recv below reports it
        if not ready:
            self.kill()
            raise EnvWorkerTimeoutError(
                f"{self.name} (pid {self.pid}) did not answer {what} within {limit:g} s; it was killed. "
                "Raise the env's worker timeout if the engine is just slow (large scenes, planning)."
            )
        try:
            status, value, text = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._finalizer()
            raise EnvWorkerCrashedError(self._dead(f"{what} got no answer")) from exc
        if status == "error":
            if what == "start":
                self.kill()
            value.add_note(f"Raised in {self.name} (pid {self.pid}):\n{text}")
            raise value
        return value

    def _dead(self, what: str) -> str:
        if self._closed:
            return f"{self.name} (pid {self.pid}) was closed: {what}. Start a new worker."
        return (
            f"{self.name} (pid {self.pid}) exited with code {self._process.poll()}: {what}. The engine "
            "process died (a crash, the OOM killer or a signal); the env starts a new worker at its next reset."
        )

    def kill(self) -> None:
        """End the worker now, without asking it to close its object."""
        if self._process.poll() is None:
            self._process.kill()
        self._finalizer()

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the worker to close its object and exit; kill it if it does not within ``timeout_s``."""
        if not self._finalizer.alive:
            return
        self._closed = True
        with self._lock:
            if self._process.poll() is None:
                try:
                    self._conn.send((_CLOSE, (), {}))
                    if self._conn.poll(timeout_s):
                        self._conn.recv()
                except (EOFError, OSError):
                    pass  # already gone: nothing left to close
            self._finalizer()
