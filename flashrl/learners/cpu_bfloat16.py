"""Whether this CPU computes in bfloat16 natively: a bfloat16 learner on one that does not is very slow.

torch runs bfloat16 matmuls on a CPU through oneDNN when the CPU has native bfloat16 instructions
(``avx512_bf16``, ``amx_bf16``); without them (AVX2-only CPUs: most laptops, many cloud VMs) it falls
back to a scalar gemm: on a 2-core AMD EPYC without them, a linear layer's forward and backward at
SmolLM2-135M's shapes took 17.7x as long in bfloat16 as in float32 (``benchmarks/cpu_bfloat16.py``,
``benchmarks/results/cpu_bfloat16.json``). The learner warns at start (`slow_bfloat16_warning`), and so
does a tuned example's ``--dry-run``.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

__all__ = ["BF16_FLAGS", "has_native_bfloat16", "native_bfloat16", "slow_bfloat16_warning"]

logger = logging.getLogger("flashrl.learners")

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""``/proc/cpuinfo`` flags of native bfloat16 arithmetic (x86)."""


def has_native_bfloat16(cpuinfo: str) -> bool | None:
    """Whether ``/proc/cpuinfo``'s text lists a flag of `BF16_FLAGS`; None when it lists no flags at all."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags.update(value.split())
    if not flags:
        return None
    return any(flag in flags for flag in BF16_FLAGS)


@functools.cache
def native_bfloat16() -> bool | None:
    """True / False from ``/proc/cpuinfo`` on x86 Linux; None where it cannot be told (other systems, ARM)."""
    try:
        return has_native_bfloat16(Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None


def slow_bfloat16_warning(dtype: str, device: str) -> str | None:
    """The warning for a bfloat16 learner on a CPU without native bfloat16, or None when it does not apply."""
    if dtype != "bfloat16" or not device.startswith("cpu") or native_bfloat16() is not False:
        return None
    return (
        "dtype='bfloat16' on a CPU without native bfloat16 (none of the cpuinfo flags "
        f"{', '.join(BF16_FLAGS)}): torch's bfloat16 matmuls fall back to a scalar path here, measured 17.7x "
        "float32's on one such CPU (benchmarks/results/cpu_bfloat16.json). Fix: dtype='float32' (a tuned example: --dtype float32)"
    )
