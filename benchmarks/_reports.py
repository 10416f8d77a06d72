"""A benchmark's report: the text table, the config and machine records, strict JSON."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from _repo import MAIN_JOB, REPO


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def fmt_spread(s: Mapping[str, Any], spec: str = ".3f") -> str:
    """'mean (min..max)', or just the mean for a single value."""
    if s["mean"] is None:
        return "-"
    if s["n"] == 1:
        return format(s["mean"], spec)
    return f"{s['mean']:{spec}} ({s['min']:{spec}}..{s['max']:{spec}})"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table, columns as wide as their widest cell."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def config_record(config: Any, *, model: str, tasks_source: str | None = None) -> dict[str, Any]:
    """The config as a dict: the model as its spec (not this machine's folder), task lists summarised.

    `tasks_source` names where a task list comes from (default: the main job's `easy_sums()`).
    """
    record = config.serialize()
    record["model"] = model
    for key in ("env_config", "evaluation_env_config"):
        env = dict(record.get(key) or {})
        if isinstance(env.get("tasks"), list):
            tasks = env["tasks"]
            env["tasks"] = {
                "count": len(tasks),
                "first_ids": [t.get("id") for t in tasks[:3]],
                "source": tasks_source or f"{MAIN_JOB.as_posix()}: easy_sums()",
            }
        record[key] = env
    return record


BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU flags of native bfloat16 arithmetic: without them torch's bfloat16 matmuls take a slow path, so a
bfloat16 learner's speed on a CPU depends on them (recorded with every measurement)."""


def cpu_model() -> dict[str, Any]:
    """The CPU's model name and which of `BF16_FLAGS` it has (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name"), "cpu_bf16_flags": [f for f in BF16_FLAGS if f in flags]}


def machine() -> dict[str, Any]:
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        **cpu_model(),
        "platform": platform.platform(),
        "git_commit": commit,
        "load_average_1min_at_end": load,
    }


def jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return jsonable(asdict(value))
    return value


def write_json(path: str | os.PathLike[str], report: Mapping[str, Any]) -> str:
    """Strict JSON (NaN -> null, +-inf -> "inf"/"-inf"), folders created."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(jsonable(report), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return str(out)
