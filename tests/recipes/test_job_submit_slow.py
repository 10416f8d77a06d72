"""`ray job submit` of the CPU main job against a local `ray start --head` cluster (slow: minutes).

    python -m pytest -m slow tests/recipes/test_job_submit_slow.py

The job writes where the README says, under the results root (`$FLASHRL_RESULTS`, given to the job
through its runtime env), outside the `--working-dir` package, and its checkpoints, TensorBoard run
and logs are still there after the cluster has stopped and its session folder is gone.

The cluster runs with token authentication (`RAY_AUTH_MODE=token`, a fresh random token in a file of
its own passed as `RAY_AUTH_TOKEN_PATH` to both `ray start` and `ray job submit`; Ray reads the token
from there, docs.ray.io ray-security/token-auth), on its own ports with the dashboard (and so the job
server) bound to 127.0.0.1, and is stopped at the end: its own processes only, by id (`ray stop --force`
would end every Ray cluster on the machine).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
PORTS = ("port", "dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
         "runtime-env-agent-port", "node-manager-port", "object-manager-port", "ray-client-server-port")
"""Every port `ray start` would otherwise take at a fixed default: free ones, so that another Ray cluster on
the machine (other tests, another user's) neither blocks this one nor is touched by it."""


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _stop_own_cluster(temp_dir: str, timeout_s: float = 60.0) -> None:
    """End this cluster's processes only, by id: those started with its temp dir, and their children.

    `ray stop --force` would end every Ray process of the machine, other clusters' too.
    """
    import psutil

    own = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(temp_dir in arg for arg in proc.info["cmdline"] or ()):
            own.append(proc)
    for proc in list(own):
        try:
            own += proc.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    for proc in own:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(own, timeout=timeout_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout_s)


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
    ports = dict(zip(PORTS, _free_ports(len(PORTS))))
    start = [RAY, "start", "--head", *(f"--{name}={port}" for name, port in ports.items()),
             "--dashboard-host=127.0.0.1", "--node-ip-address=127.0.0.1", "--num-cpus=2",
             f"--temp-dir={temp_dir}"]
    started = subprocess.run(start, check=False, env=env, timeout=180, capture_output=True, text=True)
    if started.returncode != 0:
        _stop_own_cluster(temp_dir)
    assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]

    def stop() -> None:
        _stop_own_cluster(temp_dir)

    try:
        yield env | {"RAY_ADDRESS": f"http://127.0.0.1:{ports['dashboard-port']}"}, stop, Path(temp_dir)
    finally:
        stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_job_submit_of_the_main_job_leaves_its_outputs_under_the_results_root(head_node, tmp_path):
    env, stop_cluster, ray_temp = head_node
    results = tmp_path / "results"
    runtime_env = {"env_vars": {"FLASHRL_RESULTS": str(results)}}
    # A short run of the main job: two updates, a periodic checkpoint after each, small batches.
    cmd = [RAY, "job", "submit", "--working-dir", str(ROOT), "--runtime-env-json", json.dumps(runtime_env), "--",
           "python", "tuned_examples/smollm2_arithmetic_cpu.py", "--stop-iters", "2", "--checkpoint-frequency", "1",
           "--train-batch-size", "8", "--episodes-in-flight", "8", "--evaluation-num-episodes", "4"]
    for _ in range(10):  # the head's job agent registers some seconds after `ray start` returns
        result = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=1800)
        logs = result.stdout + result.stderr
        if "No available agent to submit job" not in logs:  # a refused submission started nothing
            break
        time.sleep(10)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "succeeded" in logs.lower()
    # The job server refuses a client with another token: authentication is really on.
    wrong = {**env, "RAY_AUTH_TOKEN": "0" * 64}
    refused = subprocess.run([RAY, "job", "list"], check=False, env=wrong, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "token is invalid" in (refused.stdout + refused.stderr)
    printed = re.search(r"^outputs: (\S+)", logs, re.MULTILINE)
    assert printed, logs[-4000:]
    output = Path(printed.group(1))
    # where the README says: <root>/<preset>/<UTC start time>, not inside the job's working-dir package
    assert output.parent == results / "smollm2_arithmetic_cpu"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", output.name)
    assert not output.is_relative_to(ray_temp)

    stop_cluster()  # the cluster ends here; its session folder, the working-dir package in it, goes too
    shutil.rmtree(ray_temp)
    summary = json.loads((output / "result.json").read_text())
    assert summary["iterations"] == 2 and summary["checkpoint"] == str(output / "checkpoint_final")
    for checkpoint in (output / "checkpoint_final", output / "checkpoints" / "checkpoint_000002"):
        assert (checkpoint / "flashrl_checkpoint.json").is_file()
        assert (checkpoint / "policy" / "config.json").is_file()
    assert list((output / "tensorboard").glob("events.out.tfevents.*"))
    rows = [json.loads(line) for line in (output / "progress.jsonl").read_text().splitlines()]
    assert [r["training_iteration"] for r in rows] == [1.0, 2.0]
