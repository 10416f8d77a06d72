"""The pre-registered, paired and tuned comparison of FlashREINFORCE and GRPO (benchmarks/paired_comparison.md).

Everything this script does is fixed by the pre-registration ("Evidence-2: a paired, tuned comparison
of FlashREINFORCE and GRPO" in benchmarks/paired_comparison.md, next to this file; the results are in
docs/benchmarks.md), which was committed before any counted
run: the arms, the budget in GENERATED rollouts, the learning-rate pilots, the seeds, the primary
metric and the paired test. Read it before changing a constant here.

Two tasks:

* `--task sums` (part 1): the CPU main job's sums with 256 held-out sums; arms `flash_async` (the main
  job), `flash_sync` (the same estimator, synchronous: `sync_group` with G = 1 and the batch-mean
  baseline) and `grpo` (the release's variant, 4 prompts x G = 4). `--phase pilot` runs every arm at
  every learning rate of {1e-6, 3e-6, 1e-5} on pilot seeds 100 and 101; `--phase counted` takes each
  arm's best rate from those pilots (they must be in the run log or the committed report) and runs the
  counted seeds 0..11, arms in a rotating order per seed.
* `--task tool` (part 2): the CPU tool job; arms `flash_async` and `grpo`, the job's learning rate,
  seeds 0, 1, 2, 320 generated rollouts; held-out success, tool calls and turns over training.

* `--task sums_wall` / `--task tool_wall` (evidence-3, "Evidence-3: asynchrony over wall time" in the same
  file): a wall-time budget per run (600 s / 1,500 s), the sampler pinned to CPU 0 and the learner to CPU 1
  (checked and recorded per run), policy snapshots evaluated after the run; the primary metric is the
  area under held-out accuracy over wall time. `--phase pilot` tunes each arm's rate on seeds 200 and 201
  (extending the grid past an edge choice), `--phase counted` runs seeds 0..11. The run itself is
  `_wall_clock.py`'s, the design `_wall_design.py`'s, the ordering and report `_wall_driver.py`'s.

Each run is appended to the run log the moment it ends (`--resume` continues a stopped benchmark);
the report (JSON, table, figure) is written from every run in the log. The stopping rule allows no
look at the differences before every arm has every registered seed, so until then the report is
sealed: it keeps the runs (a later sitting resumes from them) and their count and wall time per arm,
but no comparison, no per-arm mean of a metric and no figure. `--final` unseals a report whose seeds
are not all in: the rule's "the compute ended first", said so in the report.

    python benchmarks/paired_comparison.py --task sums --phase pilot --resume     # 18 runs, ~2.5 hours
    python benchmarks/paired_comparison.py --task sums --phase counted --resume   # 36 runs, ~5 hours
    python benchmarks/paired_comparison.py --task tool --resume                   # 6 runs, ~2.5 hours
    python benchmarks/paired_comparison.py --task sums --phase pilot --quick      # smoke: tiny model
    python benchmarks/paired_comparison.py --task sums --phase pilot --report-only   # the report of the runs logged so far
    python benchmarks/paired_comparison.py --task sums --phase counted --report-only --final   # unseal at fewer seeds
    python benchmarks/paired_comparison.py --task sums_wall --phase pilot --resume   # evidence-3: on idle cores only
    python benchmarks/paired_comparison.py --task sums_wall --phase counted --resume
    python benchmarks/paired_comparison.py --task tool_wall --resume
    python benchmarks/paired_comparison.py --task sums_wall --smoke-budget-s 45 --arms flash_async --seeds 0   # not counted

Writes `benchmarks/results/paired_comparison_<task>.json` and `docs/figures/paired_comparison_<task>.png`;
`--quick` writes under the system temp folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _configs import FULL, QUICK, Scale, arithmetic_config, benchmark_model, reference_fields
from _figures import _pyplot, _save
from _paired import accuracy_at, area_to_budget, first_reaching, holm, paired_difference
from _ray_setup import connect_ray
from _repo import FIGURES, RESULTS, main_job
from _reports import config_record, fmt, machine, table, write_json
from _run_log import RunLog
from _stats import run_summary
from _training import run_updates
from _wall_design import WALL_TASKS
from _wall_driver import WallAnalysis, run_wall
from _wall_driver import add_arguments as add_wall_arguments
from _wall_driver import check_arguments as check_wall_arguments

NAME = "paired_comparison"
LEARNING_RATES = (1e-6, 3e-6, 1e-5)
DEFAULT_LR = 3e-6
"""The main job's rate: a pilot tie goes to the rate nearer it."""
PILOT_SEEDS = (100, 101)
COUNTED_SEEDS = tuple(range(12))
TOOL_SEEDS = (0, 1, 2)
TARGET = 0.45
"""Held-out accuracy for the secondary 'rollouts to target' (as `learning_efficiency`)."""


@dataclasses.dataclass(frozen=True)
class Task:
    """One part of the pre-registration: its arms, budget and evaluation size at full and quick scale."""

    arms: tuple[str, ...]
    comparisons: tuple[tuple[str, str], ...]
    """(a, b) pairs reported as a - b; the first is the primary comparison."""
    budget: int
    """Generated rollouts per run."""
    held_out: int
    max_updates: int
    """Upper bound on updates (a run that reaches it before the budget is an error)."""
    eval_every: int


TASKS = {
    "sums": Task(
        arms=("flash_async", "flash_sync", "grpo"),
        comparisons=(("flash_async", "grpo"), ("flash_async", "flash_sync"), ("flash_sync", "grpo")),
        budget=480, held_out=256, max_updates=40, eval_every=5,
    ),
    "tool": Task(
        arms=("flash_async", "grpo"), comparisons=(("flash_async", "grpo"),),
        budget=320, held_out=64, max_updates=30, eval_every=5,
    ),
}
QUICK_TASK = {"budget": 16, "held_out": 8, "max_updates": 8, "eval_every": 1}
"""Smoke size (tiny random model, torch engine): the code path, not a measurement."""


def arm_fields(arm: str, *, max_new_tokens: int) -> dict[str, Any]:
    """Config fields an arm changes on its task's job (`flash_async` is the job itself)."""
    if arm == "flash_async":
        return {}
    if arm == "flash_sync":
        return {"rollout_mode": "sync_group", "group_size": 1, "baseline": "batch_mean"}
    if arm == "grpo":
        return reference_fields("grpo", max_new_tokens=max_new_tokens)
    raise ValueError(f"unknown arm {arm!r}: expected flash_async, flash_sync or grpo")


def best_learning_rate(pilot_runs: Sequence[Mapping[str, Any]], arm: str) -> dict[str, Any]:
    """The arm's rate with the highest mean primary metric over its pilot seeds (ties: nearer 3e-6).

    Every rate must have every pilot seed: a choice from a partial pilot is refused.
    """
    means = {}
    for lr in LEARNING_RATES:
        areas = [r["metrics"]["area"] for r in pilot_runs if r["arm"] == arm and r["lr"] == lr]
        if len(areas) != len(PILOT_SEEDS):
            raise ValueError(
                f"{arm}: expected {len(PILOT_SEEDS)} pilot runs at lr {lr:g}, found {len(areas)}. "
                "Fix: run --phase pilot (with --resume) first"
            )
        means[lr] = sum(areas) / len(areas)
    best = max(means.values())
    tied = [lr for lr, m in means.items() if round(m, 3) == round(best, 3)]
    chosen = min(tied, key=lambda lr: abs(lr - DEFAULT_LR))
    return {"lr": chosen, "pilot_area_mean": {f"{lr:g}": m for lr, m in means.items()}}


def pilot_summary(pilot_runs: Sequence[Mapping[str, Any]], seeds: Sequence[int] = PILOT_SEEDS) -> dict[str, Any]:
    """Per arm and rate: the pilot seeds run so far, their primary metric and its mean (a partial pilot shows);
    `complete` when the rate has every one of `seeds`."""
    out: dict[str, Any] = {}
    for run in sorted(pilot_runs, key=lambda r: (r["arm"], r["lr"], r["seed"])):
        cell = out.setdefault(run["arm"], {}).setdefault(f"{run['lr']:g}", {"seeds": [], "area": []})
        cell["seeds"].append(run["seed"])
        cell["area"].append(run["metrics"]["area"])
    for rates in out.values():
        for cell in rates.values():
            cell["area_mean"] = sum(cell["area"]) / len(cell["area"])
            cell["complete"] = sorted(cell["seeds"]) == sorted(seeds)
    return out


def run_metrics(run: Mapping[str, Any], budget: int) -> dict[str, Any]:
    """The primary metric and the secondary ones of one finished run."""
    curve = run["curve"]
    summary = run_summary(run)
    return {
        "area": area_to_budget(curve, budget),
        "accuracy_at_budget": accuracy_at(curve, budget),
        "generated_to_target": first_reaching(curve, TARGET),
        "initial_accuracy": curve[0]["accuracy"],
        "tool_calls_initial": curve[0].get("tool_calls_mean"),
        "tool_calls_final": curve[-1].get("tool_calls_mean"),
        "turns_final": curve[-1].get("turns_mean"),
        "trained_over_generated": summary["rollouts_trained"] / summary["rollouts_sampled"]
        if summary["rollouts_sampled"] else None,
        "policy_lag_mean": summary["policy_lag_mean"],
        "accepted_fraction_mean": summary["accepted_fraction_mean"],
        "drift_mean": summary["drift_mean"],
        "drift_max": summary["drift_max"],
        "wall_s": run["wall_s"],
        "iteration_s_mean": summary["iteration_s_mean"],
    }


def compare(runs: Sequence[Mapping[str, Any]], task: Task) -> dict[str, Any]:
    """Per comparison: the per-seed differences of the primary metric on the seeds both arms have."""
    by_arm = {arm: {r["seed"]: r["metrics"] for r in runs if r["arm"] == arm} for arm in task.arms}
    out: dict[str, Any] = {}
    for a, b in task.comparisons:
        seeds = sorted(set(by_arm[a]) & set(by_arm[b]))
        differences = [by_arm[a][s]["area"] - by_arm[b][s]["area"] for s in seeds]
        final = [by_arm[a][s]["accuracy_at_budget"] - by_arm[b][s]["accuracy_at_budget"] for s in seeds]
        out[f"{a} - {b}"] = {
            "seeds": seeds,
            "area_differences": differences,
            "area": paired_difference(differences) if seeds else None,
            "accuracy_at_budget": paired_difference(final) if seeds else None,
        }
    p_values = {k: v["area"]["p_value"] for k, v in out.items() if v["area"] and v["area"]["p_value"] is not None}
    for name, adjusted in holm(p_values).items():
        out[name]["area"]["p_value_holm"] = adjusted
    return out


def missing_seeds(runs: Sequence[Mapping[str, Any]], task: Task, seeds: Sequence[int]) -> dict[str, list[int]]:
    """Per arm: the registered seeds it has no counted run of yet (empty lists: the comparison is complete)."""
    return {arm: sorted(set(seeds) - {r["seed"] for r in runs if r["arm"] == arm}) for arm in task.arms}


def arm_summary(runs: Sequence[Mapping[str, Any]], task: Task, *, sealed: bool = False) -> dict[str, Any]:
    """Per arm: its seeds and the mean of each metric over them (sealed: the count and wall time only)."""
    out = {}
    for arm in task.arms:
        mine = [r["metrics"] for r in runs if r["arm"] == arm]
        out[arm] = {"n": len(mine)}
        if sealed:
            walls = [m["wall_s"] for m in mine]
            out[arm]["wall_s"] = sum(walls) / len(walls) if walls else None
            continue
        for key in ("area", "accuracy_at_budget", "initial_accuracy", "tool_calls_initial", "tool_calls_final",
                    "turns_final", "trained_over_generated", "policy_lag_mean", "accepted_fraction_mean",
                    "drift_mean", "wall_s", "iteration_s_mean"):
            values = [m[key] for m in mine if m.get(key) is not None]
            out[arm][key] = sum(values) / len(values) if values else None
        drift_max = [m["drift_max"] for m in mine if m.get("drift_max") is not None]
        out[arm]["drift_max"] = max(drift_max) if drift_max else None  # the largest over every run
        # rollouts to first reach TARGET: how many runs did, and their mean (a run that never did has none)
        reached = [m["generated_to_target"] for m in mine if m.get("generated_to_target") is not None]
        out[arm]["reached_target"] = len(reached)
        out[arm]["generated_to_target_mean"] = sum(reached) / len(reached) if reached else None
    return out


def render(arms: Mapping[str, Any], comparisons: Mapping[str, Any] | None) -> str:
    rows = [[arm, str(s["n"]), fmt(s.get("area")), fmt(s.get("accuracy_at_budget")),
             fmt(s.get("tool_calls_final"), ".2f"), fmt(s["wall_s"], ".0f")] for arm, s in arms.items()]
    lines = [table(["arm", "seeds", "area (mean acc over budget)", "acc at budget", "tool calls (end)",
                    "wall s/run"], rows), ""]
    if comparisons is None:
        lines.append("sealed: no comparison until every arm has every registered seed (--final unseals)")
        return "\n".join(lines)
    for name, c in comparisons.items():
        area = c["area"]
        if area is None or area["interval"] is None:
            lines.append(f"{name}: {len(c['seeds'])} paired seed(s), no interval yet")
            continue
        lo, hi = area["interval"]
        lines.append(f"{name}: area difference {area['mean']:+.4f} (95% CI {lo:+.4f}..{hi:+.4f}), "
                     f"sign-flip p = {area['p_value']:.4f}, Holm p = {area.get('p_value_holm', float('nan')):.4f}, "
                     f"n = {area['n']}")
    return "\n".join(lines)


def render_pilots(pilots: Mapping[str, Any]) -> str:
    rows = [[arm, lr, " ".join(map(str, cell["seeds"])), " ".join(f"{a:.4f}" for a in cell["area"]),
             fmt(cell["area_mean"]), "yes" if cell["complete"] else "no"]
            for arm, rates in pilots.items() for lr, cell in rates.items()]
    return table(["pilot arm", "lr", "seeds", "area per seed", "mean", "complete"], rows)


def plot(runs: Sequence[Mapping[str, Any]], task: Task, path: str, *, title: str) -> str:
    """Held-out accuracy (and, for the tool task, tool calls and turns) vs generated rollouts.

    Each run is a thin line; each arm's mean over its runs a thick one, the runs' curves interpolated
    linearly at 61 points of [0, budget] (the asynchronous arm evaluates at its own generated counts).
    """
    import numpy as np

    plt = _pyplot()
    agentic = any(p.get("tool_calls_mean") is not None for r in runs for p in r["curve"])
    keys = ["accuracy"] + (["tool_calls_mean", "turns_mean"] if agentic else [])
    labels = {"accuracy": "held-out success" if agentic else "held-out accuracy",
              "tool_calls_mean": "tool calls per held-out episode", "turns_mean": "model turns per held-out episode"}
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
    colors = dict(zip(task.arms, ("tab:blue", "tab:orange", "tab:green"), strict=False))
    grid = np.linspace(0.0, task.budget, 61)  # [61]
    for ax, key in zip(axes[0], keys, strict=True):
        for arm in task.arms:
            curves = []
            for run in (r for r in runs if r["arm"] == arm):
                xs, ys = zip(*[(p["generated"], p[key]) for p in run["curve"] if p.get(key) is not None], strict=True)
                ax.plot(xs, ys, color=colors[arm], alpha=0.25, linewidth=0.8)
                curves.append(np.interp(grid, xs, ys))  # [61]
            if curves:
                ax.plot(grid, np.mean(curves, axis=0), color=colors[arm], linewidth=2.5,
                        label=f"{arm} (mean of {len(curves)})")
        ax.axvline(task.budget, color="grey", linestyle=":")
        ax.set_xlabel("generated rollouts")
        ax.set_ylabel(labels[key])
        ax.legend()
    return _save(plt, fig, path, title)


def _choice_so_far(pilots: Sequence[Mapping[str, Any]], arm: str) -> dict[str, Any]:
    try:
        return best_learning_rate(pilots, arm)
    except ValueError as error:
        return {"lr": None, "pilot_incomplete": str(error)}


def make_config(task_name: str, scale: Scale, task: Task, *, model_path: str, arm: str, lr: float | None,
                seed: int, dtype: str | None = None) -> Any:
    """The task's job at `scale` with the arm's fields, the learning rate and the held-out set.

    `dtype` (tool task only): the learner's, instead of the job's (None: the job's).
    """
    if task_name == "sums":
        config = arithmetic_config(scale, model_path=model_path, seed=seed)
        train, held_out = main_job().easy_sums(num_held_out=task.held_out)
        config.update_from_dict({
            "env_config": {**config.env_config, "tasks": train},
            "evaluation_env_config": {**config.evaluation_env_config, "tasks": held_out},
            "evaluation_num_episodes": task.held_out,
        })
    else:
        import agentic_learning

        tool_scale = dict(agentic_learning.QUICK if scale.model == "tiny" else agentic_learning.FULL)
        tool_scale["eval_episodes"] = task.held_out
        tool_scale["dtype"] = dtype
        config = agentic_learning.make_config(tool_scale, model_path=model_path, seed=seed)
    fields = arm_fields(arm, max_new_tokens=config.max_new_tokens)
    if lr is not None:
        fields["lr"] = lr
    config.update_from_dict(fields)
    per_prompt = config.group_size if config.rollout_mode == "sync_group" else 1
    if config.prompts_per_batch * per_prompt != config.train_batch_size:
        raise ValueError(f"{arm}: expected {config.train_batch_size} rollouts per update, got "
                         f"{config.prompts_per_batch} prompts x {per_prompt}")
    return config


def schedule(task_name: str, phase: str, task: Task, seeds: Sequence[int], lrs: Mapping[str, float | None]
             ) -> list[tuple[str, float | None, int]]:
    """(arm, lr, seed) in the pre-registered order: seed by seed, arms rotated (seed s starts at arm s mod n)."""
    out = []
    for seed in seeds:
        start = seed % len(task.arms)
        arms = task.arms[start:] + task.arms[:start]
        for arm in arms:
            rates = LEARNING_RATES if phase == "pilot" else (lrs[arm],)
            out += [(arm, lr, seed) for lr in rates]
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--task", choices=(*TASKS, *WALL_TASKS), required=True,
                        help="sums, tool: evidence-2 (budget in generated rollouts); sums_wall, tool_wall: "
                             "evidence-3 (a wall-time budget, the sampler and the learner on their own cores)")
    parser.add_argument("--phase", choices=("pilot", "counted"), default="counted",
                        help="sums only: the learning-rate pilots, or the counted seeds (the tool task has no pilot)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="a subset of the pre-registered seeds (default: all of the phase)")
    parser.add_argument("--quick", action="store_true", help="smoke: tiny random model, torch engine")
    parser.add_argument("--output", default=None)
    parser.add_argument("--figure", default=None)
    parser.add_argument("--resume", action="store_true", help="keep the runs already in the run log")
    parser.add_argument("--discard-log", action="store_true", help="start over, deleting the run log")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="tool task: the learner's dtype instead of the job's (a CPU without native bfloat16 "
                             "needs float32: docs/benchmarks.md, part 2's amendment); recorded in the settings")
    parser.add_argument("--final", action="store_true",
                        help="unseal the report although some registered seeds have no run (the stopping rule's "
                             "'the compute ended first'); the report records which seeds are missing")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: write the report (JSON, figure) from the runs logged so far (implies --resume)")
    add_wall_arguments(parser)
    args = parser.parse_args(argv)
    if args.report_only and (args.quick or args.discard_log):
        parser.error("--report-only reads the run log: it cannot be combined with --quick or --discard-log")
    args.resume = args.resume or args.report_only
    if args.task in WALL_TASKS:
        check_wall_arguments(parser, args)
        return args
    if args.smoke_budget_s is not None or args.arms or args.lr is not None:
        parser.error("--smoke-budget-s, --arms and --lr apply to the wall tasks (sums_wall, tool_wall) only")
    if args.dtype is not None and args.task != "tool":
        parser.error(f"--dtype applies to --task tool only (the sums job's learner is float32), got --task {args.task}")
    if args.task == "tool" and args.phase == "pilot":
        parser.error("--task tool has no pilot phase (the pre-registration gives both arms the job's rate)")
    allowed = TOOL_SEEDS if args.task == "tool" else (PILOT_SEEDS if args.phase == "pilot" else COUNTED_SEEDS)
    args.seeds = args.seeds or list(allowed)
    if not args.quick and not set(args.seeds) <= set(allowed) and args.task == "sums":
        parser.error(f"--seeds: expected a subset of the pre-registered {list(allowed)}, got {args.seeds}")
    quick_dir = Path(tempfile.gettempdir()) / "flashrl-bench-quick"
    stem = f"{NAME}_{args.task}"
    args.output = args.output or str((quick_dir if args.quick else RESULTS) / f"{stem}.json")
    args.figure = args.figure or str((quick_dir if args.quick else FIGURES) / f"{stem}.png")
    return args


def previous_configs(path: str) -> dict[str, Any]:
    """The ``configs`` of the report at ``path`` ({} when there is none, or it cannot be read)."""
    try:
        with open(path) as f:
            configs = json.load(f).get("configs")
    except (OSError, ValueError, AttributeError):
        return {}
    return configs if isinstance(configs, dict) else {}


def task_config_record(config: Any, *, model: str, job: str) -> dict[str, Any]:
    """`config_record`, its task lists named after the job they come from (the tool job's products)."""
    import agentic_learning

    source = f"{agentic_learning.TOOL_JOB.as_posix()}: products()" if job == "tool" else None
    return config_record(config, model=model, tasks_source=source)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.task in WALL_TASKS:
        return run_wall(args, argv, WallAnalysis(make_config=make_config, compare=compare, render=render,
                                                 pilot_summary=pilot_summary, config_record=task_config_record,
                                                 previous_configs=previous_configs))
    task = TASKS[args.task]
    if args.quick:
        task = dataclasses.replace(task, **QUICK_TASK)
    scale = dataclasses.replace(QUICK if args.quick else FULL, eval_every=task.eval_every,
                                eval_episodes=task.held_out)
    settings: dict[str, Any] = {"task": args.task, "scale": scale, "budget": task.budget}
    if args.dtype is not None:
        settings["dtype"] = args.dtype
    log = RunLog(args.output, key_fields=("phase", "arm", "lr", "seed"), settings=settings, resume=args.resume,
                 discard=args.discard_log or args.quick)
    pilots = [r for r in log.runs() if r["phase"] == "pilot"]
    if args.task == "tool":
        lrs: dict[str, Any] = {arm: None for arm in task.arms}
        choice: dict[str, Any] = {arm: "the tool job's own rate (not tuned: pre-registered)" for arm in task.arms}
    elif args.phase == "counted" and args.quick and not pilots:  # a smoke run of the counted path
        lrs = {arm: DEFAULT_LR for arm in task.arms}
        choice = {arm: "quick smoke run: the main job's rate, no pilot" for arm in task.arms}
    elif args.phase == "counted" and args.report_only:  # the counted runs carry their rate; a partial pilot is shown
        lrs = {}
        choice = {arm: _choice_so_far(pilots, arm) for arm in task.arms}
    elif args.phase == "counted":
        choice = {arm: best_learning_rate(pilots, arm) for arm in task.arms}
        lrs = {arm: c["lr"] for arm, c in choice.items()}
    else:
        lrs, choice = {}, {}
    phase = "counted" if args.task == "tool" else args.phase
    todo = [] if args.report_only else schedule(args.task, phase, task, args.seeds, lrs)
    connected = connect_ray() if todo else False
    configs: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="flashrl-bench-") as tmp:
            model_path = benchmark_model(scale.model, tmp) if todo else ""
            for arm, lr, seed in todo:
                label = f"{phase} {arm} lr={lr if lr is not None else 'job'} seed {seed}"
                if log.get(phase=phase, arm=arm, lr=lr, seed=seed) is not None:
                    print(f"{label}: kept from {log.path}", flush=True)
                    continue
                config = make_config(args.task, scale, task, model_path=model_path, arm=arm, lr=lr, seed=seed,
                                     dtype=args.dtype)
                configs.setdefault(arm, task_config_record(config, model=scale.model, job=args.task))
                print(f"{label}: {config.prompts_per_batch} prompts per update, lr {config.lr:g}", flush=True)
                run = run_updates(config, updates=task.max_updates, eval_every=task.eval_every, label=label,
                                  until_generated=task.budget)
                record = {"phase": phase, "arm": arm, "lr": lr, "seed": seed, "effective_lr": config.lr, **run}
                log.add({**record, "metrics": run_metrics(run, task.budget)})
    finally:
        if connected:
            import ray

            ray.shutdown()
    # The arms' configs are recorded when a run is made; a report written from the log alone (--report-only,
    # or a --resume with nothing left to run for an arm) keeps those of the report it rewrites.
    configs = {**(previous_configs(args.output) if args.resume else {}), **configs}
    runs = log.runs()
    pilots = [r for r in runs if r["phase"] == "pilot"]  # with the runs this call made
    counted = [r for r in runs if r["phase"] == "counted"]
    registered = args.seeds if args.quick else (TOOL_SEEDS if args.task == "tool" else COUNTED_SEEDS)
    missing = missing_seeds(counted, task, registered)
    complete = not any(missing.values())
    sealed = bool(counted) and not complete and not args.final
    comparisons = None if sealed else compare(counted, task)
    arms = arm_summary(counted, task, sealed=sealed)
    report = {
        "benchmark": NAME,
        "preregistration": "benchmarks/paired_comparison.md#evidence-2-a-paired-tuned-comparison-of-flashreinforce-and-grpo",
        "command": ["python", "benchmarks/paired_comparison.py", *(argv if argv is not None else sys.argv[1:])],
        "settings": {**settings, "quick": args.quick,
                     "held_out": task.held_out, "learning_rates": LEARNING_RATES, "pilot_seeds": PILOT_SEEDS,
                     "counted_seeds": TOOL_SEEDS if args.task == "tool" else COUNTED_SEEDS},
        "learning_rate_choice": choice,
        "pilots": pilot_summary(pilots),
        "configs": configs,
        "runs": runs,
        "arms": arms,
        "comparisons": comparisons,
        "seal": {"sealed": sealed, "missing_seeds": missing,
                 "unsealed_early": bool(counted) and not complete and args.final},
        "machine": machine(),
    }
    print()
    if report["pilots"]:
        print(render_pilots(report["pilots"]))
        print()
    print(render(arms, comparisons))
    print(f"wrote {write_json(args.output, report)}")
    if counted and not sealed:
        title = f"{scale.model}: {args.task}, {len({r['seed'] for r in counted})} paired seed(s)"
        print(f"wrote {plot(counted, task, args.figure, title=title)}")
    return report


if __name__ == "__main__":
    main()
