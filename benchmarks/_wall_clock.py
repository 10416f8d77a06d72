"""One evidence-3 run: training for a wall-time budget with pinned sides, snapshots, evaluation after the clock.

What the pre-registration fixes (benchmarks/paired_comparison.md, "Evidence-3", part 1) and how it is done:

* **Pinning** (`_pinning`): the benchmark's process, which holds the job's local learner, pins itself to
  the learner's core and uses one torch thread before it builds the algorithm; the EnvRunner worker pins
  itself in Ray's setup hook. Both are read back at the start and at the end of the clock (each process's
  ``os.sched_getaffinity(0)`` and every thread's ``Cpus_allowed_list``, the engine's processes included);
  a run where they differ from the asked cores is recorded ``valid: False`` with the causes, never counted.
* **The clock** starts just before the first ``algo.train()`` (the engine is up with the initial weights, the
  learner is built) and stops at the budget: an update that completes after it is not counted (its call is
  let finish off the clock, then the algorithm stops, and generation with it).
* **Snapshots.** After each completed update the driver copies the weights the engines were sent (the float32
  masters of a bfloat16 learner, as weight sync sends them) into memory: the pre-registered copy, on the
  clock and the same for every arm; its total time is recorded (``copy_s``). `SnapshotBook` gives each
  snapshot time the copy of the last update completed at or before it. **Writing a snapshot to disk is
  wholly off the clock: neither a pause nor a subtraction is needed, because no snapshot is written
  before the clock has stopped** (the copies wait in memory: at most one per snapshot time plus the one
  held, about 0.5 GB each for SmolLM2-135M in float32).
* **Evaluation, after the run**: one in-process EnvRunner with the run's own engine options (the same
  runner code and ``run_evaluation`` protocol as ``algo.evaluate()``; greedy on the held-out set), each
  distinct snapshot loaded from its file in time order; snapshots of one policy version share one
  evaluation.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _pinning import (
    Pinning,
    busy_fractions,
    cpu_times,
    pin_process,
    pinning_problems,
    probe,
    process_affinity,
    restore_process,
    side_affinity,
)
from _stats import generated_at
from _training import _row, evaluation_point


def served_weights(algo: Any) -> dict[str, Any]:
    """CPU copies of the weights the engines are sent (`LocalPolicy.sync_model` at the sync dtype); tied
    names share one copy. Needs the job's local learner (``num_learners=0``)."""
    import torch

    learner = getattr(algo.learner_group, "_local", None)
    if learner is None:
        raise RuntimeError("evidence-3 snapshots the local learner (num_learners=0, as the jobs ship): "
                           f"expected a local learner, got num_learners={algo.algo_config.num_learners}")
    dtype = learner.spec.sync_torch_dtype
    copies: dict[tuple[int, tuple[int, ...]], Any] = {}
    out = {}
    with torch.no_grad():
        for name, tensor in learner.policy.sync_model.state_dict().items():
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if key not in copies:
                copies[key] = tensor.detach().to("cpu", dtype=dtype or tensor.dtype, copy=True)
            out[name] = copies[key]
    return out


def _runner_side(algo: Any) -> dict[str, Any]:
    import ray

    actors = algo.env_runner_group.actors
    if len(actors) != 1:
        raise RuntimeError(f"evidence-3 pins one EnvRunner: expected num_env_runners=1, got {len(actors)}")
    pid, reported = ray.get(actors[0].__ray_call__.remote(probe), timeout=60)
    return side_affinity(pid, reported=reported)


def _learner_side() -> dict[str, Any]:
    # the learner's process is this one; Ray's own processes below it are not pinned (by design)
    return {"process": process_affinity(os.getpid()), "children": [],
            "sched_getaffinity": sorted(os.sched_getaffinity(0))}


def check_pinning(record: dict[str, Any], pinning: Pinning, *, engine_children: int) -> list[str]:
    """Every problem of the start and end readings (`{"start": {runner, learner}, "end": ...}`)."""
    problems = []
    for when in ("start", "end"):
        reading = record.get(when)
        if reading is None or "error" in reading:
            problems.append(f"{when}: no reading ({None if reading is None else reading['error']})")
            continue
        problems += [f"{when}: {p}" for p in pinning_problems(reading["runner"], pinning.runner_cores, side="runner",
                                                               min_children=engine_children)]
        problems += [f"{when}: {p}" for p in pinning_problems(reading["learner"], pinning.learner_cores,
                                                               side="learner")]
    return problems


class _ClockEnd:
    """At the budget, on a timer thread: each core's busy time and the end reading of the pinning."""

    def __init__(self, algo: Any, budget_s: float) -> None:
        self.algo = algo
        self.stat: dict[int, tuple[int, int]] | None = None
        self.reading: dict[str, Any] | None = None
        self._timer = threading.Timer(budget_s, self._at_end)
        self._timer.daemon = True

    def _at_end(self) -> None:
        self.stat = cpu_times()
        try:
            self.reading = {"runner": _runner_side(self.algo), "learner": _learner_side()}
        except Exception as error:  # noqa: BLE001 - recorded: the run is then invalid, not lost
            self.reading = {"error": f"{type(error).__name__}: {error}"}

    def start(self) -> None:
        self._timer.start()

    def wait(self) -> None:
        self._timer.join()

    def cancel(self) -> None:
        """A run that failed before the budget: no reading then (a no-op once the timer fired)."""
        self._timer.cancel()


def train_for(algo: Any, *, budget_s: float, snapshot_times: Sequence[float], label: str
              ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The clocked part: updates until the budget; returns the run's record and the snapshots (weights in memory)."""
    from _wall_design import SnapshotBook

    book = SnapshotBook(tuple(snapshot_times))
    rows: list[dict[str, Any]] = []
    missing: set[str] = set()
    mode = algo.algo_config.rollout_mode
    zero = {"started_lifetime": 0.0, "skipped_lifetime": 0.0}
    start_reading = {"runner": _runner_side(algo), "learner": _learner_side()}
    end = _ClockEnd(algo, budget_s)
    copy_s = 0.0
    rollouts = 0
    stat0 = cpu_times()
    t0 = time.perf_counter()
    end.start()
    try:
        while True:
            result = algo.train()
            seconds = time.perf_counter() - t0
            if seconds > budget_s:  # completed after the clock stopped: not counted
                discarded = {"completed_at_s": seconds, "iteration_s": float(result["timers/iteration_s"])}
                break
            rollouts += int(result["num_episodes"])
            row = _row(result, len(rows) + 1, rollouts, missing)
            row["t"] = seconds
            row["generated"] = generated_at(row, mode, zero)
            rows.append(row)
            copy_start = time.perf_counter()
            weights = served_weights(algo)
            copy_s += time.perf_counter() - copy_start
            book.completed(seconds, algo.learner_group.version, weights, row["generated"] or 0.0)
            print(f"  {label} update {len(rows)} at {seconds:.0f}/{budget_s:.0f} s: "
                  f"{result['timers/iteration_s']:.1f} s, return "
                  f"{result.get('env_runners/batch_episode_return_mean', math.nan):.2f}", flush=True)
    except BaseException:
        end.cancel()
        raise
    end.wait()
    record = {
        "rollout_mode": mode,
        "budget_s": budget_s,
        "updates": rows,
        "discarded_update": discarded,
        "copy_s": copy_s,
        "missing_metrics": sorted(missing),
        "pinning": {"start": start_reading, "end": end.reading},
        "busy_fraction": busy_fractions(stat0, end.stat) if end.stat is not None else None,
    }
    return record, book.end()


def write_snapshots(snapshots: list[dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    """Write each distinct policy of the snapshots once (after the clock); returns them with `file`, no weights."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    files: dict[int, str | None] = {}
    out = []
    for snap in snapshots:
        version = snap["version"]
        if version not in files:
            if snap["weights"] is None:
                files[version] = None  # the initial policy: the model's own folder
            else:
                path = folder / f"policy_v{version}.pt"
                torch.save(snap["weights"], path)
                files[version] = str(path)
        out.append({k: v for k, v in snap.items() if k != "weights"} | {"file": files[version]})
    return out


class SnapshotEvaluator:
    """An in-process EnvRunner that evaluates policies on the held-out set, one after another."""

    def __init__(self, config: Any, engine_options: dict[str, Any], model_path: str) -> None:
        from flashrl.cli import InProcessRunner

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the sync_group "comparison baseline" notice, once per run is enough
            config.validate()
        self.spec = config.env_runner_spec(engine_options=engine_options)
        self.num_samples = config.evaluation_num_samples_per_prompt
        self._runner = InProcessRunner(self.spec, model_path)
        self._served = 0

    def evaluate(self, version: int, path: str | None) -> dict[str, Any]:
        """Load the policy of `version` from `path` (None: the initial policy, served at start), then evaluate."""
        import torch

        from flashrl.env_runners.evaluation import run_evaluation
        from flashrl.weight_sync.messages import LoadWeights

        if path is not None:
            if version <= self._served:
                raise ValueError(f"expected policy versions in increasing order, got {version} after {self._served}")
            weights = torch.load(path, weights_only=True)
            runner = self._runner
            served = runner._loop.run(runner._runner.weight_sync(LoadWeights(version, weights)))
            if served != version:
                raise RuntimeError(f"the evaluation engine serves version {served} after loading {version}")
            self._served = version
        elif self._served != 0:
            raise ValueError("the initial policy must be evaluated first")
        start = time.perf_counter()
        result = run_evaluation(self._runner, self.spec, num_samples=self.num_samples)
        metrics = dict(result.metrics)
        metrics["timers/evaluation_s"] = time.perf_counter() - start
        return evaluation_point(metrics)

    def close(self) -> None:
        self._runner.close()


def evaluate_snapshots(config: Any, engine_options: dict[str, Any], model_path: str,
                       snapshots: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each snapshot with its held-out evaluation (`accuracy`, ...); one evaluation per distinct version."""
    evaluator = SnapshotEvaluator(config, engine_options, model_path)
    done: dict[int, dict[str, Any]] = {}
    try:
        for snap in snapshots:
            if snap["version"] not in done:
                done[snap["version"]] = evaluator.evaluate(snap["version"], snap["file"])
    finally:
        evaluator.close()
    return [snap | done[snap["version"]] for snap in snapshots]


def wall_run(config: Any, *, budget_s: float, snapshot_times: Sequence[float], pinning: Pinning, label: str,
             snapshot_dir: Path, keep_snapshots: bool = False) -> dict[str, Any]:
    """Build, pin, train for `budget_s` of wall time, stop; write and evaluate the snapshots; one run's record.

    The record's `valid` is False, with the causes in `invalid`, when the pinning read back differs from
    `pinning`; the caller logs it either way.
    """
    import torch

    start = time.perf_counter()
    load_before = os.getloadavg()
    threads_before = torch.get_num_threads()
    affinity_before = pin_process(pinning.learner_cores)
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the sync_group "comparison baseline" notice
            algo = config.build_algo()
        try:
            setup_s = time.perf_counter() - start
            record, snapshots = train_for(algo, budget_s=budget_s, snapshot_times=snapshot_times, label=label)
            engine_options, model_path = dict(algo.plan.runner_engine_options), algo.model_path
        finally:
            algo.stop()
    finally:  # evaluation is off the clock: both cores
        restore_process(affinity_before)
        torch.set_num_threads(threads_before)
    stopped = time.perf_counter()
    folder = snapshot_dir / label.replace(" ", "_").replace("=", "")
    try:
        written = write_snapshots(snapshots, folder)
        del snapshots  # the copies leave memory once written
        evaluated = evaluate_snapshots(config, engine_options, model_path, written)
    finally:
        if not keep_snapshots:
            shutil.rmtree(folder, ignore_errors=True)
    engine_children = 1 if config.engine == "vllm" else 0
    problems = check_pinning(record["pinning"], pinning, engine_children=engine_children)
    record["pinning"]["expected"] = {"runner": list(pinning.runner_cores), "learner": list(pinning.learner_cores)}
    return {
        **record,
        "snapshots": evaluated,
        "valid": not problems,
        "invalid": problems,
        "load_before": list(load_before),
        "setup_s": setup_s,
        "evaluation_s": time.perf_counter() - stopped,
        "wall_s": time.perf_counter() - start,
    }


@contextlib.contextmanager
def pinned_ray(pinning: Pinning, *, quick: bool) -> Any:
    """A new local Ray started for this benchmark with the pinning hook (never one that runs already: its
    workers would not have the hook, and no run could count); shut down after."""
    import _pinning
    import ray
    from _ray_setup import connect_ray

    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        raise RuntimeError("evidence-3 starts its own local Ray (the pinning hook is part of its runtime_env): "
                           "expected no connected Ray and no RAY_ADDRESS; unset RAY_ADDRESS")
    cores = max(*pinning.runner_cores, *pinning.learner_cores) + 1
    if len(os.sched_getaffinity(0)) < cores and not quick:
        raise RuntimeError(f"expected cores {pinning.runner_cores} and {pinning.learner_cores} to be usable, "
                           f"this process may use {sorted(os.sched_getaffinity(0))}")
    ray.cloudpickle.register_pickle_by_value(_pinning)  # the hook and the probe travel by value
    connect_ray(extra_runtime_env=_pinning.runtime_env(pinning), own_cluster=True)
    try:
        yield
    finally:
        ray.shutdown()
