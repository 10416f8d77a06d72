"""Every tuned example's --dry-run: a coherent plan exits 0; an incoherent override does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashrl.cli import main
from flashrl.recipes.plan import _first_fit
from flashrl.recipes.preset import NodePlan
from flashrl.reproduction.experiments import FLASHRL_CHOICES

EXAMPLES = Path(__file__).resolve().parents[2] / "tuned_examples"


def preset_names() -> list[str]:
    return sorted(p.stem for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))


def dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["train", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_every_tuned_example_is_covered() -> None:
    names = preset_names()
    for expected in (
        "qwen25_math_1p5b",
        "r1_distill_qwen_1p5b_long_cot",
        "python_tool_qwen25_7b",
        "python_tool_qwen3_30b_a3b",
        "alfworld_qwen25_7b",
        "tune_delta_batch_sweep",
    ):
        assert expected in names


@pytest.mark.parametrize("name", preset_names())
def test_dry_run_prints_a_coherent_plan(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = dry_run(capsys, name, "--dry-run")
    assert code == 0, out + err
    for section in (
        "-- resolved config --",
        "-- actors and resources --",
        "-- memory estimate --",
        "-- pinned versions --",
        "-- prerequisites (this machine) --",
    ):
        assert section in out
    assert "VERDICT: COHERENT PLAN" in out
    assert "exit code 0" in out


def test_tiny_sweep_dry_run_shows_the_grid(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = dry_run(
        capsys,
        "tune_delta_batch_sweep",
        "--dry-run",
        "--tiny",
        "--deltas",
        "0.01",
        "0.1",
        "--batch-sizes",
        "4",
        "8",
        "16",
    )
    assert code == 0
    assert "delta: [0.01, 0.1]" in out and "train_batch_size: [4, 8, 16]" in out and "trials: 6" in out
    assert 'engine = "torch"' in out


def test_memory_plan_of_the_math_preset(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = dry_run(capsys, "qwen25_math_1p5b", "--dry-run")
    # 1,543,714,304 parameters sharded over 4 learners: 385,928,576 x 4 bytes = 1.44 GiB of float32 master
    # shards, twice that for AdamW; 128 / 4 = 32 rows x 6144 tokens per learner in one pass (no budget)
    assert "(bfloat16, adamw, FSDP2 over 4 learners)" in out
    assert "(FSDP2 data parallel, each holding 1/4 of the state)" in out and "full replica" not in out
    assert "float32 master 1.44 GiB + optimizer 2.88 GiB" in out
    assert "196608 padded tokens in one pass" in out
    assert "(4 sequences x 6144 tokens x" in out  # 16 rollouts in flight (common.json) over 4 env runners


def test_the_moe_preset_shards_and_bounds_its_passes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = dry_run(capsys, "python_tool_qwen3_30b_a3b", "--dry-run")
    assert code == 0
    assert "3.35B active per token, 128 experts" in out
    assert "split over 4" in out
    assert "FSDP2 over 8 learners" in out and "passes of at most 16384 tokens" in out
    assert "max_tokens_per_micro_batch=16384: flashrl's choice" in out
    # 30.5B parameters / 8 learners x (float32 master + AdamW's 2 moments) = 42.65 GiB per learner's shard
    assert "checkpoint save: sharded DCP, every learner writes its own shard (no gather): host +42.65 GiB" in out


def test_negative_delta_fails_with_the_config_message(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = dry_run(capsys, "qwen25_math_1p5b", "--dry-run", "--delta", "-0.1")
    assert code == 2
    assert "delta: expected a number >= 0 (math.inf = no trust region), got -0.1" in err
    assert "VERDICT" not in out


def test_more_gpus_than_the_node_plan_is_incoherent(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = dry_run(capsys, "qwen25_math_1p5b", "--dry-run", "--num-env-runners", "9")
    assert code == 1
    assert "GPU: the run asks for 13 in total" in out and "but the cluster has 8" in out
    assert "VERDICT: INCOHERENT" in out


def test_an_actor_larger_than_a_node_is_incoherent(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = dry_run(
        capsys,
        "qwen25_math_1p5b",
        "--dry-run",
        "--num-learners",
        "1",
        "--num-gpus-per-learner",
        "16",
        "--num-nodes",
        "3",
    )
    assert code == 1  # the actor, the plan's GPUs per node and the flag that changes them
    assert "learner 0 needs 16 GPUs on one node, but the node plan has 8 per node (3 node(s) x [8 GPUs" in out
    assert "Fix: --gpus-per-node 16 or more, or give that actor fewer." in out
    assert "VERDICT: INCOHERENT" in out


def test_engine_parallelism_must_match_runner_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = dry_run(
        capsys, "qwen25_math_1p5b", "--dry-run", "--num-env-runners", "2", "--num-gpus-per-env-runner", "2"
    )
    assert code == 1
    assert "tensor_parallel_size" in out and "reserves 2 GPUs" in out


def test_strict_turns_missing_prerequisites_into_exit_3(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = dry_run(capsys, "alfworld_qwen25_7b", "--dry-run", "--strict")
    assert code == 3  # no GPU and no model here
    assert "[FAIL] GPUs visible" in out and "exit code 3 (--strict)" in out


def test_first_fit_packs_or_refuses() -> None:
    two_nodes = NodePlan(num_nodes=2, gpus_per_node=8, cpus_per_node=16)
    fives = [(f"runner {i}", {"CPU": 1.0, "GPU": 5.0}) for i in range(3)]
    assert _first_fit(fives, two_nodes) is None  # 15 <= 16 GPUs in total, but 5 + 5 > 8 on one node
    fours = [(f"runner {i}", {"CPU": 1.0, "GPU": 4.0}) for i in range(4)]
    assert _first_fit(fours, two_nodes) == [["runner 0", "runner 1"], ["runner 2", "runner 3"]]


GPU_PRESETS = sorted(c.script for c in FLASHRL_CHOICES.values())


@pytest.mark.parametrize("script", GPU_PRESETS)
def test_every_gpu_preset_learner_fits_its_gpu(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = dry_run(capsys, script, "--dry-run")
    assert code == 0, out + err
    line = next(x for x in out.splitlines() if "learner on its GPU:" in x)
    need, _, have = line.split("learner on its GPU:")[1].partition(" of ")
    assert have.strip() == "80.00 GiB"
    assert need.strip().endswith("GiB") and float(need.split()[0]) < 80.0, line
    assert "exceeds its GPU share" not in out


def test_the_moe_preset_fits_only_because_of_its_micro_batch_budget() -> None:
    from flashrl.plan.architectures import architecture_for
    from flashrl.plan.memory import GIB, learner_memory

    choices = FLASHRL_CHOICES["qwen3_tool_ablation"]
    common = {"dtype": "bfloat16", "optimizer": "adamw", "train_batch_size": 128, "num_learners": choices.num_learners,
                  "max_episode_tokens": 16384, "gradient_checkpointing": True, "logprob_chunk_size": 1024}
    arch = architecture_for("Qwen/Qwen3-30B-A3B")
    bounded = learner_memory(arch, max_tokens_per_micro_batch=choices.max_tokens_per_micro_batch, **common)
    one_pass = learner_memory(arch, max_tokens_per_micro_batch=None, **common)
    assert bounded.tokens == 16384 and one_pass.tokens == 16 * 16384
    assert bounded.total < 80 * GIB < one_pass.total
