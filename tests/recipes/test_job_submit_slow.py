"""`ray job submit` of the CPU main job against a local `ray start --head` cluster (slow: minutes).

    python -m pytest -m slow tests/recipes/test_job_submit_slow.py

The cluster runs with token authentication (`RAY_AUTH_MODE=token`, a fresh random token in a file of
its own passed as `RAY_AUTH_TOKEN_PATH` to both `ray start` and `ray job submit`; Ray reads the token
from there, docs.ray.io ray-security/token-auth), on its own ports with the dashboard (and so the job
server) bound to 127.0.0.1, and is stopped at the end.
"""

from __future__ import annotations

import json
import os
import secrets
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
    # A short temp dir: Ray's unix sockets live there and their paths are limited to 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")
    token = Path(temp_dir) / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):  # RAY_AUTH_TOKEN would take precedence over the file
        env.pop(name, None)
    start = [RAY, "start", "--head", f"--port={PORT}", f"--dashboard-port={DASHBOARD_PORT}",
             "--dashboard-host=127.0.0.1", "--node-ip-address=127.0.0.1", "--num-cpus=2",
             f"--temp-dir={temp_dir}"]
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
    # The job server refuses a client with another token: authentication is really on.
    wrong = {**head_node, "RAY_AUTH_TOKEN": "0" * 64}
    refused = subprocess.run([RAY, "job", "list"], env=wrong, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "token is invalid" in (refused.stdout + refused.stderr)
    summary = json.loads((output / "result.json").read_text())
    assert summary["iterations"] == 2
    assert (output / "checkpoint_final").is_dir()
