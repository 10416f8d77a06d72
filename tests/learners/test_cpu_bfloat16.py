"""A bfloat16 learner on a CPU without native bfloat16 is warned about (learner start, dry-run)."""

from __future__ import annotations

import logging

import pytest

from flashrl.learners import cpu_bfloat16
from flashrl.learners.cpu_bfloat16 import has_native_bfloat16, slow_bfloat16_warning

AVX2_ONLY = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def test_the_cpuinfo_flags_decide() -> None:
    assert has_native_bfloat16(AVX2_ONLY) is False
    assert has_native_bfloat16(SAPPHIRE) is True
    assert has_native_bfloat16("processor\t: 0\nFeatures\t: fp asimd\n") is None  # ARM: no x86 flags line


@pytest.mark.parametrize(("native", "dtype", "device", "warned"), [
    (False, "bfloat16", "cpu", True),
    (True, "bfloat16", "cpu", False),
    (None, "bfloat16", "cpu", False),
    (False, "float32", "cpu", False),
    (False, "bfloat16", "cuda:0", False),
])
def test_the_warning_applies_only_to_a_cpu_bfloat16_learner_without_it(monkeypatch, native, dtype, device,
                                                                        warned) -> None:
    monkeypatch.setattr(cpu_bfloat16, "native_bfloat16", lambda: native)
    message = slow_bfloat16_warning(dtype, device)
    assert (message is not None) == warned
    if warned:
        assert "dtype='float32'" in message and "benchmarks/results/cpu_bfloat16.json" in message


def test_the_learner_warns_at_start(monkeypatch, caplog, make_spec) -> None:
    from flashrl.learners import Learner

    monkeypatch.setattr(cpu_bfloat16, "native_bfloat16", lambda: False)
    with caplog.at_level(logging.WARNING, logger="flashrl.learners"):
        Learner(make_spec(dtype="bfloat16"))
    assert any("without native bfloat16" in r.getMessage() for r in caplog.records)


def test_the_dry_run_says_so(monkeypatch) -> None:
    from flashrl.recipes import plan

    monkeypatch.setattr(cpu_bfloat16, "native_bfloat16", lambda: False)

    class Config:
        num_gpus_per_learner, dtype, engine, model = 0, "bfloat16", "torch", "tiny"

    class Preset:
        needs_alfworld = needs_sandbox = False

    monkeypatch.setattr(plan, "_gpu_check", lambda config, node_plan: plan.Check("GPUs visible", True, "-"))
    monkeypatch.setattr(plan, "_model_check", lambda model, local: plan.Check("model reachable", True, "-"))
    checks = {c.name: c for c in plan._prerequisites(Preset(), Config(), None, None, {})}
    check = checks["bfloat16 native on this CPU (the learner computes in it)"]
    assert not check.ok and check.fix == "dtype='float32' (a tuned example: --dtype float32)"
    Config.dtype = "float32"
    assert "bfloat16 native on this CPU (the learner computes in it)" not in {
        c.name for c in plan._prerequisites(Preset(), Config(), None, None, {})}
