"""The package's layers: the core imports neither the environments nor the algorithms, and no module
imports itself back through others.

- Every package sits on a floor of docs/design.md §2 ("Layout"): the entry points (``flashrl/cli.py``,
  ``flashrl/__main__.py``, ``flashrl/recipes/``, ``flashrl/reproduction/``) above the algorithms, the
  algorithms above the environments, the environments above the core (every other package, the run
  plan ``flashrl/plan/`` included). An import may go sideways or down, never up: the algorithms
  import no recipe, the core no algorithm, environment or entry point.

- The algorithms (``flashrl.algorithms``) build on the core (learners, env runners, engines, models,
  ops, metrics, episodes, conversations, checkpoints), never the other way round: the generic
  ``Learner`` gets its loss as an object (``LearnerSpec.loss``), the EnvRunners get an
  ``EnvRunnerSpec`` and the driver's Gymnasium EnvSpec, not the config or the env modules.
- The environments (``flashrl.envs``) use the core's conversations and episodes; the core never
  imports them (the runners make envs from the EnvSpec the driver resolved).
- Entry points that build an algorithm's config (``flashrl/cli.py``, ``flashrl/__main__.py``,
  ``flashrl/recipes/``) may import both.
- No import cycle among flashrl's modules (a cycle is where a layering slip hides), and none among
  its packages either (``flashrl.learners`` importing ``flashrl.weight_sync`` and ``weight_sync``
  importing ``learners`` back is a cycle of layers even when no two modules close one): each
  subpackage, and each top-level module, is one node.
- The agent endpoint (``flashrl.agents``) sits below the env runners, which serve it: it imports
  them not (the runners import it), nor the environments (an agent env uses it).
- Weight sync sits below the learners, the engines and the env runners: they import it, it imports
  none of them; its wire types and constants (``flashrl/weight_sync/wire.py``) import nothing of
  flashrl and are defined nowhere else.

Imports inside functions count too. The check reads the source (``ast``), so it sees every import
whatever runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "flashrl"
ENTRY_POINTS = {"cli.py", "__main__.py", "recipes", "reproduction"}
UPPER = {"algorithms": "flashrl.algorithms", "envs": "flashrl.envs", "sandbox.py": "flashrl.sandbox"}
"""The floors above the core; ``flashrl/sandbox.py`` (the agents' sandbox helper) wraps the envs' sandbox, so it
sits on their floor."""


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


def _package(module: str) -> str:
    """The layer a module belongs to: its subpackage of flashrl (``flashrl.learners``), else itself."""
    return ".".join(module.split(".")[:2])


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """package -> the other flashrl packages its modules import (``_package``)."""
    packages: dict[str, set[str]] = {}
    for name, edges in graph.items():
        packages.setdefault(_package(name), set()).update(_package(t) for t in edges if _package(t) != _package(name))
    return packages


def test_no_import_cycles_among_packages():
    graph = _without_package_reexports(_graph())
    cycles = _cycles(_package_graph(graph))
    lines = []
    for cycle in cycles:
        lines.append(" <-> ".join(cycle) + ", through:")
        lines += [f"  {name} imports {target}" for name, edges in sorted(graph.items()) for target in sorted(edges)
                  if _package(name) in cycle and _package(target) in cycle and _package(name) != _package(target)]
    assert not cycles, (
        "Import cycles among flashrl's packages (move the shared types down, or pass the object in):\n"
        + "\n".join(lines)
    )


FLOORS = ("core", "envs", "algorithms", "entry points")
"""docs/design.md's floors, lowest first."""
LAYER = {"flashrl.cli": "entry points", "flashrl.__main__": "entry points", "flashrl.recipes": "entry points",
         "flashrl.reproduction": "entry points", "flashrl.algorithms": "algorithms", "flashrl.envs": "envs",
         "flashrl.sandbox": "envs"}
"""The packages above the core by name; every other package is the core (``flashrl.sandbox``, the agents' helper
around the envs' sandbox, is on the envs' floor)."""
DESIGN_FLOORS = "entry points (cli, recipes, reproduction) -> algorithms -> envs and core; envs -> core"
"""How docs/design.md states ``FLOORS`` and ``LAYER``."""


def _floor(module: str) -> int:
    return FLOORS.index(LAYER.get(_package(module), "core"))


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """The imports in ``graph`` (module -> the modules it imports) that go to a higher floor."""
    return [f"{name} ({FLOORS[_floor(name)]}) imports {target} ({FLOORS[_floor(target)]})"
            for name, edges in sorted(graph.items()) for target in sorted(edges)
            if _floor(target) > _floor(name)]  # fmt: skip


def test_every_import_goes_sideways_or_down_the_floors():
    upward = _upward_imports(_graph())
    assert not upward, (
        "An import goes up docs/design.md's floors (entry points -> algorithms -> envs -> core); move what it "
        "needs down (as the run plan moved to flashrl/plan/) or pass it in:\n" + "\n".join(upward)
    )


def test_the_floors_are_the_designs():
    design = (ROOT.parent / "docs" / "design.md").read_text(encoding="utf-8")
    assert DESIGN_FLOORS in " ".join(design.split()), "docs/design.md and this test state the floors together"
    assert set(LAYER) >= {f"flashrl.{name.removesuffix('.py')}" for name in ENTRY_POINTS}
    assert all(_package(f"flashrl.{name}.x") in LAYER for name in UPPER)


def test_the_floor_check_catches_an_upward_import():
    graph = {
        "flashrl.algorithms.flash_reinforce.algorithm": {"flashrl.recipes.memory", "flashrl.plan.run_plan",
                                                         "flashrl.envs.base"},
        "flashrl.learners.learner": {"flashrl.algorithms.flash_reinforce.loss", "flashrl.ops.logprobs"},
        "flashrl.envs.base": {"flashrl.conversation"},
        "flashrl.conversation": {"flashrl.envs.base"},
        "flashrl.recipes.plan": {"flashrl.plan.run_plan", "flashrl.reproduction.molt", "flashrl.cli"},
        "flashrl.plan.run_plan": {"flashrl.engines.colocation"},
        "flashrl": {"flashrl.recipes"},
    }  # fmt: skip
    assert _upward_imports(graph) == [
        "flashrl (core) imports flashrl.recipes (entry points)",
        "flashrl.algorithms.flash_reinforce.algorithm (algorithms) imports flashrl.recipes.memory (entry points)",
        "flashrl.conversation (core) imports flashrl.envs.base (envs)",
        "flashrl.learners.learner (core) imports flashrl.algorithms.flash_reinforce.loss (algorithms)",
    ]


def test_the_agent_endpoint_sits_below_the_env_runners():
    assert (ROOT / "agents" / "server.py").is_file()
    below = ("flashrl.env_runners", "flashrl.envs", "flashrl.algorithms")
    violations = [f"{path.relative_to(ROOT.parent)}:{line} imports {name}"
                  for path in sorted((ROOT / "agents").rglob("*.py"))
                  for line, name in _imported(ast.parse(path.read_text(encoding="utf-8")), _module_name(path),
                                              path.name == "__init__.py")
                  if any(name == up or name.startswith(up + ".") for up in below)]  # fmt: skip
    assert not violations, (
        "flashrl.agents must not import the env runners (they serve it), the envs or the algorithms:\n"
        + "\n".join(violations)
    )


WEIGHT_SYNC = ROOT / "weight_sync"
ABOVE_WEIGHT_SYNC = ("flashrl.learners", "flashrl.engines", "flashrl.env_runners", "flashrl.algorithms", "flashrl.envs")


def test_weight_sync_sits_below_the_sides_it_connects():
    # The learners, the engines and the env runners import weight sync, never the other way round.
    violations = [f"{path.relative_to(ROOT.parent)}:{line} imports {name}"
                  for path in sorted(WEIGHT_SYNC.rglob("*.py"))
                  for line, name in _imported(ast.parse(path.read_text(encoding="utf-8")), _module_name(path),
                                              path.name == "__init__.py")
                  if any(name == up or name.startswith(up + ".") for up in ABOVE_WEIGHT_SYNC)]  # fmt: skip
    assert not violations, (
        "flashrl.weight_sync must not import the packages above it (take the model or the engine as an "
        "argument, or move the code to the side that owns it):\n" + "\n".join(violations)
    )


def _wire_names() -> set[str]:
    tree = ast.parse((WEIGHT_SYNC / "wire.py").read_text(encoding="utf-8"))
    (names,) = [node.value for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)]  # fmt: skip
    return {ast.literal_eval(element) for element in names.elts}


def _defined(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level (assignments, classes, functions), not imports."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ClassDef | ast.FunctionDef):
            names.add(node.name)
    return names


def test_the_wire_types_are_defined_once_on_the_ground_floor():
    wire = WEIGHT_SYNC / "wire.py"
    imported = _imported(ast.parse(wire.read_text(encoding="utf-8")), "flashrl.weight_sync.wire")
    flashrl_imports = [name for _, name in imported if name == "flashrl" or name.startswith("flashrl.")]
    assert flashrl_imports == [], f"flashrl/weight_sync/wire.py must import nothing of flashrl; got {flashrl_imports}"
    names = _wire_names()
    assert {"DEFAULT_BUCKET_BYTES", "TensorMeta", "WeightManifest", "WeightBuckets", "WeightEntry"} <= names
    again = sorted(f"{path.relative_to(ROOT.parent)}: {name}" for path in sorted(ROOT.rglob("*.py")) if path != wire
                   for name in _defined(ast.parse(path.read_text(encoding="utf-8"))) & names)  # fmt: skip
    assert not again, "Defined in flashrl/weight_sync/wire.py, and again (import it instead):\n" + "\n".join(again)


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
    modules = {"flashrl.a.x": {"flashrl.b.y"}, "flashrl.b.y": set(), "flashrl.b.z": {"flashrl.a.w"},
               "flashrl.a.w": set(), "flashrl.c": {"flashrl.a.x"}}  # no module cycle, a package cycle a <-> b
    assert _cycles(modules) == []
    assert _package_graph(modules) == {"flashrl.a": {"flashrl.b"}, "flashrl.b": {"flashrl.a"},
                                       "flashrl.c": {"flashrl.a"}}
    assert _cycles(_package_graph(modules)) == [["flashrl.a", "flashrl.b"]]
    defined = "from x import A\nB = 1\nC: int = 2\nclass D: ...\ndef e(): F = 3\nG, H = 4, 5\n"
    assert _defined(ast.parse(defined)) == {"B", "C", "D", "e"}


@pytest.mark.parametrize("folder", ["algorithms", "envs"])
def test_the_upper_layers_are_folders_of_the_package(folder):
    # No package_dir remapping: what a reader and a static tool see is what is imported.
    assert (ROOT / folder / "__init__.py").is_file()
    assert not (ROOT.parent / folder).exists()
