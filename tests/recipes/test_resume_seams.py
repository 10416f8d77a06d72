"""The seam of a resumed run: a tuned example killed with SIGKILL after its checkpoint at update 2 had
logged update 3; resumed from that checkpoint, its logs hold one timeline (progress.jsonl, the
algorithm's progress.jsonl and progress.csv, TensorBoard), the rows past the checkpoint sit in a side
file, and result.json keeps the evaluation taken before the first update of the run's first start."""

from __future__ import annotations

import csv
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

PRESET = Preset(name="resume_seams", description="tiny model, torch engine", success_metric="never/reached",
                success_threshold=float("inf"), stop_iters=4, node_plan=NodePlan(num_nodes=1, gpus_per_node=0),
                needs_gpu=False)


def make_config(args):
    return (FlashReinforceConfig().environment("flashrl/Math-v0", env_config={"preset": "easy_sums"})
            .env_runners(num_env_runners=1, num_cpus_per_env_runner=0.5, engine="torch",
                         episodes_in_flight_per_env_runner=2, max_new_tokens=8, max_episode_tokens=128)
            .learners(num_learners=0, num_cpus_per_learner=0.5)
            .training(model=MODEL, lr=1e-3, train_batch_size=2)
            .evaluation(evaluation_interval=100, evaluation_num_episodes=2)
            .reporting(results_dir=args.output + "/results")
            .checkpointing(checkpoint_frequency=2)
            .resources(num_cpus_for_main_process=0.5))


if __name__ == "__main__":
    sys.exit(run_preset(PRESET, make_config))
'''


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _iterations(rows: list[dict]) -> list[float | None]:
    return [r.get("training_iteration") for r in rows]


def _scalar_steps(folder: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def test_killed_run_resumes_with_one_timeline_and_its_first_evaluation(tmp_path, tiny_llama_path):
    script = tmp_path / "seams_job.py"
    script.write_text(SCRIPT.replace("MODEL", repr(tiny_llama_path)), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["FLASHRL_RESULTS"] = str(tmp_path / "results")
    out = tmp_path / "run"
    job = subprocess.Popen([sys.executable, str(script), "--output", str(out), "--stop-iters", "50"], env=env,
                           start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = out / "checkpoints" / "checkpoint_000002"
    deadline = time.monotonic() + 600

    def logged_past_the_checkpoint() -> bool:
        path = out / "progress.jsonl"
        return path.exists() and any(r.get("training_iteration", 0) >= 3 for r in _rows_so_far(path))

    while not logged_past_the_checkpoint() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(job.pid, signal.SIGKILL)  # the driver and the local Ray cluster it started
    job.wait(timeout=60)
    assert (checkpoint / "flashrl_checkpoint.json").exists(), "the run never saved its checkpoint at update 2"
    killed = _iterations(_rows_so_far(out / "progress.jsonl"))
    assert killed[:4] == [0.0, 1.0, 2.0, 3.0]  # 0: the evaluation before the first update

    resumed = subprocess.run([sys.executable, str(script), "--resume", str(checkpoint), "--stop-iters", "4"],
                             env=env, check=True, timeout=600, capture_output=True, text=True)
    assert "iteration 2, policy version 2" in resumed.stdout

    rows = _rows(out / "progress.jsonl")
    assert _iterations(rows) == [0.0, 1.0, 2.0, None, 3.0, 4.0, 4.0]  # None: the seam's marker row
    assert rows[3] == {"resumed_from_iteration": 2.0}
    assert "evaluation/episode_return_mean" in rows[0] and "evaluation/episode_return_mean" in rows[-1]
    side = _rows(out / "progress.discarded.jsonl")
    assert side[0] == {"discarded_by_resume_from_iteration": 2.0}
    assert _iterations(side[1:])[:1] == [3.0] and len(side) == len(killed) - 3 + 1

    result = json.loads((out / "result.json").read_text(encoding="utf-8"))
    assert result["evaluation_before"] == {k: v for k, v in rows[0].items() if k.startswith("evaluation/")}
    assert result["evaluation_after"]["evaluation/num_episodes"] == 2.0

    algo_rows = _rows(out / "results" / "progress.jsonl")  # the algorithm's own loggers
    assert [r["training_iteration"] for r in algo_rows] == [0.0, 1.0, 2.0, 3.0, 4.0, 4.0]
    with open(out / "results" / "progress.csv", newline="", encoding="utf-8") as f:
        assert [row["training_iteration"] for row in csv.DictReader(f)] == ["0.0", "1.0", "2.0", "3.0", "4.0", "4.0"]
    assert _scalar_steps(out / "tensorboard", "learners/version") == [1, 2, 3, 4]
    assert _scalar_steps(out / "tensorboard", "evaluation/episode_return_mean") == [0, 4]


def _rows_so_far(path: Path) -> list[dict]:
    """The complete rows of a file another process is writing (its last line may be cut short)."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows
