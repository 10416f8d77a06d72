"""Does the agentic CPU job learn? Held-out success, turns and tool calls vs rollouts, over seeds.

The job is `tuned_examples/smollm2_python_tool_cpu.py` (imported, not copied): SmolLM2-135M-Instruct
on `flashrl/PythonTool-v0`, two-digit products, two replies an episode (a ```python call that the real
sandbox runs, then the answer), vLLM's CPU build sampling at the job's temperature. Each seed runs
`--updates` updates of B = 16 rollouts (the learner in the job's dtype unless `--dtype` says
otherwise); the 64 held-out products (never trained on) are played before training, every
`--eval-every` updates and after the last, sampled at the training temperature as the
job's own evaluation does. Recorded per evaluation: success, model turns, tool calls and turn-limit
endings per episode; per update: the batch's return, turns, tool calls, accepted fraction, drift, lag.

The issue's bar: held-out success up by at least `--target-gain` (0.15) within about 20 minutes on
2 cores, in every seed. The report says, per seed, the gain at the end and the best gain on the curve,
the first evaluation that reached the bar and the minutes of updates and evaluations up to it (the
engine start excluded), the minutes the whole run took, and whether the gain at the end meets the bar.

    python benchmarks/agentic_learning.py --seeds 0 1 2        # the full run: about 27 minutes a seed
    python benchmarks/agentic_learning.py --quick              # smoke: tiny random model, torch engine
    python benchmarks/agentic_learning.py --dtype float32 --updates 40 --eval-every 10 \
        --output benchmarks/results/agentic_learning_fp32.json --figure docs/figures/agentic_learning_fp32.png --resume
                                                               # the float32 learner's record (seed 0), resumed

Writes `benchmarks/results/agentic_learning.json` and `docs/figures/agentic_learning.png` (success,
turns and tool calls vs rollouts; mean over seeds and min..max); `--quick` writes under the system
temp folder unless `--output` / `--figure` say otherwise. `--resume` keeps the seeds already finished.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _configs import benchmark_model
from _figures import _pyplot, _save
from _ray_setup import connect_ray
from _repo import FIGURES, RESULTS, load_script
from _reports import config_record, fmt, machine, table, write_json
from _run_log import RunLog
from _stats import run_summary, spread
from _training import run_updates

NAME = "agentic_learning"
TOOL_JOB = Path("tuned_examples") / "smollm2_python_tool_cpu.py"
AGENT_JOB = Path("benchmarks") / "agent_tool_job.py"
JOBS = {
    "tool": (TOOL_JOB, None, NAME),
    "agent": (AGENT_JOB, "multiply", "agent_learning"),
    "agent_summarising": (AGENT_JOB, "summarising", "agent_learning_summarising"),
}
"""``--job``: the script, its ``--agent`` (None: the script has none) and the report's default name."""
FULL = {"model": "smollm2-135m-instruct", "engine": None, "batch_size": None, "updates": 20, "eval_every": 5,
        "eval_episodes": None}
"""The job as it ships (None: the job's own value)."""
QUICK = {"model": "tiny", "engine": "torch", "batch_size": 4, "updates": 2, "eval_every": 2, "eval_episodes": 4}
CURVE_KEYS = ("accuracy", "turns_mean", "tool_calls_mean")


def tool_job(name: str = "tool") -> Any:
    path = JOBS[name][0]
    return load_script(path, f"flashrl_bench_{path.stem}")


def job_args(name: str) -> Any:
    """The job's command line with its defaults (and ``--job``'s agent)."""
    from flashrl.recipes import recipe_parser

    job = tool_job(name)
    args = recipe_parser(job.PRESET).parse_args([])
    if JOBS[name][1] is not None:
        args.agent = JOBS[name][1]
    return args


def job_dtype(name: str = "tool") -> str:
    """The learner dtype the job ships with."""
    return str(tool_job(name).make_config(job_args(name)).dtype)


def make_config(scale: dict[str, Any], *, model_path: str, seed: int, job_name: str = "tool") -> Any:
    """The job's config at `scale`: evaluation driven by `run_updates`, no TensorBoard or console."""
    config = tool_job(job_name).make_config(job_args(job_name))
    changes: dict[str, Any] = {"model": model_path, "seed": seed, "evaluation_interval": None,
                               "tensorboard": False, "console_every": 0}
    if scale["engine"] is not None:
        changes["engine"] = scale["engine"]
    if scale["batch_size"] is not None:
        changes |= {"train_batch_size": scale["batch_size"], "episodes_in_flight_per_env_runner": scale["batch_size"]}
    if scale["eval_episodes"] is not None:
        changes["evaluation_num_episodes"] = scale["eval_episodes"]
    if scale.get("dtype") is not None:  # the learner's; a bfloat16 one sends its float32 masters to vLLM on CPU
        changes["dtype"] = scale["dtype"]
    config.update_from_dict(changes)
    return config


def minutes_so_far(run: dict[str, Any]) -> list[float]:
    """Per evaluation point: minutes of updates and evaluations up to and including it (no engine start)."""
    out = []
    for point in run["curve"]:
        updates = sum(r["iteration_s"] for r in run["updates"] if r["update"] <= point["update"])
        evaluations = sum(p["seconds"] for p in run["curve"] if p["update"] <= point["update"])
        out.append((updates + evaluations) / 60)
    return out


def seed_summary(run: dict[str, Any], target_gain: float) -> dict[str, Any]:
    """Gain at the end and at best, and when the curve first reached `target_gain` (update, minutes)."""
    curve = run["curve"]
    before, after = curve[0]["accuracy"], curve[-1]["accuracy"]
    best = max(p["accuracy"] for p in curve[1:]) if len(curve) > 1 else before
    minutes = minutes_so_far(run)
    first = next((i for i, p in enumerate(curve) if i > 0 and p["accuracy"] - before >= target_gain - 1e-12), None)
    return {
        "before": before,
        "after": after,
        "gain": after - before,
        "best_gain": best - before,
        "meets_target": after - before >= target_gain,
        "minutes": run["wall_s"] / 60,
        "minutes_by_evaluation": minutes,
        "target_reached_at_update": None if first is None else curve[first]["update"],
        "minutes_to_target": None if first is None else minutes[first],
        **run_summary(run),
    }


def mean_curve(runs: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Per evaluation point (same updates in every seed): mean and min..max of `key` over seeds."""
    points = []
    for i, point in enumerate(runs[0]["curve"]):
        s = spread(r["curve"][i][key] for r in runs if i < len(r["curve"]))
        points.append({"update": point["update"], "rollouts": point["rollouts"], **s})
    return points


def plot(curves: dict[str, list[dict[str, Any]]], path: str, *, title: str, target: float | None) -> str:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    labels = {"accuracy": "held-out success", "turns_mean": "model turns / episode",
              "tool_calls_mean": "tool calls / episode"}
    for ax, key in zip(axes, CURVE_KEYS, strict=True):
        points = [p for p in curves[key] if p["mean"] is not None]
        xs = [p["rollouts"] for p in points]
        ax.plot(xs, [p["mean"] for p in points], "o-")
        ax.fill_between(xs, [p["min"] for p in points], [p["max"] for p in points], alpha=0.2)
        if key == "accuracy" and target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"before + gain target ({target:.2f})")
            ax.legend()
        ax.set_xlabel("rollouts trained on")
        ax.set_ylabel(labels[key])
        ax.grid(alpha=0.3)
    return _save(plt, fig, path, title=title)


def render(runs: list[dict[str, Any]], target_gain: float) -> str:
    rows = []
    for run in runs:
        s = run["summary"]
        curve = " -> ".join(f"{p['accuracy']:.2f}" for p in run["curve"])
        rows.append([str(run["seed"]), curve, fmt(s["gain"], "+.3f"), fmt(s["best_gain"], "+.3f"),
                     "yes" if s["meets_target"] else "no", fmt(s["minutes_to_target"], ".1f"),
                     fmt(s["minutes"], ".1f"),
                     fmt(s["policy_lag_mean"], ".2f"), fmt(s["accepted_fraction_mean"], ".3f")])
    return table(["seed", "held-out success by evaluation", "gain", "best gain", f">= +{target_gain}",
                  f"minutes to +{target_gain}", "minutes", "lag", "accepted"], rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--quick", action="store_true", help="smoke: tiny random model, torch engine, 2 updates")
    parser.add_argument("--job", choices=tuple(JOBS), default="tool",
                        help="tool: the tool job; agent / agent_summarising: the same task as an openai-client agent")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--updates", type=int, default=None, help="updates per seed (default 20; quick 2)")
    parser.add_argument("--eval-every", type=int, default=None, help="default 5 (quick 2)")
    parser.add_argument("--target-gain", type=float, default=0.15)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="the learner's compute dtype (default: the job's, bfloat16)")
    parser.add_argument("--output", default=None)
    parser.add_argument("--figure", default=None)
    parser.add_argument("--resume", action="store_true", help="keep the seeds already in the run log")
    parser.add_argument("--discard-log", action="store_true", help="start over, deleting the run log")
    args = parser.parse_args(argv)
    quick_dir = Path(tempfile.gettempdir()) / "flashrl-bench-quick"
    args.output = args.output or str((quick_dir if args.quick else RESULTS) / f"{JOBS[args.job][2]}.json")
    args.figure = args.figure or str((quick_dir if args.quick else FIGURES) / f"{JOBS[args.job][2]}.png")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    scale = dict(QUICK if args.quick else FULL)
    for key in ("updates", "eval_every"):
        if getattr(args, key) is not None:
            scale[key] = getattr(args, key)
    scale["dtype"] = args.dtype or job_dtype(args.job)  # recorded either way: a report says which learner it measured
    log = RunLog(args.output, key_fields=("seed",), settings={"scale": scale}, resume=args.resume,
                 discard=args.discard_log or args.quick)
    connected = connect_ray()
    runs, config = [], None
    try:
        with tempfile.TemporaryDirectory(prefix="flashrl-bench-") as tmp:
            model_path = benchmark_model(scale["model"], tmp)
            for seed in args.seeds:
                config = make_config(scale, model_path=model_path, seed=seed, job_name=args.job)
                done = log.get(seed=seed)
                if done is not None:
                    print(f"seed {seed}: kept from {log.path}", flush=True)
                    runs.append({**done, "summary": seed_summary(done, args.target_gain)})  # this version's fields
                    continue
                run = run_updates(config, updates=scale["updates"], eval_every=scale["eval_every"], label=f"s{seed}")
                runs.append({"seed": seed, **run, "summary": seed_summary(run, args.target_gain)})
                log.add(runs[-1])
    finally:
        if connected:
            import ray

            ray.shutdown()
    curves = {key: mean_curve(runs, key) for key in CURVE_KEYS}
    gains = [r["summary"]["gain"] for r in runs]
    report = {
        "benchmark": NAME,
        "command": ["python", "benchmarks/agentic_learning.py", *(argv if argv is not None else sys.argv[1:])],
        "settings": {"quick": args.quick, "seeds": args.seeds, "target_gain": args.target_gain, "scale": scale,
                     "job": JOBS[args.job][0].as_posix(), "agent": JOBS[args.job][1]},
        "config": config_record(config, model=scale["model"], tasks_source=f"{TOOL_JOB.as_posix()}: products()"),
        "runs": runs,
        "summary": {
            "gain": spread(gains),
            "seeds_meeting_target": sum(r["summary"]["meets_target"] for r in runs),
            "num_seeds": len(runs),
            "curves": curves,
        },
        "machine": machine(),
    }
    print()
    print(render(runs, args.target_gain))
    print(f"wrote {write_json(args.output, report)}")
    before = curves["accuracy"][0]["mean"]
    task = "PythonTool products" if args.job == "tool" else f"products, {JOBS[args.job][1]} agent (openai client)"
    title = f"{scale['model']}: {task}, {len(runs)} seed(s) (B=16, T=0.7, {config.dtype} learner)"
    print(f"wrote {plot(curves, args.figure, title=title, target=before + args.target_gain)}")
    return report


if __name__ == "__main__":
    main()
