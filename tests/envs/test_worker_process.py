"""WorkerProcess: an object in its own process; answers, remote errors, crashes, timeouts, cleanup.

The hosted objects are standard-library classes, so the worker needs nothing from the tests folder.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from flashrl.envs.worker_process import EnvWorkerCrashedError, EnvWorkerTimeoutError, WorkerProcess


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # our own child: reap it, or it lingers as a zombie
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.1)
    return False


def test_calls_run_in_another_process_and_keep_its_state() -> None:
    worker = WorkerProcess(dict, {"a": 1}, timeout_s=60)
    assert worker.pid != os.getpid() and worker.alive
    assert worker.call("get", "a") == 1
    assert worker.call("setdefault", "b", [2, 3]) == [2, 3]
    assert worker.call("__len__") == 2
    assert worker.call("copy") == {"a": 1, "b": [2, 3]}
    worker.close()
    assert not worker.alive
    with pytest.raises(EnvWorkerCrashedError, match=r"was closed: cannot call get\(\)"):
        worker.call("get", "a")


def test_errors_of_the_hosted_object_come_back_as_themselves() -> None:
    worker = WorkerProcess(dict, timeout_s=60)
    with pytest.raises(KeyError, match="'missing'") as caught:
        worker.call("pop", "missing")
    assert any("Raised in flashrl-env-worker" in note for note in caught.value.__notes__)
    assert worker.call("get", "x", 5) == 5  # the worker lives on after an error of its object
    with pytest.raises(AttributeError, match="'dict' object has no attribute 'fly'"):
        worker.call("fly")
    worker.close()


def test_a_factory_that_fails_raises_at_start() -> None:
    with pytest.raises(TypeError, match="int"):
        WorkerProcess(dict, 3, timeout_s=60)  # dict(3): 'int' object is not iterable


def test_a_worker_killed_mid_call_is_a_crash_error_not_a_hang() -> None:
    worker = WorkerProcess(threading.Event, timeout_s=60)
    pid = worker.pid
    assert pid is not None
    killer = threading.Timer(0.5, os.kill, args=(pid, signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    with pytest.raises(EnvWorkerCrashedError, match=rf"pid {pid}\) exited with code -9: wait\(\) got no answer"):
        worker.call("wait", 30)
    assert time.monotonic() - start < 20  # the kill, not the 30 s wait, ended the call
    killer.join()
    assert not worker.alive
    with pytest.raises(EnvWorkerCrashedError):
        worker.call("is_set")


def test_a_worker_that_does_not_answer_in_time_is_killed() -> None:
    worker = WorkerProcess(threading.Event, timeout_s=60)
    pid = worker.pid
    assert pid is not None
    with pytest.raises(EnvWorkerTimeoutError, match=r"did not answer wait\(\) within 1 s; it was killed"):
        worker.call("wait", 60, timeout_s=1)
    assert _gone(pid, within_s=10)
    assert isinstance(EnvWorkerTimeoutError("x"), TimeoutError)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        WorkerProcess(dict, timeout_s=0)


def test_unpicklable_arguments_and_results_are_clear_errors() -> None:
    with pytest.raises(TypeError, match="must be picklable"):
        WorkerProcess(lambda: {}, timeout_s=60)  # noqa: PIE807  a lambda does not pickle: the point of the test
    worker = WorkerProcess(threading.Event, timeout_s=60)
    # An Event's state holds a Condition around a lock, which does not pickle.
    with pytest.raises(TypeError, match=r"__getstate__\(\) returned an unpicklable result"):
        worker.call("__getstate__")
    assert worker.call("is_set") is False  # the worker lives on
    worker.close()


def test_the_worker_ends_when_its_parent_is_killed() -> None:
    script = (
        "import os, signal, sys; from flashrl.envs.worker_process import WorkerProcess; "
        "w = WorkerProcess(dict, timeout_s=60); print(w.pid, flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    parent = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120,
        env=os.environ.copy(),
    )
    assert parent.returncode == -signal.SIGKILL
    pid = int(parent.stdout.strip())
    assert _gone(pid, within_s=15)


def test_close_ends_the_worker_process() -> None:
    worker = WorkerProcess(dict, timeout_s=60)
    pid = worker.pid
    assert pid is not None
    worker.close()
    assert _gone(pid, within_s=10)
    worker.close()  # closing twice is harmless
