"""The core does not depend on the algorithms: no module of the core packages imports flashrl.algorithms.

The algorithms (``algorithms/`` -> ``flashrl.algorithms``) build on the core (learners, env runners,
engines, models, ops, metrics, episodes, checkpoints), never the other way round: the generic
``Learner`` gets its loss as an object (``LearnerSpec.loss``), not by importing it, and the EnvRunners
get an ``EnvRunnerSpec`` (read from the algorithm's config by field name), not the config. Entry
points that build an algorithm's config (``flashrl/cli.py``, ``flashrl/recipes/``) may import it.
Imports inside functions count too (they are how a cycle hides). The check reads the source
(``ast``), so it sees every import whatever runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "flashrl"
CORE = ["learners", "env_runners", "engines", "models", "ops", "metrics", "episode.py", "checkpoints.py"]
FORBIDDEN = "flashrl.algorithms"


def _modules(part: str) -> list[Path]:
    path = ROOT / part
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    assert files, f"expected Python modules at {path}"
    return files


def _imported(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in ``tree``; relative imports resolved against ``module``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: -node.level]
                base = ".".join(package + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _violations(part: str) -> list[str]:
    out = []
    for path in _modules(part):
        module = "flashrl." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, name in _imported(tree, module):
            if name == FORBIDDEN or name.startswith(FORBIDDEN + "."):
                out.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name}")
    return sorted(set(out))


@pytest.mark.parametrize("part", CORE)
def test_core_modules_do_not_import_the_algorithms(part):
    violations = _violations(part)
    assert not violations, (
        "The core must not import flashrl.algorithms (pass the algorithm's objects in, e.g. LearnerSpec.loss, "
        "EnvRunnerSpec):\n"
        + "\n".join(violations)
    )


def test_the_check_finds_imports_inside_functions_and_relative_ones():
    source = (
        "def f():\n    from flashrl.algorithms.flash_reinforce.loss import flash_reinforce_loss\n"
        "import flashrl.algorithms\nfrom ..algorithms import x\n"
    )
    names = [name for _, name in _imported(ast.parse(source), "flashrl.learners.learner")]
    assert "flashrl.algorithms.flash_reinforce.loss" in names and "flashrl.algorithms" in names
    assert "flashrl.algorithms.x" in names  # `from ..algorithms import x` in flashrl.learners.learner
