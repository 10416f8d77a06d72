"""examples/toy_update.py runs on the CPU, rejects the stale trajectory and passes its own checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "toy_update.py"


def test_toy_update_runs_and_checks_pass():
    result = subprocess.run([sys.executable, str(EXAMPLE)], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert len(rows) == 8
    stale = [r for r in rows if r[1] == "stale"]
    assert len(stale) == 1 and stale[0][6] == "False"
    assert all(r[6] == "True" for r in rows if r[1] == "current")
    assert "OK: one update moved every accepted trajectory" in result.stdout
