"""Every command line of the repository refuses abbreviated options (argparse's ``allow_abbrev=False``).

With abbreviations on, ``scripts/gpu_check.py --engine torch`` was read as ``--engine-prompts torch``:
a mistyped or obsolete flag must be an error, never another flag. The check reads the source (``ast``):
each ``ArgumentParser(...)`` and sub-command ``add_parser(...)`` call passes ``allow_abbrev=False``.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("flashrl", "scripts", "benchmarks", "tuned_examples", "examples")


def _parsers_allowing_abbreviations(path: Path, root: Path = REPO) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name not in ("ArgumentParser", "add_parser"):
            continue
        flag = next((k.value for k in node.keywords if k.arg == "allow_abbrev"), None)
        if not (isinstance(flag, ast.Constant) and flag.value is False):
            out.append(f"{path.relative_to(root)}:{node.lineno} {name}(...)")
    return out


def test_every_command_line_refuses_abbreviated_options():
    files = [p for folder in FOLDERS for p in sorted((REPO / folder).rglob("*.py"))]
    assert len(files) > 50, "the check must see the repository's scripts"
    found = [hit for path in files for hit in _parsers_allowing_abbreviations(path)]
    assert not found, "pass allow_abbrev=False to:\n" + "\n".join(found)


def test_the_check_sees_a_parser_without_it(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text("import argparse\np = argparse.ArgumentParser(description='x')\n"
                      "q = argparse.ArgumentParser(allow_abbrev=False)\n"
                      "r = p.add_subparsers().add_parser('run', allow_abbrev=True)\n", encoding="utf-8")
    assert _parsers_allowing_abbreviations(script, tmp_path) == ["probe.py:2 ArgumentParser(...)",
                                                                 "probe.py:4 add_parser(...)"]
