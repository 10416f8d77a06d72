"""The command line every tuned example shares (RLlib's tuned-example flags plus the key hyperparameters).

A flag left out keeps the preset's value; a flag given overrides the matching config field. There is
no config language: the flags are config field names with dashes, and `--env-config` takes a JSON
object that is merged into the environment's keyword arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from flashrl.recipes.preset import NodePlan, Preset

__all__ = ["OVERRIDES", "apply_overrides", "node_plan_from_args", "recipe_parser"]


def custom_resources(text: str) -> dict[str, float]:
    """``NAME=AMOUNT[,NAME=AMOUNT]`` (``rollout_node=1,ssd=0.5``) as the dict of Ray custom resources a
    ``custom_resources_per_*`` setting takes; malformed text is argparse's usage error (exit status 2).
    The names themselves are checked by the config (not CPU, GPU, memory) and against the cluster at setup."""
    out: dict[str, float] = {}
    for item in text.split(","):
        name, sep, amount = (part.strip() for part in item.partition("="))
        try:
            value = float(amount)
        except ValueError:
            value = math.nan
        problem = ("is not NAME=AMOUNT" if not sep or not name else f"names {name} a second time" if name in out
                   else "has an amount that is not a number >= 0" if not (math.isfinite(value) and value >= 0) else "")
        if problem:
            raise argparse.ArgumentTypeError(
                f"expected NAME=AMOUNT[,NAME=AMOUNT] (each name once, amounts >= 0), got {text!r}: {item.strip()!r} "
                f"{problem}. Fix: e.g. rollout_node=1 or rollout_node=1,ssd=0.5"
            )
        out[name] = value
    return out


# flag dest -> (config field, type, help). Builder-method routing is not needed: the config's
# `update_from_dict` sets any field by name and rejects unknown ones.
OVERRIDES: dict[str, tuple[str, Any, str]] = {
    "num_env_runners": ("num_env_runners", int, "EnvRunner actors (each hosts one inference engine)"),
    "num_learners": ("num_learners", int, "Learner actors (0 = one learner in the driver process)"),
    "num_gpus_per_learner": ("num_gpus_per_learner", float, "GPUs per learner"),
    "num_gpus_per_env_runner": ("num_gpus_per_env_runner", float, "GPUs per env runner (its engine)"),
    "num_cpus_per_env_runner": ("num_cpus_per_env_runner", float, "CPUs per env runner"),
    "num_cpus_per_learner": ("num_cpus_per_learner", float, "CPUs per learner"),
    "custom_resources_per_env_runner": (
        "custom_resources_per_env_runner",
        custom_resources,
        "Ray custom resources per env runner, NAME=AMOUNT[,NAME=AMOUNT]: pins the runners to nodes that offer them",
    ),
    "custom_resources_per_learner": (
        "custom_resources_per_learner",
        custom_resources,
        "Ray custom resources per learner actor, NAME=AMOUNT[,NAME=AMOUNT]: pins the learners to nodes that offer them",
    ),
    "model": ("model", str, "policy: flashrl model name, local HF folder or hub id"),
    "engine": ("engine", str, "inference engine: vllm or torch"),
    "dtype": ("dtype", str, "learner dtype: float32 or bfloat16"),
    "lr": ("lr", float, "learning rate"),
    "lora_rank": ("lora_rank", int, "train a LoRA adapter of this rank instead of every weight (docs/training.md)"),
    "lora_alpha": ("lora_alpha", float, "LoRA alpha: the adapter's update is scaled by alpha / rank"),
    "lora_targets": ("lora_target_modules", str, "layers LoRA adapts: all-linear, or names like q_proj,v_proj"),
    "delta": ("delta", float, "Sequence Trust Region threshold on the mean token drift"),
    "train_batch_size": ("train_batch_size", int, "B: trajectories per update"),
    "temperature": ("temperature", float, "sampling temperature"),
    "max_new_tokens": ("max_new_tokens", int, "tokens per model turn"),
    "max_episode_tokens": ("max_episode_tokens", int, "context budget of an episode"),
    "episodes_in_flight": ("episodes_in_flight_per_env_runner", int, "concurrent episodes per env runner"),
    "trust_region": ("trust_region", str, "bernoulli_kl (the method), bernoulli_kl_exact, tv or none"),
    "aggregation": ("aggregation", str, "sample_mean (the method), token_mean or constant_length"),
    "baseline": ("baseline", str, "batch_mean, none, leave_one_out, group_mean, group_norm"),
    "rollout_mode": ("rollout_mode", str, "async (the method) or sync_group (the GRPO-style baseline)"),
    "group_size": ("group_size", int, "rollouts per prompt in sync_group mode"),
    "negative_token_fraction": (
        "negative_token_fraction",
        float,
        "q: a failed episode trains on its ceil(q T) highest-entropy tokens (1 = off)",
    ),
    "importance_sampling": ("importance_sampling", str, "token (the method) or none (the no_is ablation)"),
    "weight_decay": ("weight_decay", float, "decoupled weight decay"),
    "lr_schedule": ("lr_schedule", str, "constant or cosine_with_min_lr"),
    "async_queue_size": ("async_queue_size", int, "batches sampling may run ahead of the learner"),
    "evaluation_interval": ("evaluation_interval", int, "evaluate every N iterations"),
    "evaluation_num_episodes": ("evaluation_num_episodes", int, "episodes per evaluation"),
    "seed": ("seed", int, "seed of learner, engines and prompt stream"),
    "checkpoint_frequency": ("checkpoint_frequency", int, "save a checkpoint every N iterations"),
    "rollout_dump_every": ("rollout_dump_every", int, "write sampled episodes (JSONL, flashrl show) every N iterations"),
    "rollout_dump_count": ("rollout_dump_count", int, "episodes per rollout dump"),
}


def recipe_parser(preset: Preset, *, description: str | None = None) -> argparse.ArgumentParser:
    """The tuned examples' shared command line, defaults from `preset` (a script may add flags)."""
    parser = argparse.ArgumentParser(
        description=description or preset.description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    run = parser.add_argument_group("run")
    run.add_argument("--stop-iters", type=int, default=preset.stop_iters, help="stop after this many updates")
    run.add_argument(
        "--stop-reward",
        type=float,
        default=preset.success_threshold,
        help=f"stop once {preset.success_metric} reaches this value",
    )
    run.add_argument(
        "--as-test",
        action="store_true",
        help="exit non-zero unless --stop-reward was reached (a learning test)",
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (config, actors, memory, versions, prerequisites) and exit; "
        "starts no worker and downloads nothing",
    )
    run.add_argument(
        "--strict",
        action="store_true",
        help="with --dry-run: also exit non-zero (3) on a missing prerequisite or a memory warning",
    )
    run.add_argument(
        "--output",
        default=None,
        help="log dir: TensorBoard, progress.jsonl, checkpoints, curves.png (default: "
        f"$FLASHRL_RESULTS or ~/flashrl_results, then {preset.name}/<UTC time>; outside the working dir, so "
        "the outputs of a `ray job submit` outlive the job's temporary copy of it)",
    )
    run.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH|latest",
        help="continue a run from a checkpoint folder, or (`--resume` alone, `latest`) from the newest "
        "checkpoint of --output's run, else of this preset's newest run under the results root; the run "
        "appends to its progress and TensorBoard logs and keeps its schedule, RNG, data cursor and versions",
    )
    config = parser.add_argument_group("config overrides (default: the preset's value)")
    for dest, (_, type_, help_) in OVERRIDES.items():
        config.add_argument("--" + dest.replace("_", "-"), dest=dest, type=type_, default=None, help=help_)
    config.add_argument(
        "--env-config",
        type=json.loads,
        default=None,
        help='JSON object merged into env_config, e.g. \'{"tasks": "data/train.jsonl"}\'',
    )
    plan = preset.node_plan
    nodes = parser.add_argument_group("node plan (what --dry-run checks the placement against)")
    nodes.add_argument("--num-nodes", type=int, default=plan.num_nodes, help="nodes in the cluster")
    nodes.add_argument("--gpus-per-node", type=int, default=plan.gpus_per_node, help="GPUs per node")
    nodes.add_argument("--cpus-per-node", type=int, default=plan.cpus_per_node, help="CPUs per node")
    nodes.add_argument("--gpu-memory-gib", type=float, default=plan.gpu_memory_gib, help="memory of one GPU")
    nodes.add_argument("--host-memory-gib", type=float, default=plan.host_memory_gib, help="RAM of one node")
    return parser


def apply_overrides(config: Any, args: argparse.Namespace) -> Any:
    """Set every config field whose flag was given; returns the same config."""
    changes = {}
    for dest, (field_name, _, _) in OVERRIDES.items():
        value = getattr(args, dest, None)
        if value is not None:
            changes[field_name] = value
    env_config = getattr(args, "env_config", None)
    if env_config is not None:
        if not isinstance(env_config, dict):
            print(f"error: --env-config: expected a JSON object, got {env_config!r}.", file=sys.stderr)
            raise SystemExit(2)
        changes["env_config"] = {**config.env_config, **env_config}
    if changes:
        config.update_from_dict(changes)
    return config


def node_plan_from_args(args: argparse.Namespace) -> NodePlan:
    """The node plan of `--num-nodes` & co; a bad value exits with status 2 and the reason."""
    try:
        return NodePlan(
            num_nodes=args.num_nodes,
            gpus_per_node=args.gpus_per_node,
            cpus_per_node=args.cpus_per_node,
            gpu_memory_gib=args.gpu_memory_gib,
            host_memory_gib=args.host_memory_gib,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from err


RESULTS_ROOT_ENV = "FLASHRL_RESULTS"


def default_output(name: str, now: datetime.datetime | None = None) -> str:
    """``$FLASHRL_RESULTS`` (else ``~/flashrl_results``) / name / the UTC start time, like Tune's
    ``~/ray_results``: a run's outputs must not live in the working dir, which ``ray job submit
    --working-dir .`` copies into a temporary package that is deleted with the cluster's session."""
    root = Path(os.environ.get(RESULTS_ROOT_ENV) or "~/flashrl_results").expanduser()
    stamp = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%d_%H-%M-%S")
    return str(root / name / stamp)


def find_checkpoint(resume: str, output: str | None, name: str) -> tuple[Path, Path]:
    """(checkpoint folder, its run's output folder) for ``--resume PATH|latest``.

    ``latest`` takes the newest checkpoint of the run folder ``output`` (the periodic checkpoint that
    ``checkpoints/latest`` names, else the highest ``checkpoints/checkpoint_N``, or ``checkpoint_final``,
    whichever has the higher iteration), or with no ``output`` of this preset's newest run folder under
    the results root that holds one.
    """
    if resume != "latest":
        path = Path(resume).expanduser().resolve()
        if not path.is_dir():
            raise FileNotFoundError(f"--resume: expected a checkpoint folder, got {resume!r} (not a folder)")
        run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        return path, Path(output).expanduser().resolve() if output else run
    if output:
        runs = [Path(output).expanduser().resolve()]
    else:
        root = Path(os.environ.get(RESULTS_ROOT_ENV) or "~/flashrl_results").expanduser() / name
        runs = sorted((p for p in root.glob("*") if p.is_dir()), reverse=True)  # UTC stamps sort by time
    for run in runs:
        found = _newest_checkpoint(run)
        if found is not None:
            return found, run
    where = runs[0] if output else Path(os.environ.get(RESULTS_ROOT_ENV) or "~/flashrl_results") / name
    raise FileNotFoundError(
        f"--resume latest: expected a checkpoint under {where} (checkpoints/checkpoint_N or checkpoint_final), "
        "found none. Fix: pass --resume PATH, or --output the run's folder"
    )


def _checkpoint_iteration(path: Path) -> int | None:
    """The iteration a complete checkpoint folder was saved at; None for anything else."""
    from flashrl.checkpoints import ALGORITHM_STATE_FILE, MARKER, CheckpointError, open_regular

    if not (path / MARKER).is_file():
        return None
    try:  # a regular file only: a FIFO planted in a run folder must not block --resume
        with os.fdopen(open_regular(path / ALGORITHM_STATE_FILE, root=path), encoding="utf-8") as file:
            return int(json.loads(file.read())["iteration"])
    except (OSError, ValueError, KeyError, TypeError, CheckpointError):
        return None


def _newest_checkpoint(run: Path) -> Path | None:
    """The periodic checkpoint ``checkpoints/latest`` names (else the complete ones there), or the final one."""
    from flashrl.checkpoints import CHECKPOINT_NAME, latest_checkpoint

    pointed = latest_checkpoint(run / "checkpoints")
    if pointed is not None:  # the newest save, also after a resume from an older checkpoint
        candidates = [Path(pointed)]
    else:  # written before `latest` existed: by iteration (never an interrupted save's .tmp folder)
        candidates = [p for p in (run / "checkpoints").glob("checkpoint_*")
                      if p.is_dir() and CHECKPOINT_NAME.fullmatch(p.name)]
    candidates += [p for p in [run / "checkpoint_final"] if p.is_dir()]
    dated = [(_checkpoint_iteration(p), p) for p in candidates]
    dated = [(i, p) for i, p in dated if i is not None]
    return max(dated)[1] if dated else None
