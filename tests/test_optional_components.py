"""Tests of an optional component skip with the reason where it is absent, and fail under CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs pytest on one vLLM test with `vllm` made unimportable (a None entry in sys.modules).
_RUN = """
import sys
sys.modules["vllm"] = None
import pytest
sys.exit(pytest.main(["-q", "-rs", "-p", "no:cacheprovider", "tests/engines/test_vllm_tiny.py"]))
"""


def _run_without_vllm(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "FLASHRL_REQUIRE_OPTIONAL")}
    return subprocess.run(
        [sys.executable, "-c", _RUN], check=False, cwd=ROOT, env=clean | env, capture_output=True, text=True, timeout=300
    )


def test_a_missing_optional_component_skips_with_the_install_hint() -> None:
    out = _run_without_vllm()
    assert out.returncode == 0, out.stdout + out.stderr
    assert " skipped" in out.stdout and "passed" not in out.stdout and "error" not in out.stdout
    assert "needs vllm (the 'vllm' marker): pip install -e '.[cpu]'" in out.stdout


@pytest.mark.parametrize("env", [{"CI": "true"}, {"FLASHRL_REQUIRE_OPTIONAL": "1"}])
def test_under_ci_a_missing_optional_component_fails(env: dict[str, str]) -> None:
    out = _run_without_vllm(**env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert " error" in out.stdout and "CI installs every extra" in out.stdout
    assert "passed" not in out.stdout and "skipped" not in out.stdout
