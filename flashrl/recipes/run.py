"""Running a tuned example: parse the shared flags, then either print the plan or train.

A tuned example is a preset plus a function that builds its config::

    PRESET = Preset(name="...", success_metric="evaluation/episode_return_mean", success_threshold=0.7, ...)

    def make_config(args) -> FlashReinforceConfig:
        return FlashReinforceConfig().environment(...).env_runners(...).training(...)

    if __name__ == "__main__":
        sys.exit(run_preset(PRESET, make_config))

Exit codes: 0 success (or a coherent plan), 1 `--as-test` threshold missed or an incoherent plan,
2 an invalid config or command line, 3 `--dry-run --strict` with a missing prerequisite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flashrl.loggers.rewind import discarded_path, rewind_jsonl
from flashrl.recipes.args import (
    apply_overrides,
    default_output,
    find_checkpoint,
    node_plan_from_args,
    recipe_parser,
)
from flashrl.recipes.plan import EXIT_INVALID_CONFIG, dry_run_report, start_memory_warning
from flashrl.recipes.preset import Preset
from flashrl.recipes.storage import RemoteOutput, StorageError, is_uri

__all__ = ["TrainSummary", "build_config", "run_built", "run_preset", "train"]

ConfigFactory = Callable[[argparse.Namespace], Any]


def build_config(
    preset: Preset,
    make_config: ConfigFactory,
    argv: Sequence[str] | None = None,
    *,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    find_resume_checkpoint: bool = True,
) -> tuple[Any, argparse.Namespace]:
    """Parse `argv`, build the preset's config and apply the overrides; does not validate.

    With `--resume`, `args.resume` becomes the checkpoint folder and `args.output` its run's folder
    (unless `find_resume_checkpoint` is False: a Tune sweep restores its experiment folder itself).
    """
    parser = recipe_parser(preset)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    args.upload_to = None
    if is_uri(args.output):  # shared storage: written into a local staging folder, uploaded by the driver
        if getattr(args, "resume", None):
            parser.exit(EXIT_INVALID_CONFIG, f"{parser.prog}: error: --resume with --output {args.output!r}: "
                        "expected a local or mounted run folder. Fix: download the checkpoint and pass its path\n")
        args.upload_to, args.output = args.output, default_output(preset.name)
    if getattr(args, "resume", None) and not args.dry_run and find_resume_checkpoint:
        try:
            checkpoint, run = find_checkpoint(args.resume, args.output, preset.name)
        except FileNotFoundError as err:
            parser.exit(EXIT_INVALID_CONFIG, f"{parser.prog}: error: {err}\n")
        args.resume, args.output = str(checkpoint), str(run)  # the resumed run writes where it did
    args.output_given = args.output is not None
    if args.output is None:
        args.output = default_output(preset.name)
    config = make_config(args)
    if getattr(args, "checkpoint_frequency", None) is None:  # --checkpoint-frequency N: by updates only
        with_periodic_checkpoints(config, preset)
    try:
        apply_overrides(config, args)
    except ValueError as err:  # ConfigError from update_from_dict
        parser.exit(EXIT_INVALID_CONFIG, f"{parser.prog}: error: {err}\n")
    output = Path(args.output).expanduser()
    if (config.checkpoint_frequency or config.checkpoint_interval_minutes) and not config.checkpoint_dir:
        config.checkpointing(checkpoint_dir=str(output / "checkpoints"))
    if config.tensorboard and not config.log_dir:
        config.reporting(log_dir=str(output / "tensorboard"))
    return config, args


def with_periodic_checkpoints(config: Any, preset: Preset) -> None:
    """A config that saves no periodic checkpoint gets the preset's (every 10 updates or 10 minutes, the
    newest 2 kept), so a killed run resumes (`--resume`) instead of starting over. A config's own
    `checkpointing(...)` or `--checkpoint-frequency N` (0: none) decide otherwise."""
    if config.checkpoint_frequency or config.checkpoint_interval_minutes:
        return
    config.checkpointing(
        checkpoint_frequency=preset.checkpoint_frequency,
        checkpoint_interval_minutes=preset.checkpoint_interval_minutes,
        num_checkpoints_to_keep=preset.num_checkpoints_to_keep,
    )


def validate_or_exit(config: Any) -> int:
    """0 when the config is valid; otherwise print its error and return 2."""
    try:
        config.validate()
    except ValueError as err:  # ConfigError: expected, actual, fix
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INVALID_CONFIG
    return 0


def run_preset(
    preset: Preset,
    make_config: ConfigFactory,
    argv: Sequence[str] | None = None,
    *,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    """The main of a tuned example: returns the process exit code (see the module docstring)."""
    config, args = build_config(preset, make_config, argv, add_arguments=add_arguments)
    return run_built(preset, config, args)


def run_built(preset: Preset, config: Any, args: argparse.Namespace) -> int:
    """Validate a built config, then print its plan (`--dry-run`) or train it."""
    code = validate_or_exit(config)
    if code:
        return code
    if args.dry_run:
        data_paths = {label: getattr(args, dest, None) for label, dest in preset.data_args.items()}
        report = dry_run_report(preset, config, node_plan_from_args(args), data_paths=data_paths)
        print(report.render(strict=args.strict), flush=True)
        return report.exit_code(strict=args.strict)
    try:
        summary = train(
            config, preset, stop_iters=args.stop_iters, stop_reward=args.stop_reward, output=args.output,
            resume=getattr(args, "resume", None), upload_to=getattr(args, "upload_to", None),
        )
    except StorageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INVALID_CONFIG
    if args.as_test and not summary.reached:
        print(
            f"--as-test FAILED: {preset.success_metric} = {summary.value:.4f} < {args.stop_reward} after "
            f"{summary.iterations} iterations.",
            file=sys.stderr,
        )
        return 1
    if args.as_test:
        print(f"--as-test PASSED: {preset.success_metric} = {summary.value:.4f} >= {args.stop_reward}.")
    return 0


# --------------------------------------------------------------------------------------------------
class TrainSummary:
    """What a training run ended with."""

    def __init__(
        self,
        metric: str,
        value: float,
        threshold: float,
        iterations: int,
        output: str,
        before: dict[str, float] | None,
        after: dict[str, float] | None,
        checkpoint: str,
    ) -> None:
        self.metric, self.value, self.threshold = metric, value, threshold
        self.iterations, self.output, self.checkpoint = iterations, output, checkpoint
        self.before, self.after = before, after

    @property
    def reached(self) -> bool:
        return math.isfinite(self.value) and self.value >= self.threshold

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "value": self.value,
            "threshold": self.threshold,
            "reached": self.reached,
            "iterations": self.iterations,
            "checkpoint": self.checkpoint,
            "evaluation_before": self.before,
            "evaluation_after": self.after,
        }


def train(
    config: Any,
    preset: Preset,
    *,
    stop_iters: int,
    stop_reward: float,
    output: str,
    resume: str | None = None,
    upload_to: str | None = None,
) -> TrainSummary:
    """Train until `stop_iters` updates (at most the horizon of `num_epochs` passes over the real training
    set, when set), `preset.success_metric >= stop_reward` or a callback's stop.

    Writes into `output`: TensorBoard logs (`tensorboard/`), one JSON line of metrics per iteration
    (`progress.jsonl`), the final checkpoint (`checkpoint_final/`), the reward / evaluation curve
    (`curves.png`) and `result.json`. With evaluation configured, the policy is evaluated before the
    first update and after the last one (same held-out episodes); both evaluations are rows of
    `progress.jsonl` (iteration 0 and the last) and go to TensorBoard and the run's loggers.

    With `resume` (a checkpoint folder) the run continues from it: the learner state (weights,
    optimizer, schedule, RNG), the data cursors, the iteration and the policy version are the
    checkpoint's; `stop_iters` counts from the run's start. The logs continue the checkpoint's
    timeline: rows past its iteration move to `progress.discarded.jsonl`, TensorBoard purges those
    steps (`flashrl.loggers.rewind`), a row ``{"resumed_from_iteration": N}`` marks the seam. No
    evaluation is repeated before training; `result.json` keeps the first start's one.

    ``output`` may be a `pyarrow.fs` URI (or ``upload_to`` one): the run then writes into a local staging
    folder and uploads to it, each periodic checkpoint as it is written and everything at the end, also
    after a failure (`flashrl.recipes.storage`).
    """
    if is_uri(output):
        upload_to, output = output, default_output(preset.name)
    remote = RemoteOutput.resolve(upload_to) if upload_to else None
    out = Path(output).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"outputs: {out}" + (f" (uploaded to {remote.uri})" if remote else ""), flush=True)
    config = config.copy()
    if config.tensorboard and not config.log_dir:
        config.reporting(log_dir=str(out / "tensorboard"))
    if (config.checkpoint_frequency or config.checkpoint_interval_minutes) and not config.checkpoint_dir:
        config.checkpointing(checkpoint_dir=str(out / "checkpoints"))
    evaluating = config.evaluation_interval is not None
    if resume:  # before the restored run needs the space: what an interrupted save of this run left
        _remove_interrupted_saves(out, config.checkpoint_dir)
    warning = start_memory_warning(config)
    if warning:  # the dry run's warning, against this machine's memory
        print(f"WARNING: {warning}", file=sys.stderr, flush=True)

    def after_iteration() -> None:
        """With a URI output: upload each new checkpoint (and the logs up to it) as soon as it is written."""
        folder = Path(config.checkpoint_dir) if config.checkpoint_dir else None
        new = remote is not None and folder is not None and folder.is_dir() and remote.sync_checkpoints(folder)
        for name in ("tensorboard", "progress.jsonl") if new else ():
            if (out / name).exists():
                remote.upload(out / name, name)

    algo = config.build_algo()
    if config.num_epochs is not None and algo.total_updates < stop_iters:
        # the horizon of num_epochs passes over the real set: the run ends with its last pass, as Molt's does
        print(f"stopping after {algo.total_updates} updates: {config.num_epochs} passes over the training set "
              f"(--stop-iters {stop_iters} assumed a larger set)", flush=True)
        stop_iters = algo.total_updates
    algo.progress.stop = stop_iters  # the console's progress line counts to this run's stop
    history: list[dict[str, float]] = []
    latest: dict[str, float] = {}
    before = after = None
    progress = out / "progress.jsonl"
    try:
        if resume:
            algo.restore_from_path(resume)  # the algorithm's loggers rewind to the checkpoint too
            rewind_jsonl(progress, algo.iteration)
            history += _read_progress(progress, up_to=algo.iteration)
            row = _missing_checkpoint_row(resume, algo.iteration, history)
            if row is not None:  # killed after the checkpoint was saved, before its row was written
                history.append(row)
                _append_row(progress, row)
            before = _first_evaluation(history)
            _append_row(progress, {"resumed_from_iteration": float(algo.iteration)})
            print(f"resumed from {resume}: iteration {algo.iteration}, policy version "
                  f"{algo.learner_group.version}", flush=True)
        else:
            progress.write_text("", encoding="utf-8")  # a fresh run's timeline
        if evaluating and not resume:
            before = algo.evaluate()
            latest.update(before)
            print(f"evaluation before training: {_eval_line(before)}", flush=True)
            _record_evaluation(algo, progress, history, 0, before)
        iterations = _train_loop(
            algo, preset.success_metric, stop_iters, stop_reward, out, history, latest, after_iteration
        )
        if evaluating:
            last = history[-1]
            reused = "evaluation/episode_return_mean" in last and last.get("training_iteration") == iterations
            if reused:  # the last iteration evaluated already, on the same episodes
                after = {k: v for k, v in last.items() if k.startswith("evaluation/")}
            else:
                after = algo.evaluate()
                _record_evaluation(algo, progress, history, iterations, after)
            latest.update(after)
            print(f"evaluation after {iterations} updates: {_eval_line(after)}", flush=True)
        checkpoint = algo.save_to_path(str(out / "checkpoint_final"))
    except BaseException:
        if remote is not None:  # what the failed run wrote is not lost with this node
            try:
                remote.upload_run(out)
            except Exception:  # noqa: BLE001 - the run's own error is the one to raise
                print(f"uploading {out} to {remote.uri} failed too", file=sys.stderr)
        raise
    finally:
        algo.stop()
    value = float(latest.get(preset.success_metric, math.nan))
    summary = TrainSummary(
        preset.success_metric, value, stop_reward, iterations, str(out), before, after, checkpoint
    )
    plot_curves(history, out / "curves.png", title=preset.name)
    (out / "result.json").write_text(json.dumps(summary.to_dict(), indent=2), encoding="utf-8")
    if remote is not None:
        remote.upload_run(out)
        print(f"uploaded to {remote.uri}", flush=True)
    if before and after:
        key = "evaluation/episode_return_mean"
        print(f"held-out {key}: {before.get(key, math.nan):.3f} -> {after.get(key, math.nan):.3f}")
    print(f"checkpoint: {checkpoint}\ncurves: {out / 'curves.png'}\nTensorBoard: tensorboard --logdir {out}")
    return summary


def _train_loop(
    algo: Any,
    metric: str,
    stop_iters: int,
    stop_reward: float,
    out: Path,
    history: list[dict[str, float]],
    latest: dict[str, float],
    after_iteration: Callable[[], None] = lambda: None,
) -> int:
    """`algo.train()` until the algorithm's iteration reaches `stop_iters`, `metric >= stop_reward` or a
    callback's ``result["should_stop"]``; one JSON line per iteration appended to `out/progress.jsonl`,
    labelled with the algorithm's iteration, then `after_iteration()` (the uploads of a URI output).

    A learner restart inside `algo.train()` resumes from the run's newest checkpoint and returns the
    iteration after it: the rows past that checkpoint move to ``progress.discarded.jsonl`` (as on
    `--resume`), a row ``{"learners_restarted_from_iteration": N}`` marks the seam, and the lost updates
    are trained again, so the run still ends at `stop_iters`.
    """
    progress = out / "progress.jsonl"
    iterations = int(algo.iteration)
    while iterations < stop_iters:
        result = algo.train()
        done = int(algo.iteration)  # one past the checkpoint a learner restart resumed from; else iterations + 1
        if done <= iterations:
            _rewind_history(progress, history, latest, done - 1)
            _append_row(progress, {"learners_restarted_from_iteration": float(done - 1)})
            print(f"the learners restarted from iteration {done - 1}: the {iterations - done + 1} row(s) after "
                  f"it moved to {discarded_path(progress)}", flush=True)
        iterations = done
        row = _result_row(result, iterations)
        history.append(row)
        latest.update(row)
        _append_row(progress, row)
        after_iteration()
        if latest.get(metric, -math.inf) >= stop_reward:
            print(f"{metric} = {latest[metric]:.4f} >= {stop_reward}: stopping.")
            break
        if result.get("should_stop"):  # a callback asked (flashrl.callbacks.SHOULD_STOP)
            print(f"a callback set should_stop after iteration {iterations}: stopping.")
            break
    return iterations


def _result_row(result: dict[str, Any], iteration: int) -> dict[str, float]:
    """A row of progress.jsonl: the result's numbers, labelled with the algorithm's iteration."""
    row = {k: float(v) for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    row["training_iteration"] = float(iteration)
    return row


def _rewind_history(
    progress: Path, history: list[dict[str, float]], latest: dict[str, float], iteration: int
) -> None:
    """The run's timeline back to ``iteration``: progress.jsonl cut there (the rest to its side file),
    the curves' rows and the latest metrics rebuilt from what is left."""
    rewind_jsonl(progress, iteration)
    history[:] = [row for row in history if row.get("training_iteration", 0) <= iteration]
    latest.clear()
    for row in history:
        latest.update(row)


def _missing_checkpoint_row(checkpoint: str, iteration: int, history: list[dict[str, float]]) -> dict[str, float] | None:
    """The row of the checkpoint's own iteration when progress.jsonl lacks it, rebuilt from the result the
    checkpoint recorded (`flashrl.algorithms.flash_reinforce.algorithm.RESULT_KEY`); None when the row is
    there, or the checkpoint recorded none (a final or hand-made save)."""
    if iteration < 1 or any(row.get("training_iteration") == iteration for row in history):
        return None
    from flashrl.algorithms.flash_reinforce.algorithm import RESULT_KEY
    from flashrl.checkpoints import read_checkpoint

    recorded = read_checkpoint(checkpoint, verify=False).algorithm_state.get(RESULT_KEY)
    return None if not isinstance(recorded, dict) else _result_row(recorded, iteration)


def _remove_interrupted_saves(out: Path, checkpoint_dir: str | None) -> None:
    """Remove the partial saves of this run that a kill left (flashrl's own ``.tmp``/``.old`` folders only)."""
    from flashrl.checkpoints import remove_interrupted_saves

    removed = [out / name for name in remove_interrupted_saves(out, names=("checkpoint_final",))]
    if checkpoint_dir:
        removed += [Path(checkpoint_dir) / name for name in remove_interrupted_saves(checkpoint_dir)]
    for path in removed:
        print(f"removed {path}: an interrupted save of this run", flush=True)


def _append_row(path: Path, row: dict[str, float]) -> None:
    with open(path, "a", encoding="utf-8") as log:
        log.write(json.dumps(row) + "\n")


def _record_evaluation(
    algo: Any, progress: Path, history: list[dict[str, float]], iteration: int, metrics: dict[str, float]
) -> None:
    """A recipe's evaluation (before the first update, after the last) as a row of the curves, of
    progress.jsonl and of the algorithm's loggers (TensorBoard, progress files, trackers)."""
    row = {"training_iteration": float(iteration), **metrics}
    history.append(row)
    _append_row(progress, row)
    algo.log_metrics(iteration, metrics)


def _first_evaluation(history: list[dict[str, float]]) -> dict[str, float] | None:
    """The evaluation before the first update, as the run's first start recorded it (None: none)."""
    for row in history:
        if row.get("training_iteration") == 0 and "evaluation/episode_return_mean" in row:
            return {k: v for k, v in row.items() if k.startswith("evaluation/")}
    return None


def _read_progress(path: Path, *, up_to: int) -> list[dict[str, float]]:
    """The rows of an earlier part of the run, up to the checkpoint's iteration (for the curves)."""
    rows = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            if "training_iteration" in row and row["training_iteration"] <= up_to:
                rows.append(row)
    return rows


def _eval_line(metrics: dict[str, float]) -> str:
    return (
        f"return {metrics.get('evaluation/episode_return_mean', math.nan):.3f} over "
        f"{int(metrics.get('evaluation/num_episodes', 0))} episodes"
    )


def plot_curves(history: list[dict[str, float]], path: str | os.PathLike[str], *, title: str) -> str:
    """Training return (batch and smoothed) and evaluation return per iteration, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (
        ("env_runners/batch_episode_return_mean", "batch return"),
        ("env_runners/episode_return_mean", "return (smoothed)"),
    ):
        points = [(r["training_iteration"], r[key]) for r in history if key in r]
        if points:
            ax.plot(*zip(*points), label=label)
    evals = [
        (r["training_iteration"], r["evaluation/episode_return_mean"])
        for r in history
        if "evaluation/episode_return_mean" in r
    ]
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out evaluation")
    ax.set_xlabel("update")
    ax.set_ylabel("return")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
