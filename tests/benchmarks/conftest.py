"""Load the benchmark scripts (benchmarks/ is a folder of scripts, not a package) as modules.

The scripts' shared modules (`benchmarks/_configs.py`, `_stats.py`, ...) import one another by plain
name, as they do when a script runs: benchmarks/ goes first on `sys.path` here, before any test
module of this folder imports them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from _repo import load_script  # after the sys.path line above: benchmarks/ is not a package


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/<name>.py` as a module, pickled by value (its classes reach the Ray actors)."""
    return load_script(Path("benchmarks") / f"{name}.py", f"flashrl_bench_{name}")


@pytest.fixture(scope="session")
def bench():
    """`bench("learning_efficiency")` -> the script's module."""
    return load_benchmark
