"""Evidence-3's design as data and pure functions (benchmarks/paired_comparison.md, "Evidence-3").

Nothing here runs a model, so every piece is checked by `tests/benchmarks/test_wall_design.py`:

* `WallTask` (`WALL_TASKS`): each part's arms, comparisons, wall-time budget and snapshot times;
* `SnapshotBook`: which policy each snapshot time gets (the last update completed at or before it);
* the learning-rate pilots: `pilot_grid` (the registered grid, extended past an edge the choice picked),
  `pilot_choice` (the best mean primary metric, ties to the lower rate) and `pilot_todo`;
* `wall_metrics`: the primary metric (area under held-out accuracy over wall time) and the secondaries,
  `episode_durations` among them (the trained episodes' wall times: the stragglers);
* `wall_schedule` and `runs_to_do`: the counted runs' order, and what a resumed log still lacks (a run
  whose pinning did not take, or that crashed, is kept in the log marked invalid and run again).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from _paired import accuracy_at, area_to_budget, time_to_reach

WALL_LEARNING_RATES = (1e-5, 3e-5, 1e-4)
"""The registered pilot grid; an arm whose choice is an edge extends it by half a decade (10^0.5 steps)."""
WALL_PILOT_SEEDS = (200, 201)
WALL_COUNTED_SEEDS = tuple(range(12))
WALL_TOOL_SEEDS = (0, 1, 2)
WALL_TARGET = 0.6
"""Held-out accuracy for the secondary 'time to first reach 0.6' (interpolated between snapshots)."""
RATE_BOUNDS = (1e-7, 1e-2)
"""The pilots extend no further: a choice at one of these is a deviation to report, not a rate to run."""
MAX_ATTEMPTS = 3
"""Invalid runs (pinning did not take, a crash) of one key in a row before the driver stops and asks."""


@dataclasses.dataclass(frozen=True)
class WallTask:
    """One part of evidence-3: its arms, comparisons, wall-time budget and snapshot schedule."""

    arms: tuple[str, ...]
    comparisons: tuple[tuple[str, str], ...]
    """(a, b) pairs reported as a - b; the first is the primary comparison."""
    budget_s: float
    """Training wall time per run, in seconds."""
    snapshot_every_s: float
    held_out: int
    job: str
    """'sums' or 'tool': whose job (config) the runs take."""
    tuned: bool
    """Whether the learning rate is chosen by pilots (part 1) or is the job's own (part 2)."""

    @property
    def snapshot_times(self) -> tuple[float, ...]:
        return snapshot_times(self.budget_s, self.snapshot_every_s)


WALL_TASKS = {
    "sums_wall": WallTask(
        arms=("flash_async", "flash_sync", "grpo"),
        comparisons=(("flash_async", "flash_sync"), ("flash_async", "grpo"), ("flash_sync", "grpo")),
        budget_s=600.0, snapshot_every_s=100.0, held_out=256, job="sums", tuned=True,
    ),
    "tool_wall": WallTask(
        arms=("flash_async", "flash_sync"), comparisons=(("flash_async", "flash_sync"),),
        budget_s=1500.0, snapshot_every_s=300.0, held_out=64, job="tool", tuned=False,
    ),
}
QUICK_WALL = {"budget_s": 24.0, "snapshot_every_s": 8.0, "held_out": 8}
"""Smoke size (tiny random model, torch engine): the code path, not a measurement."""


def snapshot_times(budget_s: float, every_s: float) -> tuple[float, ...]:
    """0, every_s, 2 every_s, ..., budget_s (the budget must be a whole number of steps)."""
    if budget_s <= 0 or every_s <= 0:
        raise ValueError(f"expected a positive budget and snapshot interval, got {budget_s} and {every_s}")
    steps = budget_s / every_s
    if abs(steps - round(steps)) > 1e-9:
        raise ValueError(f"expected the budget ({budget_s} s) to be a whole number of snapshot intervals "
                         f"({every_s} s); fix one of them")
    return tuple(k * every_s for k in range(round(steps) + 1))


@dataclasses.dataclass
class SnapshotBook:
    """Which policy each snapshot time gets: the last update that completed at or before it.

    `completed(seconds, version, weights, generated)` is called when an update completes, `seconds` on the
    run's clock; `end()` when the clock stops. A time passed by the clock is given the policy held before
    the update that passed it, so each snapshot is fixed the moment the clock passes it. The initial policy
    (version 0) holds until the first update completes; its `weights` are None (the model's own).
    """

    times: tuple[float, ...]
    held: tuple[int, Any, float] = (0, None, 0.0)
    """(version, weights, generated rollouts) of the last completed update."""
    taken: dict[float, tuple[int, Any, float]] = dataclasses.field(default_factory=dict)

    def _fix_before(self, seconds: float) -> None:
        for t in self.times:
            if t < seconds and t not in self.taken:
                self.taken[t] = self.held

    def completed(self, seconds: float, version: int, weights: Any, generated: float) -> None:
        if seconds > self.times[-1]:
            raise ValueError(f"an update completed at {seconds:.1f} s, past the budget ({self.times[-1]} s): "
                             "it is not counted; call end() instead")
        self._fix_before(seconds)
        self.held = (version, weights, generated)

    def end(self) -> list[dict[str, Any]]:
        """Fix every time not yet passed (the clock stopped); one entry per time: {t, version, weights, generated}."""
        self._fix_before(math.inf)
        return [{"t": t, "version": self.taken[t][0], "weights": self.taken[t][1], "generated": self.taken[t][2]}
                for t in self.times]


# ----------------------------------------------------------------------------------------------- rates
def _half_decade(rate: float, direction: int) -> float:
    """The next rate of the 1, 3, 10, 30 ... sequence above (+1) or below (-1) `rate` (one of its members)."""
    exponent = math.floor(math.log10(rate) + 1e-9)
    mantissa = round(rate / 10**exponent)
    if mantissa not in (1, 3) or not math.isclose(rate, mantissa * 10**exponent, rel_tol=1e-9):
        raise ValueError(f"expected a rate of the form 1e-k or 3e-k, got {rate:g}")
    if direction > 0:
        mantissa, exponent = (3, exponent) if mantissa == 1 else (1, exponent + 1)
    else:
        mantissa, exponent = (3, exponent - 1) if mantissa == 1 else (1, exponent)
    return float(f"{mantissa}e{exponent}")


def _pilot_areas(pilot_runs: Sequence[Mapping[str, Any]], arm: str) -> dict[float, list[float]]:
    areas: dict[float, list[float]] = {}
    for run in pilot_runs:
        if run["arm"] == arm and run.get("valid", True):
            areas.setdefault(float(run["lr"]), []).append(run["metrics"]["area"])
    return areas


def pilot_choice(pilot_runs: Sequence[Mapping[str, Any]], arm: str, grid: Sequence[float]) -> dict[str, Any] | None:
    """The rate of `grid` with the highest mean primary metric over the pilot seeds (tie to 3 decimals: the
    lower rate); None while a rate of the grid lacks a pilot seed."""
    areas = _pilot_areas(pilot_runs, arm)
    if any(len(areas.get(lr, [])) != len(WALL_PILOT_SEEDS) for lr in grid):
        return None
    means = {lr: sum(areas[lr]) / len(areas[lr]) for lr in grid}
    best = max(means.values())
    chosen = min(lr for lr, m in means.items() if round(m, 3) == round(best, 3))
    return {"lr": chosen, "pilot_area_mean": {f"{lr:g}": means[lr] for lr in sorted(grid)}}


def pilot_grid(pilot_runs: Sequence[Mapping[str, Any]], arm: str) -> tuple[list[float], dict[str, Any] | None]:
    """The arm's grid so far and its final choice (None while pilots remain).

    The registered grid first; whenever a complete grid's choice is its top (bottom) rate, the next rate
    past that edge joins it; the choice is final when it is not an edge of a complete grid.
    """
    grid = sorted(WALL_LEARNING_RATES)
    while True:
        choice = pilot_choice(pilot_runs, arm, grid)
        if choice is None:
            return grid, None
        if grid[0] < choice["lr"] < grid[-1]:
            return grid, choice
        direction = 1 if choice["lr"] == grid[-1] else -1
        new = _half_decade(choice["lr"], direction)
        if not RATE_BOUNDS[0] <= new <= RATE_BOUNDS[1]:
            raise ValueError(f"{arm}: the pilots chose {choice['lr']:g}, an edge, and the next rate {new:g} lies "
                             f"outside {RATE_BOUNDS}: stop and report it as a deviation")
        grid = sorted([*grid, new])


def pilot_todo(pilot_runs: Sequence[Mapping[str, Any]], arms: Sequence[str]) -> list[tuple[str, float, int]]:
    """The pilot runs the current grids still lack, seed by seed, arms rotated, rates ascending."""
    todo = []
    grids = {arm: pilot_grid(pilot_runs, arm)[0] for arm in arms}
    for seed in WALL_PILOT_SEEDS:
        start = seed % len(arms)
        for arm in (*arms[start:], *arms[:start]):
            have = {float(r["lr"]) for r in pilot_runs
                    if r["arm"] == arm and r["seed"] == seed and r.get("valid", True)}
            todo += [(arm, lr, seed) for lr in grids[arm] if lr not in have]
    return todo


# ----------------------------------------------------------------------------------------------- runs
def wall_schedule(arms: Sequence[str], seeds: Sequence[int], lrs: Mapping[str, float | None]
                  ) -> list[tuple[str, float | None, int]]:
    """(arm, lr, seed) in the registered order: seed by seed, seed s starting with arm s mod the arm count."""
    out = []
    for seed in seeds:
        start = seed % len(arms)
        out += [(arm, lrs[arm], seed) for arm in (*arms[start:], *arms[:start])]
    return out


def attempts(runs: Sequence[Mapping[str, Any]], *, phase: str, arm: str, lr: float | None, seed: int
             ) -> tuple[bool, int]:
    """(whether a valid run of this key is logged, how many invalid ones are)."""
    mine = [r for r in runs if (r["phase"], r["arm"], r["lr"], r["seed"]) == (phase, arm, lr, seed)]
    return any(r.get("valid", True) for r in mine), sum(not r.get("valid", True) for r in mine)


def runs_to_do(runs: Sequence[Mapping[str, Any]], phase: str, schedule: Sequence[tuple[str, float | None, int]]
               ) -> list[tuple[str, float | None, int, int]]:
    """(arm, lr, seed, attempt) of each scheduled run without a valid run in the log, in schedule order.

    `attempt` numbers the invalid runs before it (0: the first try); a key with `MAX_ATTEMPTS` invalid runs is
    an error: pinning that never takes, or a crash that repeats, is not bad luck.
    """
    out = []
    for arm, lr, seed in schedule:
        valid, invalid = attempts(runs, phase=phase, arm=arm, lr=lr, seed=seed)
        if valid:
            continue
        if invalid >= MAX_ATTEMPTS:
            raise RuntimeError(f"{phase} {arm} lr={lr} seed {seed}: {invalid} invalid runs in a row (see their "
                               "'invalid' causes in the run log); fix the cause before running again")
        out.append((arm, lr, seed, invalid))
    return out


def wall_metrics(run: Mapping[str, Any], budget_s: float) -> dict[str, Any]:
    """The primary metric and the secondary ones of one wall-clock run (`run["snapshots"]` evaluated)."""
    snapshots = run["snapshots"]
    updates = run["updates"]
    last = updates[-1] if updates else {}
    trained = sum(u["num_episodes"] or 0 for u in updates)
    generated = snapshots[-1]["generated"]
    lags = [u["policy_lag_mean"] for u in updates if u.get("policy_lag_mean") is not None]
    accepted = [u["accepted_fraction"] for u in updates if u.get("accepted_fraction") is not None]
    drifts = [u["drift_mean"] for u in updates if u.get("drift_mean") is not None]
    drift_max = [u["drift_max"] for u in updates if u.get("drift_max") is not None]
    return {
        "area": area_to_budget(snapshots, budget_s, x="t"),
        "accuracy_at_budget": accuracy_at(snapshots, budget_s, x="t"),
        "initial_accuracy": snapshots[0]["accuracy"],
        "time_to_target": time_to_reach(snapshots, WALL_TARGET, x="t"),
        "updates": len(updates),
        "generated_at_budget": generated,
        "trained_at_budget": trained,
        "generated_per_s": generated / budget_s,
        "trained_per_s": trained / budget_s,
        "started_at_last_update": last.get("started_lifetime"),
        "policy_lag_mean": sum(lags) / len(lags) if lags else None,
        "accepted_fraction_mean": sum(accepted) / len(accepted) if accepted else None,
        "drift_mean": sum(drifts) / len(drifts) if drifts else None,
        "drift_max": max(drift_max) if drift_max else None,
        "busy_fraction": run["busy_fraction"],
        "tool_calls_initial": snapshots[0].get("tool_calls_mean"),
        "tool_calls_final": snapshots[-1].get("tool_calls_mean"),
        "turns_final": snapshots[-1].get("turns_mean"),
        **episode_durations(updates),
    }


def episode_durations(updates: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The trained episodes' wall times (the stragglers), from each batch's min / mean / max.

    ``episode_s_mean``: the mean over batches of the batch's mean; ``episode_s_batch_max_mean``: of the
    batch's longest episode, the one a barrier waits for; ``episode_s_min`` / ``_max``: the shortest and the
    longest of the run; ``episode_s_updates``: how many batches recorded them (None everywhere when none did).
    """
    rows = [u for u in updates if u.get("episode_s_mean") is not None]
    if not rows:
        return {"episode_s_updates": 0, "episode_s_mean": None, "episode_s_batch_max_mean": None,
                "episode_s_min": None, "episode_s_max": None}
    return {
        "episode_s_updates": len(rows),
        "episode_s_mean": sum(u["episode_s_mean"] for u in rows) / len(rows),
        "episode_s_batch_max_mean": sum(u["episode_s_max"] for u in rows) / len(rows),
        "episode_s_min": min(u["episode_s_min"] for u in rows),
        "episode_s_max": max(u["episode_s_max"] for u in rows),
    }


def area_over_generated(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per seed: N, the smallest generated count at the budget among that seed's runs, and each run's area
    under held-out accuracy over generated rollouts on [0, N] (the secondary comparable with evidence-2).

    A run whose first snapshot after 0 already lies past N is cut there by interpolation (`area_to_budget`).
    """
    out: dict[str, Any] = {}
    for seed in sorted({r["seed"] for r in runs}):
        mine = [r for r in runs if r["seed"] == seed]
        n = min(r["snapshots"][-1]["generated"] for r in mine)
        out[str(seed)] = {
            "N": n,
            "area": {r["arm"]: area_to_budget(r["snapshots"], n, x="generated") if n > 0 else None for r in mine},
        }
    return out
