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


def test_a_config_record_names_the_job_its_task_lists_come_from(bench):
    class Config:  # what config_record reads of an AlgorithmConfig
        def serialize(self):
            tasks = [{"id": "mul2:86*26"}, {"id": "mul2:13*67"}]
            return {"env_config": {"tasks": tasks}, "evaluation_env_config": {"tasks": tasks[:1]}}

    record = bench("paired_comparison").task_config_record
    tool = record(Config(), model="tiny", job="tool")
    assert tool["env_config"]["tasks"] == {"count": 2, "first_ids": ["mul2:86*26", "mul2:13*67"],
                                           "source": "tuned_examples/smollm2_python_tool_cpu.py: products()"}
    assert tool["evaluation_env_config"]["tasks"]["source"].endswith("products()") and tool["model"] == "tiny"
    assert record(Config(), model="tiny", job="sums")["env_config"]["tasks"]["source"].endswith("easy_sums()")
