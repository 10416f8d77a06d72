"""This repository's paths as the benchmarks use them, and its scripts imported by path.

The benchmarks run from the repository root (`python benchmarks/<name>.py`): `RESULTS` and `FIGURES`
are relative to it, `REPO` is absolute (for `load_script` and the git commit of a report).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path("benchmarks") / "results"
FIGURES = Path("docs") / "figures"
MAIN_JOB = Path("tuned_examples") / "smollm2_arithmetic_cpu.py"


def load_script(relative_path: str | os.PathLike[str], name: str) -> ModuleType:
    """Import a script of this repository by path (tuned examples and benchmarks are not packages).

    The module is registered for pickling by value, so classes defined in it (an environment) reach
    Ray actors that cannot import it.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / relative_path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {relative_path}: expected a Python file under {REPO.name}/")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)
    return module


def main_job() -> ModuleType:
    """`tuned_examples/smollm2_arithmetic_cpu.py` (its `PRESET`, `make_config`, `easy_sums`)."""
    return load_script(MAIN_JOB, "flashrl_bench_smollm2_arithmetic_cpu")
