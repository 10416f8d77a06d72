"""The laptop record of LoRA: the CPU main job with a rank-16 adapter against full training, same seeds and budget.

The task is the CPU main job's (`tuned_examples/smollm2_arithmetic_cpu.py`, imported, not copied):
SmolLM2-135M-Instruct learning easy sums on vLLM's CPU build, B = 16 rollouts per update. Two arms:

* `full`: the main job as it is (every weight trains, lr 3e-6);
* `lora`: the same job with `lora_rank=16, lora_alpha=32` (peft on every linear layer, the `lora`
  push) at `--lora-lr` (LoRA usually wants a larger rate than full training: choose it on pilot seeds
  with `--arms lora --lora-lr ...` before the record).

For every arm and seed: held-out greedy accuracy (64 sums) before training, every `--eval-every`
updates and after the last; seconds per update; the push's seconds per update
(`timers/weight_sync_s`) and bytes (what the route sends: every weight, or the adapter's tensors, in
the dtype the learner sends them); and the learner's memory: each run is its own process, and the
main job's learner runs in that process (`num_learners=0`), so the process's peak RSS is the
learner's plus the driver's (the engine runs in a Ray actor, another process). Runs alternate between
the arms seed by seed, each is saved as it ends (`--resume` skips the finished ones).

    python benchmarks/lora_learning.py --seeds 0 1 2 --resume   # the record: 2 arms x 3 seeds, 60 updates
    python benchmarks/lora_learning.py --quick                  # smoke: tiny random model, 1 update, seed 0
    python benchmarks/lora_learning.py --figure benchmarks/results/lora_learning.json \
        benchmarks/results/lora_learning_lr1e-4.json            # the curves of these reports, one PNG

Writes `benchmarks/results/lora_learning.json`; `--quick` writes under the system temp folder unless
`--output` says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _configs import FULL, QUICK, Scale, arithmetic_config, benchmark_model
from _ray_setup import connect_ray
from _repo import MAIN_JOB, RESULTS, main_job
from _reports import config_record, fmt_spread, machine, table, write_json
from _run_log import RunLog
from _stats import mean_of, ratio, run_summary, spread
from _training import run_updates

NAME = "lora_learning"
ARMS = ("full", "lora")
LORA_RANK, LORA_ALPHA = 16, 32.0
DEFAULT_LORA_LR = 3e-5
"""10x the main job's rate: a starting point for the pilot seeds, not a chosen value."""


def arm_overrides(arm: str, lora_lr: float) -> dict[str, Any]:
    """Config fields an arm changes on the main job (`full` is the main job itself)."""
    return {} if arm == "full" else {"lora_rank": LORA_RANK, "lora_alpha": LORA_ALPHA, "lr": lora_lr}


def push_bytes(config: Any) -> int:
    """Bytes one push sends: the learner's weights, or with LoRA its adapter, in the dtype it sends them.

    The model is built on the meta device (no weights read); a tied head counts once, as it is sent once.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from flashrl.learners.weight_gather import weight_manifest
    from flashrl.models.lora import apply_lora, is_adapter_name
    from flashrl.weight_sync.shm import bucket_file_bytes

    spec = config.learner_spec()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec.model), dtype=spec.torch_dtype)
    if spec.lora is None:
        manifest = weight_manifest(model, dtype=spec.sync_torch_dtype)
    else:  # the adapter is float32 (peft's) unless weight_sync_dtype says otherwise, as the learner sends it
        apply_lora(model, spec.lora)
        dtype = None if spec.weight_sync_dtype is None else spec.sync_torch_dtype
        manifest = weight_manifest(model, dtype=dtype, select=is_adapter_name)
    return sum(bucket_file_bytes(bucket) for bucket in manifest)


def run_one(args: argparse.Namespace, arm: str, seed: int, out: str) -> None:
    """One arm and seed in this process (the child of `main`): its run, memory and push written to `out`."""
    scale = scale_of(args)
    connected = connect_ray()
    try:
        with tempfile.TemporaryDirectory(prefix="flashrl-bench-") as tmp:
            config = arithmetic_config(scale, model_path=benchmark_model(scale.model, tmp), seed=seed,
                                       overrides=arm_overrides(arm, args.lora_lr))
            run = run_updates(config, updates=scale.updates, eval_every=scale.eval_every, label=f"{arm}/s{seed}")
            pushed = push_bytes(config)
    finally:
        if connected:
            import ray

            ray.shutdown()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    record = {"arm": arm, "seed": seed, **run, "summary": run_summary(run),
              "process_peak_rss_mib": peak_kib / 1024, "push_bytes": pushed,
              "weight_sync_s_mean": mean_of(run["updates"], "weight_sync_s")}  # fmt: skip
    Path(out).write_text(json.dumps(record, default=str), encoding="utf-8")


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        if not mine:
            continue
        out[arm] = {
            "seeds": [r["seed"] for r in mine],
            "initial_accuracy": spread(r["summary"]["initial_accuracy"] for r in mine),
            "final_accuracy": spread(r["summary"]["final_accuracy"] for r in mine),
            "iteration_s": spread(r["summary"]["iteration_s_mean"] for r in mine),
            "weight_sync_s": spread(r["weight_sync_s_mean"] for r in mine),
            "push_bytes": spread(r["push_bytes"] for r in mine),
            "process_peak_rss_mib": spread(r["process_peak_rss_mib"] for r in mine),
            "accepted_fraction": spread(r["summary"]["accepted_fraction_mean"] for r in mine),
        }
    return out


def ratios(summary: dict[str, Any]) -> dict[str, float | None]:
    """LoRA over full for each measured quantity (means over seeds)."""
    if set(ARMS) - set(summary):
        return {}
    lora, full = summary["lora"], summary["full"]
    keys = ("final_accuracy", "iteration_s", "weight_sync_s", "push_bytes", "process_peak_rss_mib")
    return {f"{k}_lora_over_full": ratio(lora[k]["mean"], full[k]["mean"]) for k in keys}


def render(summary: dict[str, Any]) -> str:
    headers = ["arm", "initial acc", "final acc (min..max)", "s/update", "push s/update", "push MiB",
               "peak RSS MiB"]  # fmt: skip
    rows = [[arm, fmt_spread(s["initial_accuracy"]), fmt_spread(s["final_accuracy"]),
             fmt_spread(s["iteration_s"], ".1f"), fmt_spread(s["weight_sync_s"], ".3f"),
             f"{s['push_bytes']['mean'] / 2**20:.2f}", fmt_spread(s["process_peak_rss_mib"], ".0f")]
            for arm, s in summary.items()]  # fmt: skip
    return table(headers, rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--quick", action="store_true", help="smoke size: tiny random model, B=4, 1 update")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (quick: 0)")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="default: both")
    parser.add_argument("--lora-lr", type=float, default=DEFAULT_LORA_LR, help="the lora arm's learning rate")
    parser.add_argument("--updates", type=int, default=None, help="default: the main job's 60 (quick: 1)")
    parser.add_argument("--eval-every", type=int, default=None, help="default 10 (quick: 1)")
    parser.add_argument("--output", default=None, help="JSON report path")
    parser.add_argument(
        "--resume", action="store_true", help="keep the finished runs in <output>.runs.tmp, run the rest"
    )
    parser.add_argument(
        "--discard-log", action="store_true",
        help="without --resume: delete the finished runs of <output>.runs.tmp and start over (else refused)",
    )
    parser.add_argument("--figure", nargs="+", metavar="REPORT", default=None,
                        help="plot held-out accuracy of these reports' runs (per arm and rate) to --figure-path")
    parser.add_argument("--figure-path", default="docs/figures/lora_learning.png", help="the PNG --figure writes")
    parser.add_argument("--child", nargs=3, metavar=("ARM", "SEED", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick_dir = Path(tempfile.gettempdir()) / "flashrl-bench-quick"
    args.seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    args.output = args.output or str((quick_dir if args.quick else RESULTS) / f"{NAME}.json")
    return args


def scale_of(args: argparse.Namespace) -> Scale:
    if args.quick:
        return dataclasses.replace(QUICK, updates=args.updates or 1, eval_every=args.eval_every or 1)
    return dataclasses.replace(FULL, updates=args.updates or main_job().PRESET.stop_iters,
                               eval_every=args.eval_every or 10)


def figure_curves(reports: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per arm and rate (``full 3e-06``, ``lora 0.0001``): held-out accuracy at each evaluated update, the mean
    over the runs' seeds with its min..max (``plot_curves``' points; x is rollouts trained on)."""
    grouped: dict[str, dict[int, list[float]]] = {}
    for report in reports:
        for arm, spec in report["arms"].items():
            rate = spec["config"].get("lr") if isinstance(spec.get("config"), dict) else None
            label = f"{'LoRA r16' if arm == 'lora' else 'full'} lr {rate:g}" if rate is not None else arm
            for run in (r for r in report["runs"] if r["arm"] == arm):
                for point in run["curve"]:
                    grouped.setdefault(label, {}).setdefault(int(point["rollouts"]), []).append(point["accuracy"])
    return {label: [{"rollouts": x, "mean": sum(v) / len(v), "min": min(v), "max": max(v)}
                    for x, v in sorted(points.items())] for label, points in grouped.items()}


def write_figure(paths: list[str], out: str) -> str:
    from _figures import plot_curves

    reports = [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]
    seeds = sorted({r["seed"] for report in reports for r in report["runs"]})
    return plot_curves(figure_curves(reports), out,
                       title=f"SmolLM2-135M sums, CPU: LoRA vs full (seeds {', '.join(map(str, seeds))}; min..max)")


def child_argv(argv: list[str], arm: str, seed: int, out: str) -> list[str]:
    """This script with the same flags, running one arm and seed (`run_one`) in a fresh process."""
    return [sys.executable, os.path.abspath(__file__), *argv, "--child", arm, str(seed), out]


def run_child(argv: list[str], arm: str, seed: int, log: RunLog) -> dict[str, Any]:
    """One arm and seed in a fresh process (its peak RSS is that run's alone), saved to the run log."""
    print(f"{arm}, seed {seed}: running (finished runs are in {log.path})", flush=True)
    with tempfile.TemporaryDirectory(prefix="flashrl-bench-") as tmp:
        out = os.path.join(tmp, "run.json")
        subprocess.run(child_argv(argv, arm, seed, out), check=True)
        run = json.loads(Path(out).read_text(encoding="utf-8"))
    log.add(run)
    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        arm, seed, out = args.child
        run_one(args, arm, int(seed), out)
        return {}
    if args.figure:
        print(f"wrote {write_figure(args.figure, args.figure_path)}")
        return {}
    scale = scale_of(args)
    log = RunLog(args.output, key_fields=("arm", "seed"),
                 settings={"scale": scale, "lora_lr": args.lora_lr, "lora_rank": LORA_RANK, "lora_alpha": LORA_ALPHA},
                 resume=args.resume, discard=args.discard_log or args.quick)  # fmt: skip
    runs = [log.get(arm=arm, seed=seed) or run_child(argv, arm, seed, log) for seed in args.seeds for arm in args.arms]
    summary = summarize(runs)
    with tempfile.TemporaryDirectory(prefix="flashrl-bench-") as tmp:
        model = benchmark_model(scale.model, tmp)
        configs = {arm: config_record(arithmetic_config(scale, model_path=model, seed=args.seeds[0],
                                                        overrides=arm_overrides(arm, args.lora_lr)), model=scale.model)
                   for arm in args.arms}  # fmt: skip
    report = {
        "benchmark": NAME,
        "command": ["python", "benchmarks/lora_learning.py", *argv],
        "settings": {"quick": args.quick, "seeds": args.seeds, "arms": args.arms, "scale": scale,
                     "lora_lr": args.lora_lr, "lora_rank": LORA_RANK, "lora_alpha": LORA_ALPHA,
                     "main_job": MAIN_JOB.as_posix()},
        "arms": {arm: {"overrides": arm_overrides(arm, args.lora_lr), "config": configs[arm]} for arm in args.arms},
        "runs": runs,
        "summary": summary,
        "ratios": ratios(summary),
        "machine": machine(),
    }
    print()
    print(render(summary))
    print(f"wrote {write_json(args.output, report)}")
    return report


if __name__ == "__main__":
    main()
