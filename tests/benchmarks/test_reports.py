"""The reports' JSON is strict: no NaN or Infinity constants a standard parser refuses."""

from __future__ import annotations

import json
import math
from pathlib import Path

from _reports import write_json


def test_write_json_is_strict(tmp_path):
    path = write_json(
        tmp_path / "sub" / "r.json", {"a": math.nan, "b": math.inf, "c": [1.0, -math.inf]}
    )

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    assert json.loads(Path(path).read_text(), parse_constant=refuse) == {
        "a": None,
        "b": "inf",
        "c": [1.0, "-inf"],
    }
