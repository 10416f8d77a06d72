"""scripts/gpu_check.py: its options, batch, FLOP count and tokenizer here; its --small run on a simulated GPU machine.

The simulated machine is the one the check is written for (``docs/engines.md``, "Checking a GPU
machine"): no package index, empty model caches, and vLLM, Ray, gymnasium and math-verify not
importable (a ``sitecustomize`` in the child process blocks them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
SPEC = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(SPEC)
sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up
SPEC.loader.exec_module(gpu_check)

BLOCKED = ("vllm", "ray", "gymnasium", "math_verify")
SITECUSTOMIZE = f'''
import importlib.abc, sys

class _Absent(importlib.abc.MetaPathFinder):
    """What the GPU machine lacks: these imports raise ImportError as they would there."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"No module named {{name!r}} (simulated GPU machine)")
        return None

sys.meta_path.insert(0, _Absent())
'''


def test_full_mode_has_the_checks_sizes() -> None:
    if torch.cuda.is_available():
        opts = gpu_check.parse_args([])
        assert (opts.batch_size, opts.length, opts.max_tokens_per_micro_batch) == (128, 4096, 16384)
        assert (opts.dtype, opts.logprob_tokens, opts.logprob_vocab) == ("bfloat16", (8192, 16384), 151_936)
    else:
        with pytest.raises(SystemExit):  # no GPU: refused with a pointer to --small
            gpu_check.parse_args([])


def test_small_mode_defaults_phases_and_the_dry_run_alias() -> None:
    opts = gpu_check.parse_args(["--dry-run"])
    assert opts.small and opts.device == "cpu" and opts.dtype == "float32" and opts.engine == "torch"
    assert opts.phases == ("matmul", "learner", "logprobs", "engine", "fsdp", "packed", "push")
    assert opts.batch_size * opts.length == 2 * opts.max_tokens_per_micro_batch  # two passes per update
    # phases run in their fixed order whatever order they are named in
    assert gpu_check.parse_args(["--small", "--phase", "fsdp", "learner"]).phases == ("learner", "fsdp")


def test_bad_options_are_refused() -> None:
    for bad in (
        ["--push-route", "ipc"],  # CPU cannot push
        ["--push-iterations", "1"],  # one batch shows nothing about a push
        ["--length", "256", "--max-tokens-per-micro-batch", "128"],  # a trajectory is never split
        ["--phase", "update"],  # the first version's phase name is gone
        ["--engine", "torch"],  # no abbreviation: it once read as --engine-prompts
    ):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(["--small", *bad])


@pytest.mark.parametrize(("route", "gpus", "needed"), [("shm", 1, 2), ("nccl", 1, 2)])
def test_a_route_this_machine_cannot_place_is_refused_naming_what_it_needs(
    route: str, gpus: int, needed: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(SystemExit):  # not a wait for GPUs that never come (Ray asked for 1 + 1)
        gpu_check.parse_args(["--push-route", route])
    error = capsys.readouterr().err
    assert f"--push-route {route} needs {needed} GPUs, this machine has {gpus}" in error
    assert "a GPU each (1 + 1" in error and "use ipc" in error
    opts = gpu_check.parse_args(["--push-route", "ipc"])  # one GPU: the shared layout fits
    assert opts.push_route == "ipc" and gpu_check.push_gpus("ipc", small=False) == 1
    monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda: 2)
    assert gpu_check.parse_args(["--push-route", route]).push_route == route


def test_the_table_quotes_mfu_against_the_datasheet_first_and_ragged_beside_uniform() -> None:
    results = ROOT / "benchmarks" / "results"
    h200 = json.loads((results / "gpu_check_h200.json").read_text())
    packed = json.loads((results / "gpu_check_h200_packed.json").read_text())["phases"]["packed"]
    # the uniform batch of one run beside the ragged batch of the next; the other phases left out
    h200["phases"] = {name: h200["phases"][name] if name in ("matmul", "learner") else
                      packed if name == "packed" else {"status": "skipped", "reason": "left out"}
                      for name in gpu_check.PHASES}  # fmt: skip
    rows = dict(line.split(None, 1) for line in gpu_check.table(h200).splitlines())
    assert rows["mode"].endswith("torch 2.11.0+cu130")  # the torch version that ran
    assert "MFU 31.6% of the datasheet's 989 TFLOP/s (39.7% of the measured matmul)" in rows["learner"]
    assert rows["ragged"] == "real tokens/s vs the uniform batch's 30269: padded 21286 (0.70x), packed 12474 (0.41x)"


def test_push_config() -> None:
    opts = gpu_check.parse_args(["--small", "--phase", "push"])
    assert (opts.phases, opts.push_route, opts.push_iterations) == (("push",), "shm", 3)
    config = gpu_check.push_config(opts, "some/model")
    assert (config.rollout_mode, config.train_batch_size, config.group_size) == ("sync_group", 8, 2)
    assert config.engine_options == {} and config.num_gpus_per_learner == 0.0  # the torch engine pulls
    vllm = gpu_check.parse_args(["--small", "--push-engine", "vllm"])
    assert gpu_check.push_config(vllm, "m").engine_options["weight_sync"] == "shm"
    assert gpu_check.push_requirements(opts) == ("ray", "gymnasium", "math_verify")
    assert gpu_check.push_requirements(vllm) == ("ray", "gymnasium", "math_verify", "vllm")


def test_batch_has_exact_lengths_and_masks() -> None:
    opts = gpu_check.parse_args(["--small", "--batch-size", "3", "--length", "20"])
    batch = gpu_check.make_batch(opts, vocab=50, seed=0)
    assert batch.token_ids.shape == (3, 20) and bool(batch.attention_mask.all())
    assert batch.loss_mask.sum(-1).tolist() == [15, 15, 15]  # a 5-token prompt (20 // 4) outside the loss
    assert bool((batch.behavior_logprobs[~batch.loss_mask] == 0).all())
    assert batch.rewards.tolist() == [0.0, 1.0, 0.0]
    assert gpu_check.make_batch(opts, vocab=50, seed=0, batch_size=2).token_ids.shape == (2, 20)


def test_train_flops_per_token_of_the_1p5b_shape() -> None:
    arch = gpu_check.architecture(gpu_check.Options(**{**vars(gpu_check.parse_args(["--small"])), "small": False}))
    assert arch.num_parameters() == 1_543_714_304 and arch.tie_word_embeddings
    # 3 x (2 x 1,543,714,304 + 28 layers x 2 x (12 x 128) x 4,097) by hand
    assert gpu_check.train_flops_per_token(arch, 4096) == 3 * (3_087_428_608 + 352_407_552) == 10_319_508_480


def test_built_tokenizer_needs_no_file_or_network() -> None:
    tokenizer = gpu_check.build_tokenizer()
    assert len(tokenizer) == 5 + 200 + 15 + 19  # specials, 0..199, punctuation, words
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id) == (0, 3, 4)
    assert tokenizer("12 + 7 = 19")["input_ids"] == [17, 205, 12, 209, 24]
    assert tokenizer("12 + x")["input_ids"] == [17, 205, 4]  # unknown words map to <unk>
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "what is 2 + 3 ?"}],
                                         add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nwhat is 2 + 3 ?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer(chat)["input_ids"][:3] == [1, 237, 220]  # <|im_start|>, "user" (220 + 17), "what"


def test_missing_modules_names_only_the_absent() -> None:
    assert gpu_check.missing_modules(("json", "no_such_module_for_gpu_check")) == ["no_such_module_for_gpu_check"]


def test_json_keeps_non_finite_figures_as_strings() -> None:
    safe = gpu_check._json_safe({"a": float("inf"), "b": [1.5, float("nan")], "c": (None, "x")})
    assert safe == {"a": "inf", "b": [1.5, "nan"], "c": [None, "x"]}
    json.dumps(safe, allow_nan=False)  # what main writes


def _simulated_machine_env(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    empty = tmp_path / "empty"
    empty.mkdir()
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]),
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS="",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(empty / "hf"),
        FLASHRL_CACHE=str(empty / "flashrl"),
        CUDA_VISIBLE_DEVICES="",
    )
    return env


def test_small_run_on_a_simulated_gpu_machine(tmp_path: Path) -> None:
    env = _simulated_machine_env(tmp_path)
    for name in BLOCKED:  # the simulation holds: each is absent in the child
        probe = subprocess.run([sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True,
                               check=False)
        assert probe.returncode != 0 and "simulated GPU machine" in probe.stderr, name
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--output", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    phases = result["phases"]
    assert list(phases) == list(gpu_check.PHASES) and result["ok"] and result["mode"] == "small"
    assert {name: p["status"] for name, p in phases.items()} == {
        "matmul": "ok", "learner": "ok", "logprobs": "ok", "engine": "ok", "fsdp": "ok", "packed": "ok",
        "push": "skipped",
    }
    assert phases["push"]["reason"].startswith("needs ray, gymnasium, math_verify, not importable here")

    learner = phases["learner"]
    assert [learner["warmup_update"]["applied"], learner["update"]["applied"]] == [1.0, 1.0]
    assert learner["update"]["num_micro_batches"] == 2.0 and learner["update"]["tokens"] == 4 * 64
    assert learner["peak_over_plan"] is None and learner["plan_bytes"]["total"] > 0  # compared on CUDA only

    rows = phases["logprobs"]["rows"]
    assert [r["tokens"] for r in rows] == [256, 512]
    assert all(r["float32_max_abs_logprob_diff"] < 1e-3 and r["float32_grad_hidden_relative_diff"] < 1e-3
               for r in rows)
    assert all(r["bf16_within_rounding_bound"] and r["bf16_logprob_rounding_bound"] > 0 for r in rows)

    engine = phases["engine"]
    assert 0 < engine["tokens"] <= 2 * 8 and engine["largest_batch"] == 2
    assert engine["agreement"]["num_tokens"] == engine["tokens"]
    assert engine["agreement"]["max_abs_diff"] < 1e-4  # float32 on CPU: the same model, the same tokens

    fsdp = phases["fsdp"]
    assert (fsdp["backend"], fsdp["fsdp_units"], fsdp["checkpoint_wrapped_layers"]) == ("gloo", 3, 2)
    assert fsdp["master_dtype"] == "torch.float32" and fsdp["update"]["applied"] == 1.0
    assert fsdp["vs_local"]["loss_abs_diff"] < 1e-4 and fsdp["vs_local"]["grad_norm_relative_diff"] < 1e-4

    packed = phases["packed"]
    assert (packed["padded"]["attention"], packed["packed"]["attention"]) == ("sdpa", "sdpa")
    assert packed["padded"]["real_tokens"] == packed["packed"]["real_tokens"] == 8 + 27 + 45 + 64  # 4 ragged rows
    assert packed["loss_abs_diff"] < 1e-4 and packed["grad_norm_relative_diff"] < 1e-4
    assert packed["time_ratio_packed_over_padded"] > 0
    # FlexAttention (pack_attention="flex") has no backward on CPU: the phase records why it did not run it.
    assert packed["packed_flex"] == {"skipped": f"FlexAttention has no backward on cpu (torch {torch.__version__})"}
    assert "speedup_packed_flex_over_padded" not in packed
    assert set(packed["probe"]) == {"bfloat16 5+4", "bfloat16 64+48", "float32 5+4", "float32 64+48"}
    for probe in packed["probe"].values():  # a working mask: rounding apart; a leak: far apart
        assert probe["packed_vs_alone"] < 0.05 and probe["leak_vs_alone"] > 0.1
    verdict = next(line for line in proc.stdout.splitlines() if line.startswith("verdict"))
    assert verdict.split()[-1] == "OK"


def test_a_failing_phase_is_recorded_and_the_others_still_run(tmp_path: Path) -> None:
    """A budget of the whole batch gives one pass per update: the learner phase's check must fail it."""
    env = _simulated_machine_env(tmp_path)
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--phase", "learner", "matmul",
         "--max-tokens-per-micro-batch", "256", "--output", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    phases = json.loads(out.read_text())["phases"]
    assert phases["matmul"]["status"] == "ok" and phases["learner"]["status"] == "failed"
    assert phases["learner"]["error"] == "RuntimeError: expected several micro-batches, got 1.0"
    assert phases["engine"] == {"status": "skipped", "reason": "not selected (--phase)"}
    assert next(line for line in proc.stdout.splitlines() if line.startswith("verdict")).split()[-1] == "FAILED"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_small_push_phase_end_to_end(engine: str, tmp_path: Path) -> None:
    """The push phase on CPU: a real run through Ray (learner actor, EnvRunner actor), the shm route."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--phase", "push", "--push-engine", engine, "--output", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    push = json.loads(out.read_text())["phases"]["push"]
    assert push["status"] == "ok" and push["route"] == "shm" and push["num_formations"] == 0
    assert [it["learner_version"] for it in push["iterations"]] == [1, 2, 3]
    assert [it["policy_lag_max"] for it in push["iterations"]] == [0.0, 0.0, 0.0]


def test_bf16_logprob_bound_is_two_ulps_of_the_largest_possible_logit() -> None:
    # |z| <= max ||h|| * max ||w|| = 5 * 1: ulp of [4, 8) in bf16 is 2^(2 - 7); two of them
    h, w = torch.tensor([[3.0, 4.0], [0.0, 1.0]]), torch.tensor([[1.0, 0.0], [0.0, 0.5]])
    assert gpu_check.bf16_logprob_bound(h, w) == 2 * 2.0**-5
    assert gpu_check.bf16_logprob_bound(torch.tensor([[1.5, 0.0]]), torch.tensor([[1.0, 0.0]])) == 2 * 2.0**-7


def test_logprob_phase_gates_on_float32_and_records_a_bf16_rounding_difference(monkeypatch) -> None:
    """A bf16 difference of one rounding near 1-2 (0.008) is recorded, not a failure; float32 is the gate."""

    def fake(method, n, opts, dt=torch.bfloat16):
        shift = 0.008 if (method == "chunked" and dt == torch.bfloat16) else 0.0
        return {"peak_bytes": 1, "seconds": 1.0, "logprobs": torch.zeros(n) + shift,
                "grad_hidden": torch.ones(n, 2), "bound": 0.0625}

    monkeypatch.setattr(gpu_check, "_logprob_once", fake)
    opts = gpu_check.parse_args(["--small", "--phase", "logprobs"])
    out = gpu_check.phase_logprobs(types.SimpleNamespace(opts=opts))
    assert [r["max_abs_logprob_diff"] for r in out["rows"]] == pytest.approx([0.008, 0.008])
    assert all(r["float32_max_abs_logprob_diff"] == 0.0 and r["bf16_within_rounding_bound"] for r in out["rows"])

    def wrong_fp32(method, n, opts, dt=torch.bfloat16):
        return {**fake(method, n, opts, dt), "logprobs": torch.zeros(n) + (0.01 if method == "chunked" else 0.0)}

    monkeypatch.setattr(gpu_check, "_logprob_once", wrong_fp32)
    with pytest.raises(RuntimeError, match="disagree in float32"):
        gpu_check.phase_logprobs(types.SimpleNamespace(opts=opts))
