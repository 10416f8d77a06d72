"""Shared pieces of the benchmarks that train: the arithmetic task's configs, the runs, the reports.

`learning_efficiency.py`, `ablations.py` and `async_vs_sync.py` build their configs, run their updates
and write their reports through this module, so they measure the same things the same way:

* `main_job()`: the CPU main job (`tuned_examples/smollm2_arithmetic_cpu.py`), imported, not copied:
  its `make_config` gives the task (easy sums with the held-out split), the model and the
  hyperparameters every arm starts from.
* `reference_fields(name)`: a variant of the method's public release (`grpo`, `no_trust`, `no_is`,
  `token_mean`, `constant_length`, `negative_q09`) as the config fields it changes, derived from
  `flashrl.recipes.settings` through `flashrl.recipes.translate` (the same translation the tuned
  examples use), never retyped; `staleness_fields(q)` likewise for the reference's queue depths.
* `Scale` (`FULL`, `QUICK`) and `arithmetic_config(scale, ...)`: the main job's config at a size.
* `run_updates(config, ...)`: N updates, a held-out evaluation every k, the metrics of every update.
* `RunLog`: every finished run appended to `<report>.runs.tmp` as it ends, so a crash or a stop
  loses at most the run in progress; `--resume` skips the runs already there.
* reporting: `spread`, `table`, `config_record`, `write_json`, `plot_curves`, `plot_bars`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path("benchmarks") / "results"
FIGURES = Path("docs") / "figures"
MAIN_JOB = Path("tuned_examples") / "smollm2_arithmetic_cpu.py"
ACCURACY = "evaluation/episode_return_mean"
"""Held-out greedy accuracy: the main job's reward is 1 for a correct sum, 0 otherwise."""

REFERENCE_VARIANTS: dict[str, tuple[str, str]] = {
    "grpo": ("qwen7b_tool", "grpo"),
    "no_trust": ("r1", "no_trust"),
    "no_is": ("alfworld", "no_is"),
    "token_mean": ("qwen7b_tool", "token_mean"),
    "constant_length": ("qwen7b_tool", "constant_length"),
    "negative_q09": ("qwen7b_tool", "negative_q09"),
}
"""Variant -> (reference setting, variant name) it is taken from. `no_is` comes from `alfworld`, whose
variant changes only the importance sampling (`qwen3_tool_ablation`'s also lowers delta, which a
ratio of 1 makes inert); `grpo` from `qwen7b_tool` (G = 4)."""
STALENESS_SETTINGS: dict[int, str] = {4: "qwen3_tool_ablation", 8: "r1"}
"""The reference settings that run with `train.async_queue_size` 4 and 8 (and their delta)."""
METHOD_FIELDS = (
    "rollout_mode",
    "group_size",
    "baseline",
    "importance_sampling",
    "trust_region",
    "aggregation",
    "constant_length_normalizer",
    "delta",
    "negative_token_fraction",
    "async_queue_size",
)
"""Config fields a variant may change here; the rest of a reference setting (model, schedule,
hardware) stays the main job's."""
ROW_METRICS = {
    "num_episodes": "num_episodes",
    "return_mean": "env_runners/batch_episode_return_mean",
    "accepted_fraction": "learners/accepted_fraction",
    "drift_mean": "learners/drift_mean",
    "drift_max": "learners/drift_max",
    "policy_lag_mean": "env_runners/policy_lag_mean",
    "policy_lag_max": "env_runners/policy_lag_max",
    "idle_fraction": "learners/idle_fraction",
    "trajectories_per_s": "learners/trajectories_per_s",
    "iteration_s": "timers/iteration_s",
    "sample_wait_s": "timers/sample_wait_s",
    "learner_update_s": "timers/learner_update_s",
    "weight_sync_s": "timers/weight_sync_s",
    "generated_tokens_per_s": "env_runners/generated_tokens_per_s",
    "started_lifetime": "env_runners/num_started_lifetime",
    "lost_lifetime": "env_runners/num_lost_episodes_lifetime",
    "skipped_stale_lifetime": "env_runners/num_skipped_stale_lifetime",
}
"""Short name in the report -> the `algo.train()` metric (docs/runtime.md, Metrics)."""
LAG_HIST = "env_runners/policy_lag_hist/"
SKIPPED = "env_runners/num_skipped_"


# ------------------------------------------------------------------------------------------------
# configs
# ------------------------------------------------------------------------------------------------
def load_script(relative_path: str | os.PathLike[str], name: str) -> ModuleType:
    """Import a script of this repository by path (tuned examples and benchmarks are not packages).

    The module is registered for pickling by value, so classes defined in it (an environment) reach
    Ray actors that cannot import it.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / relative_path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {relative_path}: expected a Python file under {REPO.name}/")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)
    return module


def main_job() -> ModuleType:
    """`tuned_examples/smollm2_arithmetic_cpu.py` (its `PRESET`, `make_config`, `easy_sums`)."""
    return load_script(MAIN_JOB, "flashrl_bench_smollm2_arithmetic_cpu")


def _setting_fields(setting: str, variants: Sequence[str] = ()) -> dict[str, Any]:
    from flashrl.recipes.settings import resolve_setting
    from flashrl.recipes.translate import flashrl_fields

    return flashrl_fields(resolve_setting(setting, variants)).values


def reference_fields(name: str, *, max_new_tokens: int) -> dict[str, Any]:
    """The config fields the reference's variant `name` changes (within `METHOD_FIELDS`).

    `constant_length` divides by the reference's L = 6144, its setting's `rollout.max_new_tokens`:
    here L is scaled to this task's `max_new_tokens` in the same proportion.
    """
    if name not in REFERENCE_VARIANTS:
        raise ValueError(f"unknown variant {name!r}: expected one of {sorted(REFERENCE_VARIANTS)}")
    setting, variant = REFERENCE_VARIANTS[name]
    base, changed = _setting_fields(setting), _setting_fields(setting, [variant])
    fields = {k: changed[k] for k in METHOD_FIELDS if k in changed and changed[k] != base.get(k)}
    if "constant_length_normalizer" in fields:
        ratio = fields["constant_length_normalizer"] / changed["max_new_tokens"]
        fields["constant_length_normalizer"] = max(1, round(ratio * max_new_tokens))
    return fields


def staleness_fields(queue_size: int, *, train_batch_size: int) -> dict[str, Any]:
    """The reference's `async_queue_size` = `queue_size` with that setting's delta, and lag made real.

    The runner keeps `queue_size x B` episodes in flight: the admission budget (docs/runtime.md,
    bounded staleness) then lets sampling run the full `queue_size` batches ahead of the learner, so
    episodes are trained up to `queue_size` versions after their weights (`policy_lag_*` shows it).
    """
    if queue_size not in STALENESS_SETTINGS:
        raise ValueError(
            f"queue_size: expected one of {sorted(STALENESS_SETTINGS)} (the reference's), got {queue_size}"
        )
    fields = _setting_fields(STALENESS_SETTINGS[queue_size])
    assert fields["async_queue_size"] == queue_size, (STALENESS_SETTINGS, fields["async_queue_size"])
    return {
        "async_queue_size": queue_size,
        "delta": fields["delta"],
        "episodes_in_flight_per_env_runner": queue_size * train_batch_size,
    }


def reference_source(name: str) -> str:
    from flashrl.recipes.settings import REFERENCE, SETTINGS

    setting, variant = REFERENCE_VARIANTS[name]
    return f"{REFERENCE}: {SETTINGS[setting].source}, variant {variant!r}"


@dataclass(frozen=True)
class Scale:
    """How big a run is; None keeps the main job's value."""

    model: str
    """'tiny' (random weights, SmolLM2's tokenizer) or a model spec / folder."""
    batch_size: int
    """B: rollouts per update (FlashREINFORCE: B prompts x 1; GRPO: B/G prompts x G)."""
    updates: int
    eval_every: int
    """Held-out evaluation after every this many updates (and before the first, and after the last)."""
    eval_episodes: int
    """Held-out prompts per evaluation (the main job holds out 64)."""
    engine: str | None = None
    max_new_tokens: int | None = None
    episodes_in_flight: int | None = None
    num_cpus_per_env_runner: float | None = None


FULL = Scale(model="smollm2-135m-instruct", batch_size=16, updates=30, eval_every=5, eval_episodes=64)
"""The main job's B and evaluation; 30 of its 60 updates (480 rollouts per run)."""
QUICK = Scale(
    model="tiny",
    batch_size=4,
    updates=2,
    eval_every=1,
    eval_episodes=8,
    engine="torch",
    max_new_tokens=8,
    episodes_in_flight=8,
    num_cpus_per_env_runner=0.5,
)
"""Smoke size: the tiny random model on the torch engine (numbers mean nothing, the code path does)."""


def benchmark_model(spec: str, folder: str | os.PathLike[str]) -> str:
    """A local model folder: 'tiny' builds the random-weight Llama into `folder`; else `resolve_model`."""
    from flashrl.models import build_tiny_llama, resolve_model

    if spec != "tiny":
        return resolve_model(spec)
    return build_tiny_llama(
        Path(folder) / "tiny", seed=0, tokenizer_source=resolve_model("smollm2-135m-instruct")
    )


def arithmetic_config(
    scale: Scale, *, model_path: str, seed: int, overrides: Mapping[str, Any] | None = None
) -> Any:
    """The main job's config at `scale`, with `seed` and `overrides` (config fields) applied.

    Evaluation is driven by `run_updates` (not `evaluation_interval`); TensorBoard and the console
    line are off (the benchmark prints its own).
    """
    from flashrl.recipes import recipe_parser

    job = main_job()
    config = job.make_config(recipe_parser(job.PRESET).parse_args([]))
    changes: dict[str, Any] = {
        "model": model_path,
        "train_batch_size": scale.batch_size,
        "evaluation_interval": None,
        "evaluation_num_episodes": scale.eval_episodes,
        "seed": seed,
        "tensorboard": False,
        "console_every": 0,
    }
    for field, value in (
        ("engine", scale.engine),
        ("max_new_tokens", scale.max_new_tokens),
        ("episodes_in_flight_per_env_runner", scale.episodes_in_flight),
        ("num_cpus_per_env_runner", scale.num_cpus_per_env_runner),
    ):
        if value is not None:
            changes[field] = value
    config.update_from_dict(changes | dict(overrides or {}))
    return config


def task_max_new_tokens(scale: Scale) -> int:
    """The max_new_tokens runs at `scale` use (the main job's unless the scale sets one)."""
    if scale.max_new_tokens is not None:
        return scale.max_new_tokens
    from flashrl.recipes import recipe_parser

    job = main_job()
    return job.make_config(recipe_parser(job.PRESET).parse_args([])).max_new_tokens


# ------------------------------------------------------------------------------------------------
# runs
# ------------------------------------------------------------------------------------------------
def connect_ray() -> bool:
    """Use a connected Ray, else join `RAY_ADDRESS`, else start a local cluster; True = we connected."""
    import ray

    from flashrl.ray_utils import init_or_join

    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
    if os.environ.get("RAY_ADDRESS"):
        init_or_join(runtime_env=runtime_env, log_to_driver=False)
    else:  # logical CPUs above the 2 cores: the actors ask for fractions deliberately
        ray.init(
            num_cpus=max(4, os.cpu_count() or 2),
            include_dashboard=False,
            log_to_driver=False,
            runtime_env=runtime_env,
        )
    return True


def _row(result: Mapping[str, Any], update: int, rollouts: int, missing: set[str]) -> dict[str, Any]:
    row: dict[str, Any] = {"update": update, "rollouts": rollouts}
    for short, key in ROW_METRICS.items():
        value = result.get(key)
        if value is None:
            missing.add(key)
        row[short] = None if value is None else float(value)
    row["skipped_lifetime"] = float(sum(v for k, v in result.items() if k.startswith(SKIPPED)))
    row["policy_lag_hist"] = {
        k[len(LAG_HIST) :]: float(v) for k, v in result.items() if k.startswith(LAG_HIST)
    }
    return row


def _evaluate(algo: Any, update: int, rollouts: int) -> dict[str, Any]:
    metrics = algo.evaluate()
    return {
        "update": update,
        "rollouts": rollouts,
        "accuracy": float(metrics[ACCURACY]),
        "num_episodes": int(metrics.get("evaluation/num_episodes", 0)),
        "seconds": float(metrics.get("timers/evaluation_s", math.nan)),
    }


def run_updates(
    config: Any, *, updates: int, eval_every: int | None, label: str, warmup: int = 0
) -> dict[str, Any]:
    """Build the algorithm, run `warmup + updates` iterations, evaluate, stop it.

    With `eval_every`, the held-out set is scored before the first update, after every `eval_every`
    updates and after the last. `rollouts` counts the trajectories trained on (the learner's
    budget); `started_lifetime` also counts those sampled but not (yet) trained on.

    Returns:
        {"curve": [evaluations], "updates": [one row per measured update], "missing_metrics": [...],
         "wall_s": seconds from build to stop}
    """
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sync_group "comparison baseline" notice
        algo = config.build_algo()
    curve: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    missing: set[str] = set()
    rollouts = 0
    at_warmup_end = {"started_lifetime": 0.0, "skipped_lifetime": 0.0}
    try:
        if eval_every:
            curve.append(_evaluate(algo, 0, 0))
        for i in range(1, warmup + updates + 1):
            result = algo.train()
            update = i - warmup
            if update <= 0:
                warm = _row(result, update, 0, set())
                at_warmup_end = {k: warm[k] or 0.0 for k in at_warmup_end}
                continue
            rollouts += int(result["num_episodes"])
            rows.append(_row(result, update, rollouts, missing))
            if eval_every and (update % eval_every == 0 or update == updates):
                curve.append(_evaluate(algo, update, rollouts))
            accuracy = (
                f", held-out {curve[-1]['accuracy']:.3f}" if curve and curve[-1]["update"] == update else ""
            )
            print(
                f"  {label} update {update}/{updates}: {result['timers/iteration_s']:.1f} s, "
                f"return {result.get('env_runners/batch_episode_return_mean', math.nan):.2f}{accuracy}",
                flush=True,
            )
    finally:
        algo.stop()
    return {
        "rollout_mode": config.rollout_mode,
        "curve": curve,
        "updates": rows,
        "warmup": warmup,
        "at_warmup_end": at_warmup_end,
        "missing_metrics": sorted(missing),
        "wall_s": time.perf_counter() - start,
    }


# ------------------------------------------------------------------------------------------------
# summaries
# ------------------------------------------------------------------------------------------------
def spread(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """Mean, population std, min and max of the values that are not None (n of them)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    m = sum(xs) / len(xs)
    return {
        "mean": m,
        "std": math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs)),
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
    }


def mean_of(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def lag_distribution(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Fraction of trained episodes per policy-lag bucket over all rows (weighted by episodes)."""
    total = sum(r["num_episodes"] or 0 for r in rows)
    keys = sorted({k for r in rows for k in r["policy_lag_hist"]}, key=lambda k: int(k.rstrip("+")))
    return {
        k: sum(r["policy_lag_hist"].get(k, 0.0) * (r["num_episodes"] or 0) for r in rows) / max(1, total)
        for k in keys
    }


def rollouts_sampled(run: Mapping[str, Any]) -> float | None:
    """Training episodes the runners started during the measured updates (after the warmup).

    Async: trained + dropped + still in flight or pending at the end. `env_runners/num_started_lifetime`
    counts the async stream only (it stays 0 in sync_group mode, where every episode sampled is
    trained on or dropped and counted): sync_group's are the trained plus the dropped ones.
    """
    rows = run["updates"]
    if not rows or rows[-1]["started_lifetime"] is None:
        return None
    last, warm = rows[-1], run["at_warmup_end"]
    if run["rollout_mode"] == "async":
        return last["started_lifetime"] - warm["started_lifetime"]
    return last["rollouts"] + last["skipped_lifetime"] - warm["skipped_lifetime"]


def run_summary(run: Mapping[str, Any]) -> dict[str, Any]:
    """One run's training-side means: accepted fraction, drift, lag, time per update."""
    rows = run["updates"]
    return {
        "accepted_fraction_mean": mean_of(rows, "accepted_fraction"),
        "drift_mean": mean_of(rows, "drift_mean"),
        "drift_max": max((r["drift_max"] for r in rows if r["drift_max"] is not None), default=None),
        "policy_lag_mean": mean_of(rows, "policy_lag_mean"),
        "policy_lag_max": max(
            (r["policy_lag_max"] for r in rows if r["policy_lag_max"] is not None), default=None
        ),
        "policy_lag_distribution": lag_distribution(rows),
        "iteration_s_mean": mean_of(rows, "iteration_s"),
        "rollouts_trained": rows[-1]["rollouts"] if rows else 0,
        "rollouts_sampled": rollouts_sampled(run),
        "initial_accuracy": run["curve"][0]["accuracy"] if run["curve"] else None,
        "final_accuracy": run["curve"][-1]["accuracy"] if run["curve"] else None,
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


# ------------------------------------------------------------------------------------------------
# reports
# ------------------------------------------------------------------------------------------------
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


def config_record(config: Any, *, model: str) -> dict[str, Any]:
    """The config as a dict: the model as its spec (not this machine's folder), task lists summarised."""
    record = config.to_dict()
    record["model"] = model
    for key in ("env_config", "evaluation_env_config"):
        env = dict(record.get(key) or {})
        if isinstance(env.get("tasks"), list):
            tasks = env["tasks"]
            env["tasks"] = {
                "count": len(tasks),
                "first_ids": [t.get("id") for t in tasks[:3]],
                "source": f"{MAIN_JOB.as_posix()}: easy_sums()",
            }
        record[key] = env
    return record


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
        "platform": platform.platform(),
        "git_commit": commit,
        "load_average_1min_at_end": load,
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return _jsonable(asdict(value))
    return value


def write_json(path: str | os.PathLike[str], report: Mapping[str, Any]) -> str:
    """Strict JSON (NaN -> null, +-inf -> "inf"/"-inf"), folders created."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_jsonable(report), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return str(out)


class RunLog:
    """Finished runs, one JSON line each, next to the report (`<report>.runs.tmp`).

    A full benchmark takes hours: each run is written the moment it ends, so a crash, a stop or the
    end of a sitting loses at most the run in progress. The first line holds the settings the runs
    were made with. With `resume=True` the runs already in the log are kept and `get` returns them
    (keyed by `key_fields`, e.g. method and seed), and a log made with other settings is an error;
    without it the log starts empty.

    The log is not committed, so a fresh clone has none: there `resume=True` starts from the runs of
    the committed report itself (`report_path`), when the report's `settings` hold these settings
    (same keys, same values), so a later sitting adds seeds or arms to a published report instead of
    redoing it. A report made with other settings is an error, as a log would be.
    """

    def __init__(
        self,
        report_path: str | os.PathLike[str],
        *,
        key_fields: Sequence[str],
        settings: Mapping[str, Any],
        resume: bool,
    ) -> None:
        self.path = Path(f"{os.fspath(report_path)}.runs.tmp")
        self.key_fields = tuple(key_fields)
        self._runs: dict[tuple[Any, ...], dict[str, Any]] = {}
        settings = json.loads(json.dumps(_jsonable({"settings": settings}), allow_nan=False))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume and not self.path.exists() and Path(report_path).exists():
            self._seed_from_report(Path(report_path), settings)
        elif resume and self.path.exists():
            lines = self.path.read_text(encoding="utf-8").splitlines()
            logged = json.loads(lines[0]) if lines else settings
            if logged != settings:
                raise ValueError(
                    f"--resume: {self.path} was made with {logged['settings']}, this run has "
                    f"{settings['settings']}; run with the same settings, or without --resume to start over"
                )
            for number, line in enumerate(lines[1:], 2):
                try:
                    run = json.loads(line)
                except json.JSONDecodeError as error:  # a line cut short by a kill: that run is redone
                    print(f"{self.path}:{number}: unreadable run ({error}); it runs again", flush=True)
                    continue
                self._runs[self._key(run)] = run
        # rewritten whole, so a line cut short is gone before the next run is appended
        kept = [json.dumps(settings), *(json.dumps(run) for run in self._runs.values())]
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def _seed_from_report(self, report_path: Path, settings: Mapping[str, Any]) -> None:
        report = json.loads(report_path.read_text(encoding="utf-8"))
        made_with = report.get("settings", {})
        mine = {k: made_with.get(k) for k in settings["settings"]}
        if mine != settings["settings"]:
            raise ValueError(
                f"--resume: {report_path} was made with {mine}, this run has {settings['settings']}; "
                "run with the same settings, or without --resume to start over"
            )
        for run in report.get("runs", []):
            self._runs[self._key(run)] = run
        print(f"--resume: {len(self._runs)} finished run(s) from {report_path}", flush=True)

    def _key(self, run: Mapping[str, Any]) -> tuple[Any, ...]:
        return tuple(run[k] for k in self.key_fields)

    def get(self, **key: Any) -> dict[str, Any] | None:
        """The logged run with these key values, or None."""
        return self._runs.get(tuple(key[k] for k in self.key_fields))

    def add(self, run: Mapping[str, Any]) -> None:
        line = json.dumps(_jsonable(run), allow_nan=False)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
        self._runs[self._key(run)] = json.loads(line)

    def __len__(self) -> int:
        return len(self._runs)


def _save(plt: Any, fig: Any, path: str | os.PathLike[str], title: str | None = None) -> str:
    """Title (optional), lay out, write the PNG (folders created), free the figure; returns the path."""
    if title is not None:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(
    curves: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | os.PathLike[str],
    *,
    title: str,
    target: float | None = None,
) -> str:
    """Accuracy vs rollouts: per method the mean over seeds and a min..max band.

    Args:
        curves: method -> points {"rollouts", "mean", "min", "max"}.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in curves.items():
        xs = [p["rollouts"] for p in points]
        (line,) = ax.plot(xs, [p["mean"] for p in points], "o-", label=name)
        ax.fill_between(
            xs, [p["min"] for p in points], [p["max"] for p in points], color=line.get_color(), alpha=0.2
        )
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("rollouts trained on")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def plot_bars(
    panels: Sequence[tuple[str, Sequence[str], Sequence[Mapping[str, Any]]]],
    path: str | os.PathLike[str],
    *,
    title: str,
) -> str:
    """One bar panel per (y label, bar names, spreads): the mean, min..max as the error bar."""
    plt = _pyplot()
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.5 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (ylabel, names, spreads) in zip(axes.flat, panels):
        means = [s["mean"] if s["mean"] is not None else 0.0 for s in spreads]
        low = [m - (s["min"] if s["min"] is not None else m) for m, s in zip(means, spreads)]
        high = [(s["max"] if s["max"] is not None else m) - m for m, s in zip(means, spreads)]
        ax.bar(range(len(names)), means, yerr=[low, high], capsize=3, color="tab:blue", alpha=0.8)
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    return _save(plt, fig, path, title)


TRAINING_PANELS = (
    ("accepted fraction", "accepted_fraction"),
    ("mean drift (Bernoulli KL)", "drift_mean"),
    ("mean policy lag (versions)", "policy_lag_mean"),
    ("batch return (training)", "return_mean"),
)
"""What `plot_training` draws per update: (y label, short row name in `ROW_METRICS`)."""


def plot_training(
    series: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]],
    path: str | os.PathLike[str],
    *,
    title: str,
) -> str:
    """The learner's side of a run against rollouts: accepted fraction, drift, policy lag, return.

    Args:
        series: name -> its runs' update rows (one list per seed); drawn as the mean over the runs
            at each update (None values left out), with a min..max band when there are several.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), squeeze=False)
    for ax, (ylabel, key) in zip(axes.flat, TRAINING_PANELS):
        for name, runs in series.items():
            points = []
            for same in zip(*runs):
                values = [r[key] for r in same if r.get(key) is not None]
                if values:
                    points.append((same[0]["rollouts"], sum(values) / len(values), min(values), max(values)))
            if not points:
                continue
            xs = [p[0] for p in points]
            (line,) = ax.plot(xs, [p[1] for p in points], "-", label=name, linewidth=1.5)
            if len(runs) > 1:
                ax.fill_between(
                    xs, [p[2] for p in points], [p[3] for p in points], color=line.get_color(), alpha=0.15
                )
        ax.set_xlabel("rollouts trained on")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    return _save(plt, fig, path, title)


def write_tensorboard(report: Mapping[str, Any], logdir: str | os.PathLike[str]) -> list[str]:
    """A report's runs as TensorBoard runs, stepped by rollouts trained on (equal across methods).

    One run folder per (method or arm, seed): `<logdir>/<benchmark>/<name>/seed<k>`, with
    `heldout/accuracy` at every evaluation and `train/<metric>` (the `ROW_METRICS` short names) at
    every update. Returns the folders written.
    """
    from flashrl.metrics import TensorBoardLogger

    folders = []
    for run in report["runs"]:
        name = run.get("method") or run.get("arm") or run.get("mode") or "run"
        folder = Path(logdir) / str(report["benchmark"]) / str(name) / f"seed{run.get('seed', 0)}"
        logger = TensorBoardLogger(folder)
        try:
            for point in run.get("curve", []):
                logger.log(int(point["rollouts"]), {"heldout/accuracy": point["accuracy"]})
            for row in run.get("updates", []):
                scalars = {
                    f"train/{k}": v
                    for k, v in row.items()
                    if k in ROW_METRICS and isinstance(v, (int, float))
                }
                logger.log(int(row["rollouts"]), scalars)
        finally:
            logger.close()
        folders.append(str(folder))
    return folders


def write_training_outputs(
    report: Mapping[str, Any],
    series: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]],
    *,
    figure: str | os.PathLike[str],
    tensorboard: str | os.PathLike[str],
    title: str,
) -> None:
    """Next to a benchmark's main PNG: `<figure stem>_training.png` (`plot_training`) and its TensorBoard runs."""
    training_figure = Path(figure).with_name(f"{Path(figure).stem}_training.png")
    print(f"wrote {plot_training(series, training_figure, title=title)}")
    write_tensorboard(report, tensorboard)
    print(f"TensorBoard: tensorboard --logdir {tensorboard}")
