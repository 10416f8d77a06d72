"""End-to-end runs of the recipe helpers on a tiny model (Ray, torch engine): slow, not run by default."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.cli import main
from flashrl.recipes import NodePlan, Preset, run_preset

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
TINY = Preset(
    name="tiny",
    description="tiny model, easy sums",
    success_metric="evaluation/episode_return_mean",
    success_threshold=2.0,
    stop_iters=2,
    node_plan=NodePlan(cpus_per_node=2),
    needs_gpu=False,
)


def tiny_config(model: str) -> FlashReinforceConfig:
    return (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0", env_config={"preset": "easy_sums"})
        .env_runners(
            num_env_runners=1,
            num_cpus_per_env_runner=0.5,
            engine="torch",
            episodes_in_flight_per_env_runner=4,
            max_new_tokens=8,
            max_episode_tokens=256,
        )
        .learners(num_learners=0, num_cpus_per_learner=0.5)
        .training(model=model, lr=1e-5, train_batch_size=4)
        .evaluation(evaluation_interval=1, evaluation_num_episodes=4)
    )


def test_training_run_writes_its_outputs_and_as_test_fails_below_the_bar(
    tiny_llama_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    code = run_preset(TINY, lambda args: tiny_config(tiny_llama_path), ["--output", str(out), "--as-test"])
    assert code == 1  # an accuracy of 2.0 is impossible: --as-test must fail
    lines = (out / "progress.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert json.loads(lines[-1])["training_iteration"] == 2.0
    assert (out / "checkpoint_final" / "flashrl_checkpoint.json").is_file()
    assert (out / "curves.png").stat().st_size > 1000
    result = json.loads((out / "result.json").read_text())
    assert result["iterations"] == 2 and result["reached"] is False
    assert result["evaluation_before"]["evaluation/num_episodes"] == 4.0
    assert any((out / "tensorboard").iterdir())
    # `flashrl eval` on the checkpoint plays the algorithm's evaluation episodes (same seeds, greedy)
    capsys.readouterr()
    assert main(["eval", str(out / "checkpoint_final"), "--num-episodes", "4"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    for key in ("evaluation/episode_return_mean", "evaluation/episode_len_mean", "evaluation/num_episodes"):
        assert evaluated[key] == result["evaluation_after"][key]


def test_tiny_tune_sweep_runs_its_grid(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tuned_examples" / "tune_delta_batch_sweep.py"),
            "--tiny",
            "--output",
            str(out),
            "--stop-iters",
            "1",
            "--deltas",
            "0.01",
            "0.1",
            "--batch-sizes",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "sweep_results.json").read_text())
    assert sorted(r["delta"] for r in rows) == [0.01, 0.1]
    assert all(r["iterations"] == 1 and r["error"] is None for r in rows)
