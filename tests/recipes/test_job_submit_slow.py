"""`ray job submit` of the CPU main job against a local `ray start --head` cluster (slow: minutes).

    python -m pytest -m slow tests/recipes/test_job_submit_slow.py

The cluster is started with `RAY_AUTH_MODE=disabled` (without an explicit mode the job CLI refuses
with an authentication error), on its own ports, and stopped at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
PORT = 6391
DASHBOARD_PORT = 8271


@pytest.fixture
def head_node():
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    # A short temp dir: Ray's unix sockets live there and their paths are limited to 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")
    start = [RAY, "start", "--head", f"--port={PORT}", f"--dashboard-port={DASHBOARD_PORT}",
             "--dashboard-host=127.0.0.1", "--num-cpus=2", f"--temp-dir={temp_dir}"]
    started = subprocess.run(start, env=env, timeout=180, capture_output=True, text=True)
    assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
    try:
        yield env | {"RAY_ADDRESS": f"http://127.0.0.1:{DASHBOARD_PORT}"}
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, timeout=120, capture_output=True)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_job_submit_runs_two_iterations_of_the_main_job(head_node, tmp_path):
    output = tmp_path / "run"
    cmd = [RAY, "job", "submit", "--working-dir", str(ROOT), "--",
           "python", "tuned_examples/smollm2_arithmetic_cpu.py", "--stop-iters", "2",
           "--output", str(output)]
    result = subprocess.run(cmd, env=head_node, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "succeeded" in (result.stdout + result.stderr).lower()
    summary = json.loads((output / "result.json").read_text())
    assert summary["iterations"] == 2
    assert (output / "checkpoint_final").is_dir()
