"""The run log: finished runs survive a kill, `--resume` keeps them, other settings are refused."""

from __future__ import annotations

import math

import pytest
from _configs import FULL, QUICK
from _reports import write_json
from _run_log import RunLog


def test_run_log_keeps_finished_runs_for_resume(tmp_path):
    report = tmp_path / "r.json"
    settings = {"scale": QUICK}
    log = RunLog(report, key_fields=("method", "seed"), settings=settings, resume=False)
    log.add({"method": "grpo", "seed": 0, "drift": math.inf, "curve": [1.0]})
    log.add({"method": "grpo", "seed": 1, "curve": [2.0]})
    with open(log.path, "a", encoding="utf-8") as f:  # a run killed while its line was written
        f.write('{"method": "grpo", "se')

    again = RunLog(report, key_fields=("method", "seed"), settings=settings, resume=True)
    assert len(again) == 2
    assert again.get(method="grpo", seed=0) == {"method": "grpo", "seed": 0, "drift": "inf", "curve": [1.0]}
    assert again.get(method="grpo", seed=2) is None
    again.add({"method": "grpo", "seed": 2, "curve": [3.0]})
    assert len(RunLog(report, key_fields=("method", "seed"), settings=settings, resume=True)) == 3

    other = {"scale": FULL}
    with pytest.raises(ValueError, match="without --resume"):
        RunLog(report, key_fields=("method", "seed"), settings=other, resume=True)
    fresh = RunLog(report, key_fields=("method", "seed"), settings=other, resume=False)
    assert len(fresh) == 0 and fresh.get(method="grpo", seed=0) is None
    assert len(RunLog(report, key_fields=("method", "seed"), settings=other, resume=True)) == 0


def test_run_log_resumes_from_the_committed_report(tmp_path):
    # a fresh clone has the report but no log: its runs are the finished ones
    report = tmp_path / "r.json"
    runs = [{"arm": "no_is", "seed": 0, "curve": [0.5]}, {"arm": "no_is", "seed": 1, "curve": [0.6]}]
    write_json(
        report, {"settings": {"quick": False, "seeds": [0, 1], "scale": FULL}, "runs": runs}
    )
    settings = {"scale": FULL}

    log = RunLog(report, key_fields=("arm", "seed"), settings=settings, resume=True)
    assert len(log) == 2 and log.get(arm="no_is", seed=1) == runs[1]
    log.add({"arm": "no_is", "seed": 2, "curve": [0.7]})  # the new run goes to the log, next to them
    again = RunLog(report, key_fields=("arm", "seed"), settings=settings, resume=True)
    assert [again.get(arm="no_is", seed=s)["curve"] for s in (0, 1, 2)] == [[0.5], [0.6], [0.7]]

    log.path.unlink()
    with pytest.raises(ValueError, match=r"r\.json was made with .*without --resume"):
        RunLog(report, key_fields=("arm", "seed"), settings={"scale": QUICK}, resume=True)
    assert len(RunLog(report, key_fields=("arm", "seed"), settings=settings, resume=False)) == 0
