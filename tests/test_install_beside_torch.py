"""Installing flashrl on a node that has its own torch: pip's resolver keeps that torch.

A GPU node comes with its own CUDA build of torch (2.11.0+cu130 on the GPU machine this project can
use). flashrl's base requirements accept torch 2.11 to 2.14, so installing flashrl must leave that
build in place. These tests run pip's resolver for real and offline (`--no-index`, no pip
configuration), in a fresh virtual environment without system site-packages:

- the node's torch is a stand-in distribution named `torch`, version 2.11.0+cu130 (a few bytes
  instead of the multi-GB CUDA wheel), installed into that environment;
- flashrl is a wheel built from this checkout, offline (`pip wheel --no-deps --no-build-isolation`);
- every other requirement of flashrl is a stand-in wheel in a local folder, which also offers torch
  2.13.0 and 2.14.1, as an index would.

The stand-ins have no requirements of their own, so this checks flashrl's own requirements, not those
of its dependencies.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
NODE_TORCH = "2.11.0+cu130"
"""The torch build of the GPU machine this project can use."""
OFFERED_TORCH = ("2.13.0", "2.14.1")
"""Newer torch releases the local folder offers, as an index would."""
PIP_TIMEOUT_S = 300


@dataclass(frozen=True)
class Node:
    """A virtual environment holding the node's torch, and what pip may install into it."""

    python: Path
    source: Path
    """A copy of this checkout's sources (what `pip install -e .` builds)."""
    flashrl_wheel: Path
    requirements: tuple[Requirement, ...]
    """flashrl's base requirements (no extra), from the wheel's METADATA."""
    links: Path
    """The local folder pip may install from: stand-ins of flashrl's other requirements, newer torch."""


def _pip_env() -> dict[str, str]:
    """The environment without pip configuration or a Python path that could leak other packages."""
    dropped = ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in dropped}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, env=_pip_env(), capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                          check=False)
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The running interpreter's pip acting on the environment of `python` (pip's --python)."""
    return _run([sys.executable, "-m", "pip", "--python", str(python), *args])


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _stand_in_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel of distribution `name` at `version`: a module that sets `__version__`."""
    dist = canonicalize_name(name).replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    metadata = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                        *(f"Requires-Dist: {r}\n" for r in requires)])
    files = {
        f"{dist}/__init__.py": f'__version__ = "{version}"\n',
        f"{info}/METADATA": metadata,
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: flashrl-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{path},{_record_hash(text.encode())},{len(text.encode())}\n" for path, text in files.items())
    files[f"{info}/RECORD"] = record + f"{info}/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


def _satisfying_version(req: Requirement) -> str:
    """A version `req` accepts: one its specifier names, or 1.0 when it names none."""
    candidates = []
    for spec in req.specifier:
        try:
            candidates.append(str(Version(spec.version)))
        except InvalidVersion:  # a wildcard such as ==1.*
            continue
    for version in [*candidates, "1.0"]:
        if req.specifier.contains(version, prereleases=True):
            return version
    raise AssertionError(f"no stand-in version for {req}: tried {[*candidates, '1.0']}; extend _satisfying_version")


def _base_requirements(wheel: Path) -> tuple[Requirement, ...]:
    with zipfile.ZipFile(wheel) as zf:
        (metadata,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        lines = zf.read(metadata).decode().splitlines()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return tuple(r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""}))


def _install_plan(node: Node, *targets: str) -> dict[str, str]:
    """What `pip install <targets>` would install into the node, name -> version (pip's --dry-run report)."""
    report = node.python.parent.parent / "report.json"
    _pip(node.python, "install", "--dry-run", "--no-index", "--find-links", str(node.links),
         "--report", str(report), *targets)
    return _planned(report)


def _planned(report: Path) -> dict[str, str]:
    installs = json.loads(report.read_text())["install"]
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"] for item in installs}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Node:
    root = tmp_path_factory.mktemp("install_beside_torch")

    # flashrl's wheel from a copy of the checkout (the build writes build/ and *.egg-info beside the sources).
    source = root / "source"
    shutil.copytree(ROOT / "flashrl", source / "flashrl", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    dist = root / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "--wheel-dir", str(dist), str(source)])
    (flashrl_wheel,) = dist.glob("flashrl-*.whl")
    requirements = _base_requirements(flashrl_wheel)

    links = root / "links"
    for req in requirements:
        if canonicalize_name(req.name) != "torch":
            _stand_in_wheel(links, req.name, _satisfying_version(req))
    for version in OFFERED_TORCH:
        _stand_in_wheel(links, "torch", version)

    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    node_torch = _stand_in_wheel(root / "node", "torch", NODE_TORCH)
    _pip(python, "install", "--no-index", "--no-deps", str(node_torch))
    return Node(python=python, source=source, flashrl_wheel=flashrl_wheel, requirements=requirements, links=links)


def test_flashrl_torch_requirements_accept_the_node_torch(node: Node) -> None:
    torch_reqs = [r for r in node.requirements if canonicalize_name(r.name) == "torch"]
    assert torch_reqs, f"flashrl's base requirements name no torch: {[str(r) for r in node.requirements]}"
    refused = [str(r) for r in torch_reqs if not r.specifier.contains(NODE_TORCH, prereleases=True)]
    assert not refused, f"expected every base torch requirement to accept {NODE_TORCH}; these refuse it: {refused}"


def test_pip_installs_flashrl_and_keeps_the_node_torch(node: Node) -> None:
    listed = _pip(node.python, "list", "--format=json").stdout
    assert {"name": "torch", "version": NODE_TORCH} in json.loads(listed)

    plan = _install_plan(node, str(node.flashrl_wheel))

    assert "torch" not in plan, f"pip would replace the node's torch {NODE_TORCH} with {plan.get('torch')}"
    expected = {"flashrl"} | ({canonicalize_name(r.name) for r in node.requirements} - {"torch"})
    assert set(plan) == expected


def test_a_pinned_torch_requirement_would_replace_the_node_torch(node: Node, tmp_path: Path) -> None:
    """The check above can fail: a distribution pinning torch==2.13.0 brings torch 2.13.0 into the plan."""
    probe = _stand_in_wheel(tmp_path, "pinned-probe", "1.0", requires=("torch==2.13.0",))

    plan = _install_plan(node, str(probe))

    assert plan == {"pinned-probe": "1.0", "torch": "2.13.0"}


def test_offline_editable_install_without_dependencies(node: Node, tmp_path: Path) -> None:
    """A node without an index: `pip install --no-deps --no-build-isolation -e .` builds and installs flashrl only.

    Build isolation would fetch setuptools from an index; here the running interpreter's setuptools builds
    (torch's 2.11 and 2.13 wheels require setuptools, so a node with torch has it).
    """
    report = tmp_path / "report.json"
    _run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-deps", "--no-build-isolation",
          "--report", str(report), "-e", str(node.source)])

    version = node.flashrl_wheel.name.split("-")[1]
    assert _planned(report) == {"flashrl": version}
