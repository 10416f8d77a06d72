"""Load the benchmark scripts (benchmarks/ is a folder of scripts, not a package) as modules."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/<name>.py` as a module, pickled by value (its classes reach the Ray actors)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import _common

    if name == "_common":
        return _common
    return _common.load_script(Path("benchmarks") / f"{name}.py", f"flashrl_bench_{name}")


@pytest.fixture(scope="session")
def bench():
    """`bench("learning_efficiency")` -> the script's module."""
    return load_benchmark
