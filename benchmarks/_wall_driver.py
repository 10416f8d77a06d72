"""`paired_comparison.py --task sums_wall | tool_wall`: evidence-3's pilots, counted runs and report.

The design is `_wall_design`'s, one run is `_wall_clock.wall_run`'s; this module orders the runs, waits for
idle cores before each, appends each run to the run log the moment it ends (a killed driver resumes from it
with ``--resume``: no run is repeated or lost, an invalid one is kept and run again), and writes the report
with `paired_comparison`'s analysis (paired differences, t-intervals, sign-flip p-values, Holm), sealed until
every arm has every counted seed, as evidence-2's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from _pinning import Pinning
from _reports import fmt, machine, table, write_json
from _run_log import RunLog
from _wall_design import (
    QUICK_WALL,
    WALL_COUNTED_SEEDS,
    WALL_LEARNING_RATES,
    WALL_PILOT_SEEDS,
    WALL_TARGET,
    WALL_TASKS,
    WallTask,
    area_over_generated,
    pilot_grid,
    pilot_todo,
    runs_to_do,
    wall_metrics,
    wall_schedule,
)

PREREGISTRATION = "benchmarks/paired_comparison.md#evidence-3-asynchrony-over-wall-time-the-sampler-and-the-learner-on-their-own-cores"
KEY_FIELDS = ("phase", "arm", "lr", "seed", "attempt")
"""A run log key: `attempt` numbers the invalid runs of (phase, arm, lr, seed) before it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The wall tasks' own flags (the rest are `paired_comparison`'s)."""
    parser.add_argument("--max-load", type=float, default=0.5,
                        help="wall tasks: start a run only when the 1-minute load average is below this (the "
                             "cores must be otherwise idle); the load before each run is recorded")
    parser.add_argument("--load-wait-s", type=float, default=900.0,
                        help="wall tasks: how long to wait for that before stopping (the log keeps what ran)")
    parser.add_argument("--smoke-budget-s", type=float, default=None,
                        help="wall tasks: a smoke of the real job with this wall budget (3 snapshot intervals), "
                             "written under the system temp folder, never counted")
    parser.add_argument("--arms", nargs="+", default=None, help="wall smoke and --quick only: the arms to run")
    parser.add_argument("--lr", type=float, default=None,
                        help="wall smoke and --quick only: the learning rate (default the job's)")
    parser.add_argument("--keep-snapshots", action="store_true",
                        help="wall tasks: keep the snapshot files after their evaluation")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what the wall tasks' pre-registration does not allow; fill the wall defaults."""
    task = WALL_TASKS[args.task]
    smoke = args.smoke_budget_s is not None
    if (args.arms or args.lr is not None) and not (smoke or args.quick):
        parser.error("--arms and --lr are for --smoke-budget-s and --quick only: the pre-registration fixes the "
                     "arms and rates")
    if smoke and args.quick:
        parser.error("--smoke-budget-s runs the real job; --quick the tiny model: choose one")
    if not task.tuned and args.phase == "pilot":
        parser.error(f"--task {args.task} has no pilot phase (the pre-registration gives both arms the job's rate)")
    if args.dtype is not None and task.job != "tool":
        parser.error(f"--dtype applies to --task tool_wall only, got --task {args.task}")
    if args.arms and not set(args.arms) <= set(task.arms):
        parser.error(f"--arms: expected some of {list(task.arms)}, got {args.arms}")
    allowed = WALL_PILOT_SEEDS if args.phase == "pilot" and task.tuned else (
        WALL_COUNTED_SEEDS if task.tuned else tuple(range(3)))
    args.seeds = args.seeds or list(allowed)
    if not (args.quick or smoke) and not set(args.seeds) <= set(allowed) and task.tuned:
        parser.error(f"--seeds: expected a subset of the pre-registered {list(allowed)}, got {args.seeds}")
    scratch = Path(tempfile.gettempdir()) / ("flashrl-bench-quick" if args.quick else "flashrl-bench-smoke")
    from _repo import FIGURES, RESULTS

    args.output = args.output or str((scratch if args.quick or smoke else RESULTS)
                                     / f"paired_comparison_{args.task}.json")
    args.figure = args.figure or str((scratch if args.quick or smoke else FIGURES)
                                     / f"paired_comparison_{args.task}.png")
    if smoke and Path(args.output).resolve().parent == Path(RESULTS).resolve():
        parser.error("--smoke-budget-s never writes beside the counted results: give an --output elsewhere")


def task_for(args: argparse.Namespace) -> WallTask:
    task = WALL_TASKS[args.task]
    if args.quick:
        return dataclasses.replace(task, **QUICK_WALL)
    if args.smoke_budget_s is not None:
        return dataclasses.replace(task, budget_s=args.smoke_budget_s, snapshot_every_s=args.smoke_budget_s / 3)
    return task


def wait_for_idle(max_load: float, wait_s: float, *, poll_s: float = 15.0,
                  load: Callable[[], tuple[float, float, float]] = os.getloadavg,
                  sleep: Callable[[float], None] = time.sleep) -> float:
    """Wait until the 1-minute load average is below `max_load`; returns it. Raises after `wait_s`."""
    waited = 0.0
    while True:
        now = load()[0]
        if now < max_load:
            return now
        if waited >= wait_s:
            raise SystemExit(f"the 1-minute load average is {now:.2f} after {waited:.0f} s of waiting, expected "
                             f"below {max_load} (--max-load): evidence-3's runs need otherwise idle cores. The run "
                             "log keeps every finished run: start again with --resume when the machine is idle")
        print(f"waiting for idle cores: load {now:.2f} >= {max_load}", flush=True)
        sleep(poll_s)
        waited += poll_s


def next_run(runs: Sequence[Mapping[str, Any]], task: WallTask, phase: str, seeds: Sequence[int],
             lrs: Mapping[str, float | None], arms: Sequence[str]) -> tuple[str, float | None, int, int] | None:
    """The next run to make, (arm, lr, seed, attempt), or None when the phase is done.

    Pilots: what the arms' grids still lack (a grid extends only once its pilots are in, so this is asked
    again after each run); counted: the registered schedule.
    """
    if phase == "pilot":
        pilots = [r for r in runs if r["phase"] == "pilot"]
        schedule = [(arm, lr, seed) for arm, lr, seed in pilot_todo(pilots, arms) if seed in seeds]
    else:
        schedule = [(arm, lr, seed) for arm, lr, seed in wall_schedule(task.arms, seeds, lrs) if arm in arms]
    todo = runs_to_do(runs, phase, schedule)
    return todo[0] if todo else None


def chosen_rates(runs: Sequence[Mapping[str, Any]], task: WallTask) -> dict[str, Any]:
    """Per arm: its pilot grid so far and the final choice (None while pilots remain)."""
    pilots = [r for r in runs if r["phase"] == "pilot"]
    out = {}
    for arm in task.arms:
        try:
            grid, choice = pilot_grid(pilots, arm)
            out[arm] = {"grid": grid, "choice": choice}
        except ValueError as error:
            out[arm] = {"grid": None, "choice": None, "stopped": str(error)}
    return out


def one_run(run_fn: Callable[[], dict[str, Any]], *, phase: str, arm: str, lr: float | None, seed: int,
            attempt: int, budget_s: float) -> dict[str, Any]:
    """One run's log line: its record and metrics, or, when it crashed, an invalid line with the cause."""
    key = {"phase": phase, "arm": arm, "lr": lr, "seed": seed, "attempt": attempt}
    try:
        record = run_fn()
    except Exception as error:  # noqa: BLE001 - an infrastructure failure: logged with its cause, run again
        return {**key, "valid": False, "invalid": [f"crash: {type(error).__name__}: {error}"],
                "traceback": traceback.format_exc(), "metrics": None}
    metrics = wall_metrics(record, budget_s) if record["valid"] else None
    return {**key, **record, "metrics": metrics}


SUMMARY_KEYS = ("area", "accuracy_at_budget", "initial_accuracy", "updates", "generated_per_s", "trained_per_s",
                "policy_lag_mean", "accepted_fraction_mean", "drift_mean", "tool_calls_initial", "tool_calls_final",
                "turns_final", "episode_s_mean", "episode_s_batch_max_mean")
"""Averaged over an arm's runs that have them (`episode_s_runs` counts those with episode durations)."""


def wall_arm_summary(runs: Sequence[Mapping[str, Any]], task: WallTask, *, sealed: bool) -> dict[str, Any]:
    """Per arm: its valid counted runs and the mean of each metric (sealed: the count and wall time only)."""
    out: dict[str, Any] = {}
    for arm in task.arms:
        mine = [r for r in runs if r["arm"] == arm]
        walls = [r["wall_s"] for r in mine]
        out[arm] = {"n": len(mine), "wall_s": sum(walls) / len(walls) if walls else None}
        if sealed:
            continue
        metrics = [r["metrics"] for r in mine]
        for key in SUMMARY_KEYS:
            values = [m[key] for m in metrics if m.get(key) is not None]
            out[arm][key] = sum(values) / len(values) if values else None
        drift_max = [m["drift_max"] for m in metrics if m.get("drift_max") is not None]
        out[arm]["drift_max"] = max(drift_max) if drift_max else None
        out[arm]["episode_s_runs"] = sum(m.get("episode_s_mean") is not None for m in metrics)
        reached = [m["time_to_target"] for m in metrics if m.get("time_to_target") is not None]
        out[arm]["reached_target"] = len(reached)
        out[arm]["time_to_target_mean"] = sum(reached) / len(reached) if reached else None
        busy = [m["busy_fraction"] for m in metrics if m.get("busy_fraction")]
        out[arm]["busy_fraction_mean"] = {core: sum(b[core] for b in busy) / len(busy) for core in busy[0]} if busy else None
    return out


def plot_wall(runs: Sequence[Mapping[str, Any]], task: WallTask, path: str, *, title: str) -> str:
    """Held-out accuracy and generated rollouts at each snapshot, against training wall time.

    Each run is a thin line, each arm's mean over its runs a thick one (every run has the same snapshot
    times, so the mean is taken at them).
    """
    from _figures import _pyplot, _save

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    colors = dict(zip(task.arms, ("tab:blue", "tab:orange", "tab:green"), strict=False))
    for ax, key, label in ((axes[0], "accuracy", "held-out accuracy" if task.job == "sums" else "held-out success"),
                           (axes[1], "generated", "generated rollouts so far")):
        for arm in task.arms:
            mine = [r for r in runs if r["arm"] == arm]
            for run in mine:
                ax.plot([s["t"] for s in run["snapshots"]], [s[key] for s in run["snapshots"]],
                        color=colors[arm], alpha=0.25, linewidth=0.8)
            if mine:
                times = [s["t"] for s in mine[0]["snapshots"]]
                means = [sum(r["snapshots"][k][key] for r in mine) / len(mine) for k in range(len(times))]
                ax.plot(times, means, color=colors[arm], linewidth=2.5, marker="o", markersize=3,
                        label=f"{arm} (mean of {len(mine)})")
        ax.set_xlabel("training wall time (s); snapshots evaluated after the run")
        ax.set_ylabel(label)
        ax.legend()
    return _save(plt, fig, path, title)


def render_wall_pilots(pilots: Mapping[str, Any], choices: Mapping[str, Any]) -> str:
    rows = [[arm, lr, " ".join(map(str, cell["seeds"])), " ".join(f"{a:.4f}" for a in cell["area"]),
             fmt(cell["area_mean"]),
             "chosen" if (choices.get(arm, {}).get("choice") or {}).get("lr") == float(lr) else ""]
            for arm, rates in pilots.items() for lr, cell in sorted(rates.items(), key=lambda kv: float(kv[0]))]
    return table(["pilot arm", "lr", "seeds", "area per seed", "mean", ""], rows)


def render_runs(runs: Sequence[Mapping[str, Any]]) -> str:
    """One line per run: its key, validity and the pinning read back (runner, learner) at the start."""
    rows = []
    for r in runs:
        start = ((r.get("pinning") or {}).get("start") or {})
        def cores(side: str, start: Mapping[str, Any] = start) -> str:
            proc = (start.get(side) or {}).get("process") or {}
            return ",".join(map(str, proc.get("cpus_allowed_list", []))) or "-"
        rows.append([r["phase"], r["arm"], f"{r['lr']:g}" if r["lr"] is not None else "job", str(r["seed"]),
                     str(r["attempt"]), "yes" if r.get("valid") else "NO", cores("runner"), cores("learner"),
                     fmt((r.get("metrics") or {}).get("area")), "; ".join(r.get("invalid", []))[:80]])
    return table(["phase", "arm", "lr", "seed", "try", "valid", "runner cpus", "learner cpus", "area", "invalid"], rows)


def _rates(args: argparse.Namespace, task: WallTask, phase: str, runs: Sequence[Mapping[str, Any]]
           ) -> dict[str, float | None]:
    """Each arm's learning rate for this phase: the pilots' choice (counted), the job's or --lr (part 2, a
    smoke, --quick); {} for the pilots (their rates come from the grids)."""
    if args.smoke_budget_s is not None or not task.tuned or (args.quick and phase == "counted"):
        return {arm: args.lr for arm in task.arms}
    if phase != "counted" or args.report_only:
        return {}
    choices = chosen_rates(runs, task)
    missing = [arm for arm in task.arms if choices[arm]["choice"] is None]
    if missing:
        raise SystemExit(f"--phase counted: the pilots have not chosen a rate for {missing} yet "
                         f"({ {a: choices[a] for a in missing} }); run --phase pilot --resume first")
    return {arm: choices[arm]["choice"]["lr"] for arm in task.arms}


@dataclasses.dataclass(frozen=True)
class WallAnalysis:
    """What the wall tasks reuse of `paired_comparison.py` (it imports this module, so they come as arguments)."""

    make_config: Callable[..., Any]
    """The task's job with an arm's fields, a rate and the held-out set."""
    compare: Callable[..., dict[str, Any]]
    """Paired differences of the primary metric per comparison, t-intervals, sign-flip p-values, Holm."""
    render: Callable[..., str]
    pilot_summary: Callable[..., dict[str, Any]]
    config_record: Callable[..., Any]
    previous_configs: Callable[[str], dict[str, Any]]


def run_wall(args: argparse.Namespace, argv: Sequence[str] | None, analysis: WallAnalysis) -> dict[str, Any]:
    """The wall tasks' main: run what the phase lacks (unless --report-only), then write the report."""
    from _configs import FULL, QUICK, benchmark_model
    from _wall_clock import pinned_ray, wall_run

    task = task_for(args)
    smoke = args.smoke_budget_s is not None
    pinning = Pinning()
    phase = "smoke" if smoke else (args.phase if task.tuned else "counted")
    scale = dataclasses.replace(QUICK if args.quick else FULL, eval_episodes=task.held_out)
    settings: dict[str, Any] = {"task": args.task, "scale": scale, "budget_s": task.budget_s,
                                "snapshot_times": list(task.snapshot_times), "held_out": task.held_out,
                                "pinning": dataclasses.asdict(pinning)}
    if task.job == "tool":
        from flashrl.learners.cpu_bfloat16 import native_bfloat16

        settings["dtype"] = args.dtype or ("bfloat16" if native_bfloat16() else "float32")
    log = RunLog(args.output, key_fields=KEY_FIELDS, settings=settings, resume=args.resume,
                 discard=args.discard_log or args.quick or smoke)
    arms = args.arms or list(task.arms)
    lrs = _rates(args, task, phase, log.runs())
    configs: dict[str, Any] = {}
    if not args.report_only:
        snapshot_dir = Path(tempfile.gettempdir()) / "flashrl-bench-snapshots"
        with pinned_ray(pinning, quick=args.quick), tempfile.TemporaryDirectory(prefix="flashrl-bench-") as tmp:
            model_path = benchmark_model(scale.model, tmp)
            while (todo := next_run(log.runs(), task, phase, args.seeds, lrs, arms)) is not None:
                arm, lr, seed, attempt = todo
                label = f"{phase} {arm} lr={lr if lr is not None else 'job'} seed {seed} try {attempt}"
                load = wait_for_idle(args.max_load, args.load_wait_s)
                config = analysis.make_config(task.job, scale, task, model_path=model_path, arm=arm, lr=lr,
                                              seed=seed, dtype=settings.get("dtype"))
                configs.setdefault(arm, analysis.config_record(config, model=scale.model, job=task.job))
                print(f"{label}: load {load:.2f}, lr {config.lr:g}, {task.budget_s:.0f} s", flush=True)

                def run(config: Any = config, label: str = label) -> dict[str, Any]:
                    return wall_run(config, budget_s=task.budget_s, snapshot_times=task.snapshot_times,
                                    pinning=pinning, label=label, snapshot_dir=snapshot_dir,
                                    keep_snapshots=args.keep_snapshots)

                line = one_run(run, phase=phase, arm=arm, lr=lr, seed=seed, attempt=attempt, budget_s=task.budget_s)
                log.add({**line, "effective_lr": config.lr})
                print(f"{label}: {'valid' if line['valid'] else 'INVALID: ' + '; '.join(line['invalid'])}", flush=True)
                if any(cause.startswith("crash:") for cause in line["invalid"]):
                    raise SystemExit(f"{label} crashed (logged with its traceback in {log.path}); fix the cause "
                                     "and start again with --resume (the key runs again from scratch)")
    # a report written from the log alone keeps the arms' configs of the report it rewrites
    configs = {**(analysis.previous_configs(args.output) if args.resume else {}), **configs}
    return write_wall_report(args, argv, task, log.runs(), settings, configs, analysis, phase=phase)


def _bfloat16_flags() -> list[str] | None:
    """The native-bfloat16 flags /proc/cpuinfo lists (None where it cannot be read)."""
    from flashrl.learners.cpu_bfloat16 import BF16_FLAGS

    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return sorted({flag for flag in BF16_FLAGS if f" {flag}" in text})


def write_wall_report(args: argparse.Namespace, argv: Sequence[str] | None, task: WallTask,
                      runs: list[dict[str, Any]], settings: Mapping[str, Any], configs: Mapping[str, Any],
                      analysis: WallAnalysis, *, phase: str) -> dict[str, Any]:
    """The report of every logged run: valid counted runs compared (unless sealed), every run listed."""
    smoke = args.smoke_budget_s is not None
    counted = [r for r in runs if r["phase"] == ("smoke" if smoke else "counted") and r.get("valid")]
    registered = args.seeds if (args.quick or smoke) else (WALL_COUNTED_SEEDS if task.tuned else tuple(range(3)))
    arms = args.arms or task.arms
    missing = {arm: sorted(set(registered) - {r["seed"] for r in counted if r["arm"] == arm}) for arm in arms}
    complete = not any(missing.values())
    sealed = bool(counted) and not complete and not args.final
    comparisons = None if sealed else analysis.compare(counted, task)
    summary = wall_arm_summary(counted, task, sealed=sealed)
    by_generated = None if sealed or not counted else area_over_generated(counted)
    for arm, cell in ({} if by_generated is None else summary).items():
        areas = [seed["area"][arm] for seed in by_generated.values() if seed["area"].get(arm) is not None]
        cell["area_over_generated_mean"] = sum(areas) / len(areas) if areas else None
    choices = chosen_rates(runs, task) if task.tuned else {arm: "the job's own rate (pre-registered)" for arm in arms}
    report = {
        "benchmark": "paired_comparison",
        "preregistration": PREREGISTRATION,
        "command": ["python", "benchmarks/paired_comparison.py", *(argv if argv is not None else sys.argv[1:])],
        "settings": {**settings, "quick": args.quick, "smoke": smoke, "phase": phase,
                     "learning_rates": WALL_LEARNING_RATES, "pilot_seeds": WALL_PILOT_SEEDS,
                     "counted_seeds": list(registered), "target": WALL_TARGET},
        "learning_rate_choice": choices,
        "pilots": analysis.pilot_summary([r for r in runs if r["phase"] == "pilot" and r.get("valid")],
                                         seeds=WALL_PILOT_SEEDS),
        "configs": dict(configs),
        "runs": runs,
        "invalid_runs": sum(not r.get("valid") for r in runs),
        "arms": summary,
        "comparisons": comparisons,
        "area_over_generated": by_generated,
        "seal": {"sealed": sealed, "missing_seeds": missing,
                 "unsealed_early": bool(counted) and not complete and args.final},
        "machine": machine(),
        "cpu_bfloat16_flags": _bfloat16_flags(),  # part 2's dtype follows them (clarification 9)
    }
    print()
    if report["pilots"]:
        print(render_wall_pilots(report["pilots"], choices if task.tuned else {}))
        print()
    if runs:
        print(render_runs(runs))
        print()
    print(analysis.render(summary, comparisons))
    print(f"wrote {write_json(args.output, report)}")
    if counted and not sealed:
        title = f"{args.task}: {len({r['seed'] for r in counted})} paired seed(s), {task.budget_s:.0f} s per run"
        print(f"wrote {plot_wall(counted, task, args.figure, title=title)}")
    return report
