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
    with pytest.raises(FileExistsError, match=r"holds 3 finished run\(s\).*--resume.*--discard-log"):
        RunLog(report, key_fields=("method", "seed"), settings=other, resume=False)
    assert len(RunLog(report, key_fields=("method", "seed"), settings=settings, resume=True)) == 3  # untouched
    fresh = RunLog(report, key_fields=("method", "seed"), settings=other, resume=False, discard=True)
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


def test_run_log_is_append_only(tmp_path):
    # Resuming and adding never rewrite what is written: every earlier byte stays where it was.
    report = tmp_path / "r.json"
    settings = {"scale": QUICK}
    log = RunLog(report, key_fields=("seed",), settings=settings, resume=False)
    log.add({"seed": 0, "curve": [1.0]})
    with open(log.path, "a", encoding="utf-8") as f:
        f.write('{"seed": 1, "cu')  # killed mid-line
    before = log.path.read_bytes()
    again = RunLog(report, key_fields=("seed",), settings=settings, resume=True)
    again.add({"seed": 1, "curve": [2.0]})
    after = log.path.read_bytes()
    assert after.startswith(before)
    assert after[len(before):] == b'\n{"seed": 1, "curve": [2.0]}\n'
    assert RunLog(report, key_fields=("seed",), settings=settings, resume=True).get(seed=1) == {"seed": 1,
                                                                                             "curve": [2.0]}


def test_a_log_without_runs_may_be_started_over(tmp_path):
    report = tmp_path / "r.json"
    RunLog(report, key_fields=("seed",), settings={"scale": QUICK}, resume=False)
    log = RunLog(report, key_fields=("seed",), settings={"scale": FULL}, resume=False)  # nothing to lose
    assert len(log) == 0 and not log.path.with_name(log.path.name + ".new").exists()
