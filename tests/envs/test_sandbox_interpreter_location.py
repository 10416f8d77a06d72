"""Every backend runs an interpreter that lives under /tmp (a checkout's venv there, as in a CI clone):
bubblewrap's private /tmp must not hide it."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from flashrl.envs.sandbox import SandboxConfig
from flashrl.envs.sandbox.runner import Sandbox, available_backends


@pytest.fixture(scope="module")
def venv_under_tmp():
    with tempfile.TemporaryDirectory(prefix="flashrl-venv-", dir="/tmp") as root:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", root], check=True,
                       timeout=120)
        yield str(Path(root) / "bin" / "python")


@pytest.mark.parametrize("backend", ["bubblewrap", "landlock"])
def test_an_interpreter_under_tmp_runs_in_the_sandbox(backend, venv_under_tmp):
    config = SandboxConfig(python=venv_under_tmp, backend=backend)
    assert backend in available_backends(config)
    result = Sandbox(config).run("import sys; print(sys.executable.startswith('/tmp/flashrl-venv-'), 6 * 7)")
    assert (result.exit_code, result.stdout.strip()) == (0, "True 42")
