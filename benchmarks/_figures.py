"""A benchmark report's PNGs: accuracy curves, bar panels, the learner's side of each run."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from _tensorboard import write_tensorboard


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



def write_training_outputs(
    report: Mapping[str, Any],
    series: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]],
    *,
    figure: str | os.PathLike[str],
    tensorboard: str | os.PathLike[str],
    title: str,
) -> None:
    """Next to a benchmark's main PNG: `<figure stem>_training.png` (`plot_training`), and its runs
    as TensorBoard runs (`write_tensorboard`)."""
    training_figure = Path(figure).with_name(f"{Path(figure).stem}_training.png")
    print(f"wrote {plot_training(series, training_figure, title=title)}")
    write_tensorboard(report, tensorboard)
    print(f"TensorBoard: tensorboard --logdir {tensorboard}")
