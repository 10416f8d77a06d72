"""Evidence-3's driver without a model (benchmarks/_wall_design.py, _pinning.py, _wall_driver.py, _wall_clock.py):
the area over wall time by hand, the snapshot schedule, the pilots' grid, resuming a partial run log, the
pinning check and the analysis on synthetic runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _paired import time_to_reach
from _pinning import Pinning, cores_text, parse_cores, pinning_problems, process_affinity
from _run_log import RunLog
from _wall_clock import check_pinning
from _wall_design import (
    WALL_TASKS,
    SnapshotBook,
    _half_decade,
    area_over_generated,
    episode_durations,
    pilot_grid,
    pilot_todo,
    runs_to_do,
    snapshot_times,
    wall_metrics,
    wall_schedule,
)
from _wall_driver import KEY_FIELDS, next_run, one_run, wait_for_idle

ACCURACIES = (0.3, 0.4, 0.5, 0.5, 0.6, 0.7, 0.7)


def _snapshots(accuracies=ACCURACIES, generated_step=100.0):
    return [{"t": 100.0 * k, "version": k, "generated": generated_step * k, "accuracy": a}
            for k, a in enumerate(accuracies)]


def _update(k: int) -> dict:
    return {"update": k, "num_episodes": 16, "policy_lag_mean": 1.0, "accepted_fraction": 1.0, "drift_mean": 1e-4,
            "drift_max": 2e-4 * k, "started_lifetime": 16.0 * k}


def _run(accuracies=ACCURACIES, *, arm="flash_async", seed=0, lr=1e-5, phase="counted", attempt=0, valid=True,
         generated_step=100.0) -> dict:
    record = {"snapshots": _snapshots(accuracies, generated_step), "updates": [_update(k) for k in range(1, 31)],
              "busy_fraction": {"0": 0.9, "1": 0.5}, "valid": valid, "invalid": [] if valid else ["runner: off"],
              "wall_s": 800.0}
    return {"phase": phase, "arm": arm, "lr": lr, "seed": seed, "attempt": attempt, **record,
            "metrics": wall_metrics(record, 600.0) if valid else None}


# --------------------------------------------------------------------------------------------- metric
def test_area_over_wall_time_by_hand():
    # trapezoids of 100 s: (0.35 + 0.45 + 0.5 + 0.55 + 0.65 + 0.7) x 100 = 320, over 600 s
    metrics = wall_metrics(_run(), 600.0)
    assert metrics["area"] == pytest.approx(320 / 600)
    assert metrics["accuracy_at_budget"] == pytest.approx(0.7)
    assert metrics["initial_accuracy"] == pytest.approx(0.3)
    assert metrics["time_to_target"] == pytest.approx(400.0)  # 0.5 at 300 s, 0.6 at 400 s
    # 30 updates of 16 in 600 s; the generated count at 600 s is the last snapshot's
    assert metrics["trained_per_s"] == pytest.approx(480 / 600)
    assert metrics["generated_per_s"] == pytest.approx(600 / 600)
    assert metrics["drift_max"] == pytest.approx(6e-3)


def test_episode_durations_by_hand_and_none_when_no_batch_recorded_them():
    rows = [{"episode_s_mean": 2.0, "episode_s_min": 1.0, "episode_s_max": 4.0},
            {"episode_s_mean": None, "episode_s_min": None, "episode_s_max": None},  # a batch without them
            {"episode_s_mean": 4.0, "episode_s_min": 0.5, "episode_s_max": 10.0}]
    assert episode_durations(rows) == {"episode_s_updates": 2, "episode_s_mean": 3.0,
                                       "episode_s_batch_max_mean": 7.0, "episode_s_min": 0.5, "episode_s_max": 10.0}
    assert episode_durations([_update(1)]) == {"episode_s_updates": 0, "episode_s_mean": None,
                                               "episode_s_batch_max_mean": None, "episode_s_min": None,
                                               "episode_s_max": None}
    assert wall_metrics(_run(), 600.0)["episode_s_updates"] == 0  # runs logged before they were recorded


def test_time_to_reach_interpolates_and_says_none_when_never():
    curve = _snapshots()
    assert time_to_reach(curve, 0.55) == pytest.approx(350.0)
    assert time_to_reach(curve, 0.3) == 0.0
    assert time_to_reach(curve, 0.8) is None


def test_area_over_generated_cuts_every_run_of_a_seed_at_its_smallest_count():
    fast = _run(arm="flash_async", generated_step=100.0)  # 600 generated at 600 s
    slow = _run(arm="flash_sync", generated_step=50.0)  # 300 generated at 600 s: N = 300
    out = area_over_generated([fast, slow])["0"]
    assert out["N"] == 300.0
    # fast over [0, 300]: (0.35 + 0.45 + 0.5) x 100 / 300; slow over its whole curve: 320 x 0.5 / 300
    assert out["area"]["flash_async"] == pytest.approx(130 / 300)
    assert out["area"]["flash_sync"] == pytest.approx(160 / 300)


# --------------------------------------------------------------------------------------------- snapshots
def test_snapshot_times_every_100_s_of_600_and_refuses_a_partial_step():
    assert snapshot_times(600.0, 100.0) == (0.0, 100.0, 200.0, 300.0, 400.0, 500.0, 600.0)
    assert WALL_TASKS["tool_wall"].snapshot_times == (0.0, 300.0, 600.0, 900.0, 1200.0, 1500.0)
    with pytest.raises(ValueError, match="whole number of snapshot intervals"):
        snapshot_times(600.0, 70.0)


def test_a_snapshot_gets_the_last_update_completed_at_or_before_its_time():
    book = SnapshotBook((0.0, 100.0, 200.0, 300.0))
    book.completed(40.0, 1, "w1", 16)
    book.completed(90.0, 2, "w2", 32)
    book.completed(100.0, 3, "w3", 48)  # exactly at 100 s: it counts for 100 s
    book.completed(250.0, 4, "w4", 64)  # after 200 s: 200 s keeps version 3
    with pytest.raises(ValueError, match="past the budget"):
        book.completed(300.5, 5, "w5", 80)
    taken = book.end()
    assert [(s["t"], s["version"], s["weights"], s["generated"]) for s in taken] == [
        (0.0, 0, None, 0.0), (100.0, 3, "w3", 48), (200.0, 3, "w3", 48), (300.0, 4, "w4", 64)]


def test_no_update_before_the_end_leaves_the_initial_policy_everywhere():
    assert [s["version"] for s in SnapshotBook((0.0, 10.0)).end()] == [0, 0]


# --------------------------------------------------------------------------------------------- pilots
def _pilot(arm, lr, areas):
    return [_run(arm=arm, lr=lr, seed=seed, phase="pilot") | {"metrics": {"area": a}}
            for seed, a in zip((200, 201), areas, strict=True)]


def test_half_decade_steps():
    assert [_half_decade(1e-4, 1), _half_decade(3e-4, 1), _half_decade(1e-5, -1), _half_decade(3e-6, -1)] == [
        3e-4, 1e-3, 3e-6, 1e-6]


def test_pilot_grid_keeps_an_inner_choice_and_breaks_ties_to_the_lower_rate():
    runs = _pilot("grpo", 1e-5, (0.50, 0.52)) + _pilot("grpo", 3e-5, (0.60, 0.62)) + _pilot("grpo", 1e-4, (0.40, 0.40))
    grid, choice = pilot_grid(runs, "grpo")
    assert grid == [1e-5, 3e-5, 1e-4] and choice["lr"] == 3e-5
    # 3e-5 and 1e-4 equal to three decimals: the lower, an inner rate (a tie at an edge would extend the grid)
    tied = _pilot("grpo", 1e-5, (0.1, 0.1)) + _pilot("grpo", 3e-5, (0.6101, 0.6100)) + _pilot(
        "grpo", 1e-4, (0.6102, 0.6101))
    grid, choice = pilot_grid(tied, "grpo")
    assert grid == [1e-5, 3e-5, 1e-4] and choice["lr"] == 3e-5
    assert choice["pilot_area_mean"] == pytest.approx({"1e-05": 0.1, "3e-05": 0.61005, "0.0001": 0.61015})


def test_pilot_grid_extends_past_an_edge_until_the_choice_is_inner():
    runs = _pilot("flash_sync", 1e-5, (0.5, 0.5)) + _pilot("flash_sync", 3e-5, (0.6, 0.6)) + _pilot(
        "flash_sync", 1e-4, (0.7, 0.7))
    grid, choice = pilot_grid(runs, "flash_sync")
    assert grid == [1e-5, 3e-5, 1e-4, 3e-4] and choice is None
    assert pilot_todo(runs, ("flash_sync",)) == [("flash_sync", 3e-4, 200), ("flash_sync", 3e-4, 201)]
    runs += _pilot("flash_sync", 3e-4, (0.65, 0.66))
    grid, choice = pilot_grid(runs, "flash_sync")
    assert grid == [1e-5, 3e-5, 1e-4, 3e-4] and choice["lr"] == 1e-4
    assert choice["pilot_area_mean"] == pytest.approx({"1e-05": 0.5, "3e-05": 0.6, "0.0001": 0.7, "0.0003": 0.655})
    assert pilot_todo(runs, ("flash_sync",)) == []
    # the bottom edge extends downwards
    low = _pilot("grpo", 1e-5, (0.7, 0.7)) + _pilot("grpo", 3e-5, (0.6, 0.6)) + _pilot("grpo", 1e-4, (0.5, 0.5))
    assert pilot_grid(low, "grpo")[0] == [3e-6, 1e-5, 3e-5, 1e-4]


def test_pilot_todo_runs_seed_by_seed_arms_rotated_rates_ascending_and_ignores_invalid_runs():
    arms = WALL_TASKS["sums_wall"].arms
    invalid = _run(arm="grpo", lr=1e-5, seed=200, phase="pilot", valid=False)
    todo = pilot_todo([invalid], arms)
    assert len(todo) == 18
    # seed 200 starts with arm 200 mod 3 = 2 (grpo), seed 201 with arm 0
    assert todo[:3] == [("grpo", 1e-5, 200), ("grpo", 3e-5, 200), ("grpo", 1e-4, 200)]
    assert todo[9] == ("flash_async", 1e-5, 201)


# --------------------------------------------------------------------------------------------- resume
def test_a_killed_driver_resumes_without_a_duplicated_or_missing_run(tmp_path):
    task = WALL_TASKS["sums_wall"]
    lrs = {"flash_async": 3e-5, "flash_sync": 1e-4, "grpo": 3e-5}
    seeds = list(range(12))
    settings = {"task": "sums_wall", "budget_s": 600.0}
    report = tmp_path / "wall.json"
    log = RunLog(report, key_fields=KEY_FIELDS, settings=settings, resume=False)
    schedule = wall_schedule(task.arms, seeds, lrs)
    assert schedule[:3] == [("flash_async", 3e-5, 0), ("flash_sync", 1e-4, 0), ("grpo", 3e-5, 0)]
    assert schedule[3] == ("flash_sync", 1e-4, 1)  # seed 1 starts with arm 1
    for arm, lr, seed in schedule[:7]:
        log.add(_run(arm=arm, lr=lr, seed=seed))
    arm, lr, seed = schedule[7]
    log.add(_run(arm=arm, lr=lr, seed=seed, valid=False))  # its pinning did not take
    with log.path.open("a") as f:
        f.write('{"phase": "counted", "arm": "grpo", "lr"')  # the kill, mid-line
    resumed = RunLog(report, key_fields=KEY_FIELDS, settings=settings, resume=True)
    made = []
    while (todo := next_run(resumed.runs(), task, "counted", seeds, lrs, task.arms)) is not None:
        arm, lr, seed, attempt = todo
        made.append(todo)
        resumed.add(_run(arm=arm, lr=lr, seed=seed, attempt=attempt))
    assert made[0] == (*schedule[7], 1)  # the invalid run's key again, as its second attempt
    assert [m[:3] for m in made] == schedule[7:]
    valid = [(r["arm"], r["lr"], r["seed"]) for r in resumed.runs() if r["valid"]]
    assert sorted(valid) == sorted(schedule) and len(valid) == len(set(valid)) == 36
    assert sum(not r["valid"] for r in resumed.runs()) == 1  # kept in the log, not counted


def test_a_key_invalid_three_times_stops_the_driver():
    runs = [_run(seed=0, attempt=k, valid=False) for k in range(3)]
    with pytest.raises(RuntimeError, match="3 invalid runs in a row"):
        runs_to_do(runs, "counted", [("flash_async", 1e-5, 0)])


def test_a_crash_is_logged_as_an_invalid_run_with_its_cause():
    def crash():
        raise OSError("engine died")

    line = one_run(crash, phase="counted", arm="grpo", lr=1e-5, seed=3, attempt=0, budget_s=600.0)
    assert line["valid"] is False and line["metrics"] is None
    assert line["invalid"] == ["crash: OSError: engine died"] and "engine died" in line["traceback"]


def test_wait_for_idle_waits_then_gives_up():
    loads = iter([3.0, 2.0, 0.2])
    slept = []
    assert wait_for_idle(0.5, 60.0, load=lambda: (next(loads), 0, 0), sleep=slept.append) == 0.2
    assert slept == [15.0, 15.0]
    with pytest.raises(SystemExit, match="load average is 3.00"):
        wait_for_idle(0.5, 30.0, load=lambda: (3.0, 0, 0), sleep=lambda s: None)


# --------------------------------------------------------------------------------------------- pinning
def _side(cores, *, thread_cores=None, reported=None, children=()):
    proc = {"pid": 10, "name": "ray::EnvRunner", "cpus_allowed_list": cores,
            "threads": {"10": cores, "11": thread_cores or cores}}
    kids = [{"pid": 20 + i, "name": "VLLM::EngineCor", "cpus_allowed_list": c, "threads": {str(20 + i): c}}
            for i, c in enumerate(children)]
    return {"process": proc, "children": kids, "sched_getaffinity": reported if reported is not None else cores}


def test_cores_text_round_trips():
    assert cores_text([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert parse_cores("0-2,5,7-8\n") == [0, 1, 2, 5, 7, 8]


def test_pinning_problems_name_each_difference():
    assert pinning_problems(_side([0], children=[[0]]), [0], side="runner", min_children=1) == []
    problems = pinning_problems(_side([0], thread_cores=[0, 1], children=[[0, 1]], reported=[0, 1]), [0],
                                side="runner", min_children=1)
    assert len(problems) == 4
    assert "sched_getaffinity" in problems[0] and "pid 10 has 1 thread(s) off 0" in problems[1]
    assert "pid 20 (VLLM::EngineCor) has Cpus_allowed_list 0-1" in problems[2] and "pid 20 has 1 thread" in problems[3]
    assert "expected at least 1" in pinning_problems(_side([0]), [0], side="runner", min_children=1)[0]


def test_a_run_whose_affinity_read_back_differs_is_invalid():
    good = {"runner": _side([0], children=[[0]]), "learner": _side([1])}
    assert check_pinning({"start": good, "end": good}, Pinning(), engine_children=1) == []
    off = {"runner": _side([0, 1], children=[[0, 1]]), "learner": _side([1])}
    problems = check_pinning({"start": good, "end": off}, Pinning(), engine_children=1)
    assert problems and all(p.startswith("end: runner") for p in problems)
    assert check_pinning({"start": good, "end": {"error": "RayActorError: died"}}, Pinning(), engine_children=1) == [
        "end: no reading (RayActorError: died)"]


def test_process_affinity_reads_this_process_back():
    mine = sorted(os.sched_getaffinity(0))
    reading = {"process": process_affinity(os.getpid()), "children": [], "sched_getaffinity": mine}
    assert reading["process"]["cpus_allowed_list"] == mine and str(os.getpid()) in reading["process"]["threads"]
    assert pinning_problems(reading, mine, side="learner") == []
    assert pinning_problems(reading, [max(mine) + 1], side="learner")  # a core it does not have: refused


# --------------------------------------------------------------------------------------------- analysis
def _synthetic_log(report_path, runs_by_key):
    """A run log holding `runs_by_key` under the settings line a report-only call wrote."""
    log_path = report_path.with_name(report_path.name + ".runs.tmp")
    settings = log_path.read_text().splitlines()[0]
    log_path.write_text("\n".join([settings, *(json.dumps(r) for r in runs_by_key)]) + "\n")


def test_the_report_compares_twelve_paired_seeds_and_stays_sealed_before(bench, tmp_path):
    pc = bench("paired_comparison")
    out = tmp_path / "sums_wall.json"
    figure = tmp_path / "sums_wall.png"
    args = ["--task", "sums_wall", "--phase", "counted", "--report-only", "--output", str(out), "--figure", str(figure)]
    pc.main(args)  # an empty report: writes the log's settings line
    effect = {"flash_async": 0.1, "flash_sync": 0.0, "grpo": -0.05}
    runs = []
    for seed in range(12):
        noise = 0.01 * ((seed * 7) % 5)  # shared by a seed's arms: the pairing removes it
        jitter = 0.002 * (seed % 3)  # flash_async's own: the differences vary
        for arm, shift in effect.items():
            extra = jitter if arm == "flash_async" else 0.0
            runs.append(_run([a + shift + noise + extra for a in ACCURACIES], arm=arm, seed=seed))
    runs.append(_run(arm="grpo", seed=0, attempt=0, valid=False) | {"attempt": 1})  # an invalid extra: ignored
    _synthetic_log(out, runs[:-2] + runs[-1:])  # seed 11 lacks grpo: sealed
    sealed = pc.main(args)
    assert sealed["seal"]["sealed"] and sealed["seal"]["missing_seeds"]["grpo"] == [11]
    assert sealed["comparisons"] is None and set(sealed["arms"]["grpo"]) == {"n", "wall_s"}
    assert not figure.exists()  # sealed: no figure
    _synthetic_log(out, runs)
    report = pc.main(args)
    assert not report["seal"]["sealed"] and report["invalid_runs"] == 1
    primary = report["comparisons"]["flash_async - flash_sync"]
    mean_jitter = sum(0.002 * (s % 3) for s in range(12)) / 12
    assert primary["area"]["n"] == 12 and primary["area"]["mean"] == pytest.approx(0.1 + mean_jitter)
    lo, hi = primary["area"]["interval"]
    assert lo < primary["area"]["mean"] < hi and primary["area"]["p_value"] == pytest.approx(2 / 4096)
    assert report["comparisons"]["flash_sync - grpo"]["area"]["mean"] == pytest.approx(0.05)
    assert all("p_value_holm" in c["area"] for c in report["comparisons"].values())
    assert report["arms"]["flash_async"]["n"] == 12 and report["arms"]["flash_async"]["busy_fraction_mean"] == {
        "0": pytest.approx(0.9), "1": pytest.approx(0.5)}
    assert report["area_over_generated"]["0"]["N"] == 600.0
    by_generated = [report["area_over_generated"][str(s)]["area"]["grpo"] for s in range(12)]
    assert report["arms"]["grpo"]["area_over_generated_mean"] == pytest.approx(sum(by_generated) / 12)
    assert set(report["cpu_bfloat16_flags"]) <= {"avx512_bf16", "amx_bf16"}
    assert figure.stat().st_size > 0  # unsealed: accuracy and generated rollouts over wall time


def test_the_report_of_the_pilots_gives_each_arms_grid_and_choice(bench, tmp_path):
    pc = bench("paired_comparison")
    out = tmp_path / "sums_wall.json"
    args = ["--task", "sums_wall", "--phase", "pilot", "--report-only", "--output", str(out)]
    pc.main(args)
    runs = []
    for arm, best in (("flash_async", 3e-5), ("flash_sync", 1e-4), ("grpo", 3e-5)):
        for lr in (1e-5, 3e-5, 1e-4):
            height = 0.2 if lr == best else 0.0
            runs += [_run([a + height for a in ACCURACIES], arm=arm, lr=lr, seed=s, phase="pilot") for s in (200, 201)]
    _synthetic_log(out, runs)
    report = pc.main(args)
    choice = report["learning_rate_choice"]
    assert choice["flash_async"]["choice"]["lr"] == 3e-5 and choice["grpo"]["choice"]["lr"] == 3e-5
    assert choice["flash_sync"]["grid"] == [1e-5, 3e-5, 1e-4, 3e-4] and choice["flash_sync"]["choice"] is None
    cell = report["pilots"]["flash_async"]["3e-05"]
    assert cell["seeds"] == [200, 201] and cell["complete"] and cell["area_mean"] == pytest.approx(320 / 600 + 0.2)
    assert report["comparisons"] == {} or all(c["area"] is None for c in report["comparisons"].values())


def test_the_wall_flags_refuse_what_the_preregistration_fixes(bench, tmp_path):
    pc = bench("paired_comparison")
    for argv in (["--task", "tool_wall", "--phase", "pilot"], ["--task", "sums_wall", "--arms", "grpo"],
                 ["--task", "sums_wall", "--phase", "counted", "--seeds", "12"],
                 ["--task", "sums", "--smoke-budget-s", "30"]):
        with pytest.raises(SystemExit):
            pc.parse_args(argv)
    with pytest.raises(SystemExit):  # a smoke never writes beside the counted results
        pc.parse_args(["--task", "sums_wall", "--smoke-budget-s", "30", "--output",
                       str(pc.RESULTS / "paired_comparison_sums_wall.json")])
    smoke = pc.parse_args(["--task", "sums_wall", "--smoke-budget-s", "45", "--arms", "flash_async", "--seeds", "0"])
    assert "flashrl-bench-smoke" in smoke.output


def test_the_worker_hook_pins_every_thread_of_its_process():
    """In a child process with a thread already running (as a Ray worker has): the hook pins both threads."""
    import subprocess
    import sys

    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    core = min(os.sched_getaffinity(0))
    code = (
        "import json, os, threading, time\n"
        "from _pinning import pin_worker_from_env, pinning_problems, side_affinity\n"
        "stop = threading.Event(); t = threading.Thread(target=stop.wait); t.start()\n"
        f"before = pinning_problems(side_affinity(os.getpid()), [{core}], side='w')\n"
        "pin_worker_from_env()\n"
        "reading = side_affinity(os.getpid(), reported=os.sched_getaffinity(0))\n"
        f"print(json.dumps([len(reading['process']['threads']), bool(before), "
        f"pinning_problems(reading, [{core}], side='w')]))\n"
        "stop.set()\n"
    )
    env = {**os.environ, "FLASHRL_BENCH_RUNNER_CORES": str(core), "PYTHONPATH": str(benchmarks)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    threads, off_before, problems = json.loads(out.stdout)
    assert threads >= 2 and problems == []
    assert off_before == (len(os.sched_getaffinity(0)) > 1)  # on more than one core, the check saw it unpinned


def test_the_counted_runs_are_refused_before_the_pilots_chose_every_rate(bench, tmp_path):
    """Refused before Ray or a model starts: nothing runs at a rate the pilots did not choose."""
    with pytest.raises(SystemExit, match="pilots have not chosen a rate"):
        bench("paired_comparison").main(["--task", "sums_wall", "--phase", "counted",
                                         "--output", str(tmp_path / "w.json")])
