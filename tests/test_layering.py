"""The package's layers: the core imports neither the environments nor the algorithms, and no module
imports itself back through others.

- The algorithms (``flashrl.algorithms``) build on the core (learners, env runners, engines, models,
  ops, metrics, episodes, conversations, checkpoints), never the other way round: the generic
  ``Learner`` gets its loss as an object (``LearnerSpec.loss``), the EnvRunners get an
  ``EnvRunnerSpec`` and the driver's Gymnasium EnvSpec, not the config or the env modules.
- The environments (``flashrl.envs``) use the core's conversations and episodes; the core never
  imports them (the runners make envs from the EnvSpec the driver resolved).
- Entry points that build an algorithm's config (``flashrl/cli.py``, ``flashrl/__main__.py``,
  ``flashrl/recipes/``) may import both.
- No import cycle among flashrl's modules (a cycle is where a layering slip hides).

Imports inside functions count too. The check reads the source (``ast``), so it sees every import
whatever runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "flashrl"
ENTRY_POINTS = {"cli.py", "__main__.py", "recipes", "reproduction"}
UPPER = {"algorithms": "flashrl.algorithms", "envs": "flashrl.envs"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _all_modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _core_modules() -> list[Path]:
    top = {path.relative_to(ROOT).parts[0] for path in ROOT.rglob("*.py")}
    parts = sorted(top - ENTRY_POINTS - set(UPPER))
    assert {"learners", "env_runners", "engines", "episode.py", "conversation.py"} <= set(parts)
    return [path for part in parts for path in (sorted((ROOT / part).rglob("*.py")) if (ROOT / part).is_dir()
                                                 else [ROOT / part])]


def _imported(tree: ast.AST, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in ``tree``; relative imports resolved against ``module``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(package + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for line, name in _imported(tree, _module_name(path), path.name == "__init__.py"):
        for forbidden in UPPER.values():
            if name == forbidden or name.startswith(forbidden + "."):
                out.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name}")
    return out


def test_the_core_imports_neither_the_envs_nor_the_algorithms():
    violations = sorted({v for path in _core_modules() for v in _violations(path)})
    assert not violations, (
        "The core must import neither flashrl.envs nor flashrl.algorithms (pass the algorithm's objects in, "
        "e.g. LearnerSpec.loss, EnvRunnerSpec, the driver's EnvSpec):\n" + "\n".join(violations)
    )


def test_the_envs_do_not_import_the_algorithms():
    violations = [v for path in sorted((ROOT / "envs").rglob("*.py")) for v in _violations(path)
                  if "flashrl.algorithms" in v]
    assert not violations, "\n".join(violations)


def _graph() -> dict[str, set[str]]:
    """module -> the flashrl modules it imports (a `from package import name` edge goes to the
    submodule when `name` is one, else to the package)."""
    modules = _all_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = set()
        for _, imported in _imported(tree, name, path.name == "__init__.py"):
            target = imported
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def _without_package_reexports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's ``__init__`` re-exporting its own submodules is not a cycle of the code: drop the
    edges from a package to the modules inside it."""
    return {name: {t for t in edges if not t.startswith(name + ".")} for name, edges in graph.items()}


def test_no_import_cycles():
    cycles = _cycles(_without_package_reexports(_graph()))
    assert not cycles, "Import cycles among flashrl's modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checks_find_what_they_look_for():
    source = (
        "def f():\n    from flashrl.algorithms.flash_reinforce.loss import flash_reinforce_loss\n"
        "import flashrl.algorithms\nfrom ..algorithms import x\nfrom ..envs.base import LanguageEnv\n"
    )
    names = [name for _, name in _imported(ast.parse(source), "flashrl.learners.learner")]
    assert "flashrl.algorithms.flash_reinforce.loss" in names and "flashrl.algorithms" in names
    assert "flashrl.algorithms.x" in names and "flashrl.envs.base" in names
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("folder", ["algorithms", "envs"])
def test_the_upper_layers_are_folders_of_the_package(folder):
    # No package_dir remapping: what a reader and a static tool see is what is imported.
    assert (ROOT / folder / "__init__.py").is_file()
    assert not (ROOT.parent / folder).exists()
