"""The README quotes only recorded figures, and its Layout table names every part of `flashrl/`.

A README paragraph (or table row) that names a JSON file (`benchmarks/results/x.json`, in backticks)
quotes figures from it: every number in it outside backticks must be one of the file's numbers,
rounded to the digits the paragraph gives (`0.562` for 0.5625, `11.9` for 11.92; `45%` is read as
0.45). Each main job's expected result must be such a paragraph, so a figure with no file cannot stand
in for one. A paragraph or row that cites no file quotes no figure at all: a setting's value or a
version is written in backticks (`0.55`, `3.11`), which marks it as typed, not measured. The README
stays an entry page: at most `MAX_LINES` lines, the results in one table.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

CITED_JSON = re.compile(r"`((?:benchmarks|docs)/[\w./-]+\.json)`")
BACKTICKED = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
NUMBER = re.compile(r"(?<![\w.])(\d+(?:,\d{3})*(?:\.(\d+))?(?:e([-+]?\d+))?)(%?)(?=x\b|(?![\w.]*\w))")
"""A figure: 0.562, 1,440, 5.2e-4, 45%, or a ratio's number (1.64x); not a name such as x86 or 2nd."""

MAX_LINES = 130
"""The README's length limit: what it is, the two commands, the builder, the agent snippet, one table of
results, the docs map and the layout; everything else lives in docs/."""

MAIN_JOBS = {
    "tuned_examples/smollm2_arithmetic_cpu.py": "benchmarks/results/learning_efficiency.json",
    "tuned_examples/smollm2_python_tool_cpu.py": "benchmarks/results/agentic_learning.json",
}
"""Each main job and the file its README result line must cite."""


def json_numbers(value: object) -> Iterator[float]:
    """Every finite number in a JSON document (booleans excluded)."""
    if isinstance(value, dict):
        for item in value.values():
            yield from json_numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from json_numbers(item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        yield float(value)


def quoted_numbers(text: str) -> list[tuple[str, float, float]]:
    """(as written, value, unit of its last digit) of each figure, outside backticks and link targets."""
    prose = LINK_TARGET.sub("]", BACKTICKED.sub(" ", text))
    out = []
    for match in NUMBER.finditer(prose):
        written, fraction, exponent, percent = match.groups()
        value = float(written.replace(",", ""))
        unit = 10.0 ** (-len(fraction or "") + int(exponent or 0))
        if percent:
            value, unit = value / 100, unit / 100
        out.append((match.group(0), value, unit))
    return out


def unrecorded(line: str, numbers: list[float]) -> list[str]:
    """The figures on ``line`` that no number of the file gives at the quoted precision."""
    missing = []
    for written, value, unit in quoted_numbers(line):
        # half a unit of the last digit either way (0.5625 may be written 0.562 or 0.563); prose
        # drops signs ("ended 0.062 lower"), so magnitudes are compared
        tolerance = 0.5 * unit * (1 + 1e-9)
        if not any(abs(abs(x) - value) <= tolerance for x in numbers):
            missing.append(written)
    return missing


def blocks(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, text) of each paragraph and each table row, code blocks left out."""
    start, lines, in_code = 0, [], False
    for number, line in enumerate([*text.splitlines(), ""], 1):
        if line.startswith("```"):
            in_code = not in_code
        if in_code or line.startswith(("```", "|")) or not line.strip():
            if lines:
                yield start, " ".join(lines)
            lines = []
            if line.startswith("|") and not in_code:
                yield number, line
            continue
        if not lines:
            start = number
        lines.append(line)


def cited_lines(text: str) -> list[tuple[int, str, str]]:
    """(first line number, paragraph, cited JSON path) of every README paragraph naming one JSON file."""
    rows = []
    for number, block in blocks(text):
        paths = set(CITED_JSON.findall(block))
        if len(paths) > 1:
            raise AssertionError(f"README paragraph at line {number} cites {sorted(paths)}: cite one file each")
        if paths:
            rows.append((number, block, paths.pop()))
    return rows


def test_every_figure_on_a_cited_line_is_in_its_file() -> None:
    rows = cited_lines(README.read_text())
    problems = []
    for number, line, path in rows:
        file = ROOT / path
        assert file.is_file(), f"README line {number} cites {path}, which does not exist"
        numbers = list(json_numbers(json.loads(file.read_text())))
        missing = unrecorded(line, numbers)
        if missing:
            problems.append(f"line {number}: {missing} not in {path}")
    assert not problems, "README figures without a record: " + "; ".join(problems)


@pytest.mark.parametrize("job", sorted(MAIN_JOBS))
def test_each_main_job_has_a_recorded_result(job: str) -> None:
    text = README.read_text()
    assert f"python {job}" in text, f"the README no longer runs {job}"
    command_line = text[: text.index(f"python {job}")].count("\n") + 1
    cited = [path for number, block, path in cited_lines(text) if number > command_line and quoted_numbers(block)]
    assert cited and cited[0] == MAIN_JOBS[job], (
        f"expected the first cited line after `python {job}` to quote {MAIN_JOBS[job]}, got {cited[:1]}"
    )


def test_the_checker_rejects_a_figure_its_file_lacks() -> None:
    numbers = [0.5625, 11.924865, 0.2448, 64.0, 3.0]
    assert unrecorded("accuracy 0.562 at 11.9 s, gain 0.245 over 64 sums, 3 seeds", numbers) == []
    assert unrecorded("accuracy 0.564 at 11.9 s", numbers) == ["0.564"]  # 0.5625 gives 0.562 or 0.563
    assert unrecorded("11.8 s per update", numbers) == ["11.8"]
    assert unrecorded("56% of 64 `results/x_0.77.json`", numbers) == []  # 56% is 0.5625 at two digits
    assert unrecorded("0.77 -> 0.64", numbers) == ["0.77", "0.64"]
    assert unrecorded("1.81x, 5.6e-1, on x86 cores", [1.8123, 0.5625]) == []
    assert unrecorded("1.82x and 5.7e-1", [1.8123, 0.5625]) == ["1.82", "5.7e-1"]
    assert unrecorded("0.062 lower", [-0.0625]) == []


def test_paragraphs_are_checked_whole_and_code_is_left_out() -> None:
    text = "a `x.json`\nwrapped 0.5\n\n```bash\npython run.py `y.json` 7\n```\n| `z.json` | 3 |\nafter\n"
    assert list(blocks(text)) == [(1, "a `x.json` wrapped 0.5"), (7, "| `z.json` | 3 |"), (8, "after")]


def layout_names(text: str) -> set[str]:
    """The backticked names in the first column of the README's Layout table."""
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


def test_layout_table_names_every_package_and_module() -> None:
    names = layout_names(README.read_text())
    parts = sorted(
        f"{p.name}/" if p.is_dir() else p.name
        for p in (ROOT / "flashrl").iterdir()
        if (p.is_dir() and (p / "__init__.py").is_file()) or (p.suffix == ".py" and p.name != "__init__.py")
    )
    assert len(parts) >= 15, parts
    missing = [part for part in parts if part not in names]
    assert not missing, f"flashrl/ parts without a row in the README's Layout table: {missing}"


def test_layout_names_every_tests_folder() -> None:
    section = README.read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    paragraph = next((b for _, b in blocks(section) if "`tests/`" in b), "")
    assert paragraph, "the Layout section no longer describes `tests/`"
    named = set(re.findall(r"`([^`/]+)`", paragraph.split("`tests/`", 1)[1]))
    folders = sorted(p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and any(p.glob("test_*.py")))
    missing = [folder for folder in folders if folder not in named]
    assert not missing, f"tests/ folders the README's Layout does not name: {missing}"
    extra = [name for name in named if name.isidentifier() and not (ROOT / "tests" / name).is_dir()]
    assert not extra, f"the README's Layout names tests/ folders that do not exist: {extra}"


def uncited_figures(text: str) -> list[tuple[int, list[str]]]:
    """(line, figures) of each paragraph or table row that quotes a figure but cites no JSON file."""
    out = []
    for number, block in blocks(text):
        if CITED_JSON.search(block):
            continue
        figures = [written for written, _, _ in quoted_numbers(block)]
        if figures:
            out.append((number, figures))
    return out


def test_every_figure_cites_its_file() -> None:
    problems = uncited_figures(README.read_text())
    assert not problems, (
        f"README figures in paragraphs or rows that cite no benchmarks/results JSON: {problems}. Fix: cite the "
        "file the figure comes from, or write a setting's value in backticks"
    )


def test_the_uncited_check_finds_a_bare_figure() -> None:
    text = "stops at `0.55` after `60` updates\n\nruns 1.64x faster\n\n| a | 0.3 | `benchmarks/results/a.json` |\n"
    assert uncited_figures(text) == [(3, ["1.64"])]


def test_the_readme_is_an_entry_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README has {len(lines)} lines, expected at most {MAX_LINES}: move detail to docs/"
