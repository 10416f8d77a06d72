"""flashrl installed with `--no-deps` beside a real torch 2.11, and gpu_check's torch-only phases run there.

The GPU machine this project can use has torch 2.11.0+cu130, transformers 5.17.0, accelerate,
safetensors, tokenizers and numpy, no vLLM, no Ray and no network (``docs/engines.md``, "Checking a
GPU machine"). This test builds such an environment on CPU and checks flashrl in it:

- a fresh virtual environment (no system site-packages) gets the registry's torch 2.11.0 (its CUDA
  build, with the nvidia runtime wheels it requires: about 3 GB, downloaded into
  ``flashrl-torch-2.11-wheels`` under the system temp folder, which a rerun reuses; delete it when
  done), then the GPU machine's other packages under the constraint ``torch==2.11.0``, so pip cannot
  replace that torch, and a setuptools that builds wheels by itself (70.1 or later; see SETUPTOOLS);
- flashrl is installed offline from a copy of this checkout with
  ``pip install --no-index --no-deps --no-build-isolation -e``, the command the docs give for that machine;
- ``scripts/gpu_check.py --small`` runs the phases that need only torch and transformers (the torch
  engine's ``engine`` phase included) with that interpreter, importing the installed flashrl.

Marked slow (minutes, and a download the first time). Skipped, with pip's answer, when the package
index pip uses here offers no torch 2.11.0 (no network); with ``FLASHRL_REQUIRE_OPTIONAL`` (or ``CI``) set, that
is a failure instead. The virtual environment is removed afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
TORCH = "2.11.0"
GPU_MACHINE_PACKAGES = ("transformers==5.17.0", "accelerate", "safetensors", "tokenizers", "numpy")
"""What the GPU machine has beside torch that the torch-only phases import (no Ray, vLLM, gymnasium)."""
TORCH_ONLY_PHASES = ("matmul", "learner", "logprobs", "engine", "fsdp")
"""gpu_check's phases without ``push`` (Ray and vLLM); ``engine`` is the torch engine."""
ABSENT = ("vllm", "ray", "gymnasium", "math_verify")
SETUPTOOLS = "setuptools>=70.1"
"""The offline install builds flashrl with the environment's setuptools. Older releases build wheels
through the separate ``wheel`` package, and without it stop with "invalid command 'bdist_wheel'".
torch 2.11 asks only for ``setuptools<82``: installed where there is no setuptools (Python 3.12's venv
bundles none) it brings a recent release, but a Python 3.11 venv keeps the older one it was created
with (65.5 for 3.11.7), which fails. So the node is given what a fresh 3.12 one gets."""
WHEELHOUSE = Path(tempfile.gettempdir()) / f"flashrl-torch-{TORCH.rsplit('.', 1)[0]}-wheels"
PIP_TIMEOUT_S = 1800
PROBE_TIMEOUT_S = 120

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


@dataclass(frozen=True)
class Node:
    """A virtual environment like the GPU machine's, with flashrl installed from a copy of the checkout."""

    python: Path
    source: Path
    root: Path


def _env() -> dict[str, str]:
    """This machine's environment (its pip configuration included), without a Python path into the checkout."""
    dropped = ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if k not in dropped} | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _run(args: list[str], *, timeout: float = PIP_TIMEOUT_S, **kwargs) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False,
                          **{"env": _env(), **kwargs})
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def _in_node(python: Path, code: str) -> object:
    """The JSON that ``code`` prints, run by the node's interpreter outside the checkout."""
    return json.loads(_run([str(python), "-c", code], cwd=python.parent).stdout)


def _copy_sources(dest: Path) -> Path:
    """What `pip install -e .` builds, copied so that the build's egg-info stays out of the checkout."""
    shutil.copytree(ROOT / "flashrl", dest / "flashrl", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, require_optional: bool) -> Iterator[Node]:
    root = tmp_path_factory.mktemp("gpu_check_beside_torch")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip"]
    try:
        probe = subprocess.run([*pip, "install", "--dry-run", "--no-deps", "--timeout", "20", f"torch=={TORCH}"],
                               env=_env(), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
        if probe.returncode != 0:
            # a skip reads as a pass to whoever ran this slow test on purpose: with FLASHRL_REQUIRE_OPTIONAL
            # (or CI) set, no index with torch 2.11 is a failure, as a missing optional component is
            message = (f"the package index pip uses here offers no torch=={TORCH} for this Python (no network?); "
                       f"pip said: {probe.stderr.strip()[-600:]}")
            if require_optional:
                pytest.fail(message + ". FLASHRL_REQUIRE_OPTIONAL is set, so this check may not skip.", pytrace=False)
            pytest.skip(message)
        # pip keeps no HTTP cache of wheels behind some mirrors; files already in the folder are reused
        _run([*pip, "download", "--dest", str(WHEELHOUSE), f"torch=={TORCH}"])
        _run([*pip, "install", "--no-index", "--find-links", str(WHEELHOUSE), f"torch=={TORCH}"])
        constraints = root / "constraints.txt"
        constraints.write_text(f"torch=={TORCH}\n")
        _run([*pip, "install", "-c", str(constraints), *GPU_MACHINE_PACKAGES, SETUPTOOLS])
        source = _copy_sources(root / "source")
        _run([*pip, "install", "--no-index", "--no-deps", "--no-build-isolation", "-e", str(source)], timeout=600)
        yield Node(python=python, source=source, root=root)
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def test_the_node_keeps_torch_2_11_and_imports_the_installed_flashrl(node: Node) -> None:
    found = _in_node(node.python, (
        "import importlib.util, json, torch, flashrl; print(json.dumps({'torch': torch.__version__, "
        f"'flashrl': flashrl.__file__, 'absent': [m for m in {ABSENT!r} if importlib.util.find_spec(m) is None]}}))"
    ))
    assert found["torch"].startswith(TORCH), f"expected torch {TORCH} to stay installed, found {found['torch']}"
    assert Path(found["flashrl"]) == node.source / "flashrl" / "__init__.py"
    assert found["absent"] == list(ABSENT), "the node must lack what the GPU machine lacks"


def test_gpu_check_torch_only_phases_pass_beside_torch_2_11(node: Node) -> None:
    empty = node.root / "empty"
    out = node.root / "gpu_check.json"
    env = _env() | {"PIP_NO_INDEX": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "HF_HOME": str(empty / "hf"), "FLASHRL_CACHE": str(empty / "flashrl"), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [str(node.python), str(SCRIPT), "--small", "--phase", *TORCH_ONLY_PHASES, "--output", out.name],
        cwd=node.root, env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    result = json.loads(out.read_text()) if out.exists() else None
    assert proc.returncode == 0 and result is not None, proc.stdout[-6000:] + proc.stderr[-6000:]

    assert result["machine"]["torch"].startswith(TORCH) and result["mode"] == "small" and result["ok"]
    statuses = {name: p["status"] for name, p in result["phases"].items()}
    assert statuses == {**dict.fromkeys(TORCH_ONLY_PHASES, "ok"), "push": "skipped"}, {
        name: p.get("error") for name, p in result["phases"].items() if p["status"] == "failed"}
    assert result["phases"]["push"]["reason"] == "not selected (--phase)"
    learner, fsdp = result["phases"]["learner"], result["phases"]["fsdp"]
    assert [learner["warmup_update"]["applied"], learner["update"]["applied"]] == [1.0, 1.0]
    assert fsdp["vs_local"]["loss_relative_diff"] < 1e-4 and fsdp["vs_local"]["grad_norm_relative_diff"] < 1e-4
    assert result["phases"]["engine"]["agreement"]["max_abs_diff"] < 1e-4  # float32: the same model and tokens
