"""scripts/gpu_check.py: its options and batch here; its whole --small run (CPU, two gloo FSDP2 ranks) is slow."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
SPEC = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(SPEC)
sys.modules["gpu_check"] = gpu_check  # its dataclass looks its module up
SPEC.loader.exec_module(gpu_check)


def test_full_mode_has_the_checks_sizes() -> None:
    if torch.cuda.is_available():
        opts = gpu_check.parse_args([])
        assert (opts.batch_size, opts.length, opts.engine, opts.dtype) == (128, 4096, "vllm", "bfloat16")
    else:
        with pytest.raises(SystemExit):  # no GPU: refused with a pointer to --small
            gpu_check.parse_args([])
    assert gpu_check.QWEN25_MATH_1P5B["vocab_size"] == 151_936  # Qwen2's vocabulary, padding the tokenizer


def test_small_mode_defaults_and_the_dry_run_alias() -> None:
    opts = gpu_check.parse_args(["--dry-run"])
    assert opts.small and opts.device == "cpu" and opts.engine == "torch" and opts.num_learners == 2
    assert opts.max_tokens_per_micro_batch < opts.batch_size * opts.length  # several passes per update
    assert gpu_check.parse_args(["--small", "--engine", "vllm"]).engine == "vllm"


def test_push_route_defaults_and_refusals() -> None:
    opts = gpu_check.parse_args(["--small", "--phase", "push"])
    assert (opts.phase, opts.push_route, opts.push_iterations) == ("push", "shm", 3)
    for bad in (["--push-route", "ipc"], ["--push-iterations", "1"]):  # CPU cannot push; one batch shows nothing
        with pytest.raises(SystemExit):
            gpu_check.parse_args(["--small", *bad])
    config = gpu_check.push_config(opts, "some/model")
    assert (config.rollout_mode, config.train_batch_size, config.group_size) == ("sync_group", 8, 2)
    assert config.engine_options == {} and config.num_gpus_per_learner == 0.0  # the torch engine pulls
    vllm = gpu_check.push_config(gpu_check.parse_args(["--small", "--engine", "vllm"]), "m")
    assert vllm.engine_options["weight_sync"] == "shm"


def test_batch_has_exact_lengths_and_masks() -> None:
    opts = gpu_check.parse_args(["--small", "--batch-size", "3", "--length", "20"])
    batch = gpu_check.make_batch(opts, vocab=50, seed=0)
    assert batch.token_ids.shape == (3, 20) and bool(batch.attention_mask.all())
    assert batch.loss_mask.sum(-1).tolist() == [15, 15, 15]  # a 5-token prompt (20 // 4) outside the loss
    assert bool((batch.behavior_logprobs[~batch.loss_mask] == 0).all())
    assert batch.rewards.tolist() == [0.0, 1.0, 0.0]


def _run_small(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`gpu_check.py --small *args` in a subprocess; it must exit 0. Returns the process and its JSON."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", *args, "--output", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_small_run_end_to_end(engine: str, tmp_path: Path) -> None:
    proc, result = _run_small(tmp_path, "--engine", engine)
    assert result["ok"] and result["errors"] == {} and result["mode"] == "small"
    assert set(result["ranks"]) == {"0", "1"}
    rank0 = result["ranks"]["0"]
    assert rank0["learner"]["sharded"] and [u["applied"] for u in rank0["learner"]["updates"]] == [1.0, 1.0]
    assert all(u["num_micro_batches"] >= 2 and u["peak_bytes"] > 0 for u in rank0["learner"]["updates"])
    assert rank0["generate_before"]["versions"] == [0] and rank0["generate_after"]["versions"] == [1]
    assert rank0["update_weights_s"] > 0 and rank0["weights_bytes"] > 0
    verdict = next(line for line in proc.stdout.splitlines() if line.startswith("verdict"))
    assert verdict.split()[-1] == "OK"


@pytest.mark.slow
def test_small_push_phase_end_to_end(tmp_path: Path) -> None:
    """Step 5 on CPU: a real run through Ray (learner actor, EnvRunner actor), the shm route."""
    _, result = _run_small(tmp_path, "--phase", "push")
    assert result["ok"] and result["ranks"] == {}
    push = result["push"]
    assert push["route"] == "shm" and push["num_formations"] == 0
    assert [it["learner_version"] for it in push["iterations"]] == [1, 2, 3]
    assert [it["policy_lag_max"] for it in push["iterations"]] == [0.0, 0.0, 0.0]
