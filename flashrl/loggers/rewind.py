"""Rewinding a progress file to a checkpoint: a resumed run continues the timeline of its checkpoint.

A run killed after its checkpoint at iteration N had already logged iterations N+1, N+2, ...; the
resumed run trains those iterations again. Left in place, the file would hold two timelines
(1, 2, 3, 3, 4, 5, 5, ...). `rewind_jsonl` cuts the file at the first row past N (or the first line a
kill cut short) and moves what it cut to a side file, ``<name>.discarded.jsonl``, after a marker row
``{"discarded_by_resume_from_iteration": N}``, so nothing is deleted and the main file stays one
timeline. `rewind_csv` drops the CSV's rows past N (the JSON lines side file keeps them).
"""

from __future__ import annotations

import csv
import json
import os

__all__ = ["DISCARDED_MARKER", "discarded_path", "rewind_csv", "rewind_jsonl"]

DISCARDED_MARKER = "discarded_by_resume_from_iteration"
"""The key of the row that heads each block of discarded rows in the side file."""


def discarded_path(path: str | os.PathLike[str]) -> str:
    """``progress.jsonl`` -> ``progress.discarded.jsonl``: where `rewind_jsonl` moves the cut rows."""
    root, ext = os.path.splitext(os.fspath(path))
    return f"{root}.discarded{ext}"


def _past(line: str, step: int) -> bool:
    """Whether a line starts the discarded part: a row past ``step``, or a line a kill cut short."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return True
    iteration = row.get("training_iteration") if isinstance(row, dict) else None
    return isinstance(iteration, (int, float)) and iteration > step


def rewind_jsonl(path: str | os.PathLike[str], step: int) -> int:
    """Cut ``path`` at its first row past iteration ``step``; returns how many lines moved to the side file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    cut = next((i for i, line in enumerate(lines) if line.strip() and _past(line, step)), len(lines))
    if cut == len(lines):
        return 0
    with open(discarded_path(path), "a", encoding="utf-8") as side:
        side.write(json.dumps({DISCARDED_MARKER: float(step)}) + "\n")
        side.writelines(line + "\n" for line in lines[cut:])
    _replace(path, "".join(line + "\n" for line in lines[:cut]))
    return len(lines) - cut


def rewind_csv(path: str | os.PathLike[str], step: int) -> int:
    """Drop the rows of a ``progress.csv`` past iteration ``step``; returns how many it dropped."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return 0
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        columns, rows = list(reader.fieldnames or []), list(reader)
    kept = [row for row in rows if not _number(row.get("training_iteration")) > step]
    if len(kept) == len(rows):
        return 0
    tmp = path + ".tmp"
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(kept)
    os.replace(tmp, path)
    return len(rows) - len(kept)


def _number(cell: str | None) -> float:
    try:
        return float(cell) if cell else float("-inf")
    except ValueError:
        return float("-inf")


def _replace(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
