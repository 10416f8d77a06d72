"""Launch a reference FlashREINFORCE experiment on NVIDIA Molt 0.2.1 (registry package molt-rl).

    python scripts/train_molt.py --dry-run                                   # r1, placeholders shown
    python scripts/train_molt.py --recipe qwen_math --variant gate_1e3 --dry-run
    python scripts/train_molt.py --recipe r1 --train-data /data/r1/train --eval-data /data/r1/eval \\
        --agent-path /molt/examples/python/agents/math.py --actor-gpus 1 --rollout-gpus 7

The values come from the same table as the tuned examples (flashrl/reproduction/experiments.py, copied from
the reference `yifanzhang-pro/FlashREINFORCE`); flashrl/reproduction/molt.py turns them into Molt 0.2.1's
flags. `--dry-run` prints the command and checks it against the recorded 0.2.1 flag list
(flashrl/reproduction/molt_rl_0_2_1_flags.py); it needs neither Molt, nor data, nor a GPU. Without
`--dry-run` the script checks that molt-rl 0.2.1 is installed and that its `--help` lists every
flag about to be passed, then runs Molt in the foreground. It never starts or stops a Ray cluster:
start one first (`ray start --head`). An experiment Molt 0.2.1 cannot run (a failure-token filter
q < 1, `no_is`, `constant_length`) is refused with the reason; run those natively with flashrl.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

# a clean checkout works without installing flashrl: the table needs nothing beyond the standard library
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashrl.reproduction.experiments import (
    EXPERIMENTS,
    ExperimentError,
    ResolvedExperiment,
    resolve_experiment,
)
from flashrl.reproduction.molt import MOLT_MODULE, MOLT_PACKAGE, MOLT_VERSION, Placement, molt_command

PLACEHOLDERS = {
    "train_data": "<TRAIN_DATA>",
    "eval_data": "<EVAL_DATA>",
    "agent_path": "<AGENT_PATH>",
}
EXIT_REFUSED = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--recipe", choices=sorted(EXPERIMENTS), default="r1", help="reference experiment")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME",
        help="a variant by the reference's name (repeatable, applied in order)",
    )
    parser.add_argument("--model", help="local checkpoint or hub id (default: the experiment's model)")
    parser.add_argument("--train-data", type=Path, help="Molt saved dataset for training")
    parser.add_argument("--eval-data", type=Path, help="Molt saved dataset for evaluation")
    parser.add_argument(
        "--agent-path",
        type=Path,
        help="Molt agent for the experiment's environment (default with --molt-path and a math experiment: "
        "the checkout's examples/python/agents/math.py)",
    )
    parser.add_argument("--molt-path", type=Path, help="a Molt source checkout (working directory)")
    parser.add_argument("--output", type=Path, default=Path("outputs/flashreinforce"), help="checkpoints")
    parser.add_argument("--actor-nodes", type=int, default=1, help="nodes of the FSDP actor")
    parser.add_argument("--actor-gpus", type=int, default=1, help="actor GPUs per node")
    parser.add_argument("--rollout-gpus", type=int, default=7, help="vLLM engines (x --rollout-tp GPUs)")
    parser.add_argument("--rollout-tp", type=int, default=1, help="tensor parallel size of an engine")
    parser.add_argument("--actor-tp", type=int, default=1, help="actor tensor parallel size")
    parser.add_argument("--actor-ep", type=int, default=1, help="actor expert parallel size (MoE)")
    parser.add_argument("--actor-cp", type=int, default=1, help="actor context parallel size")
    parser.add_argument(
        "--episodes", type=int, help="override train.num_episodes (dataset passes, not updates)"
    )
    parser.add_argument(
        "--delta", type=float, help="override the trust-region threshold (inf: no trust region)"
    )
    parser.add_argument("--attention", default="flash_attention_2", choices=["flash_attention_2", "te"])
    parser.add_argument("--print-config", action="store_true", help="print the resolved experiment as JSON")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the command only (no Molt, data or GPU needed)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    resolved = resolve_with_overrides(args, parser)
    if args.print_config:
        print(json.dumps(resolved.to_json(), indent=2))
        return 0
    check_placement(args, parser, resolved.flags["train.batch_size"])
    agent = args.agent_path
    if agent is None and args.molt_path is not None and resolved.experiment.agent_kind == "math":
        agent = args.molt_path / "examples/python/agents/math.py"
    given = {"train_data": args.train_data, "eval_data": args.eval_data, "agent_path": agent}
    missing = [name for name, value in given.items() if value is None]
    if missing and not args.dry_run:
        parser.error(
            "to run Molt, pass "
            + ", ".join("--" + name.replace("_", "-") for name in missing)
            + f" (the {resolved.experiment.agent_kind} experiment's agent and Molt saved datasets; "
            "see docs/training.md)"
        )
    paths = {
        name: PLACEHOLDERS[name] if value is None else str(value.expanduser().resolve())
        for name, value in given.items()
    }
    command = molt_command(
        resolved,
        model=args.model or resolved.experiment.model,
        output=str(args.output.expanduser().resolve()),
        placement=Placement(
            actor_nodes=args.actor_nodes,
            actor_gpus=args.actor_gpus,
            rollout_engines=args.rollout_gpus,
            rollout_tp=args.rollout_tp,
            actor_tp=args.actor_tp,
            actor_ep=args.actor_ep,
            actor_cp=args.actor_cp,
            attention=args.attention,
        ),
        **paths,
    )
    label = f"{resolved.name}" + "".join(f" --variant {v}" for v in resolved.variants)
    if command.refusals:
        # "setting": the word this line has always printed (scripts may match it)
        print(f"refused: Molt {MOLT_VERSION} cannot run setting {label}:", file=sys.stderr)
        for reason in command.refusals:
            print(f"  - {reason}", file=sys.stderr)
        return EXIT_REFUSED
    unknown = command.unknown_flags()
    if unknown:  # a bug in flashrl/reproduction/molt.py, never a user error
        print(f"error: flags not in Molt {MOLT_VERSION}'s recorded list: {unknown}", file=sys.stderr)
        return EXIT_REFUSED
    print_command(command, args, label, resolved.experiment.source, [PLACEHOLDERS[name] for name in missing])
    if args.dry_run:
        print(f"# dry run: every flag is in Molt {MOLT_VERSION}'s recorded list; nothing was started")
        return 0
    return launch(command, args, parser)


def resolve_with_overrides(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ResolvedExperiment:
    """The experiment with its variants, then `--episodes` and `--delta` (usage errors exit 2)."""
    try:
        resolved = resolve_experiment(args.recipe, args.variant)
    except ExperimentError as err:
        parser.error(str(err))
    overrides = {}
    if args.episodes is not None:
        overrides["train.num_episodes"] = args.episodes
    if args.delta is not None:
        if math.isnan(args.delta) or args.delta <= 0:
            parser.error(f"--delta: expected a number > 0 (or inf), got {args.delta}")
        if not resolved.is_flash_reinforce:
            parser.error("--delta: the GRPO variant has no trust region; drop --delta")
        overrides["actor.flash_gate_delta"] = args.delta
    if not overrides:
        return resolved
    return ResolvedExperiment(
        experiment=resolved.experiment,
        variants=resolved.variants,
        dropped=resolved.dropped,
        flags={**resolved.flags, **overrides},
        origin={**resolved.origin, **{key: "command line" for key in overrides}},
    )


def check_placement(args: argparse.Namespace, parser: argparse.ArgumentParser, batch: int) -> None:
    counts = (args.actor_nodes, args.actor_gpus, args.rollout_gpus, args.rollout_tp, args.actor_tp,
              args.actor_ep, args.actor_cp)  # fmt: skip
    if min(counts) < 1:
        parser.error(f"GPU and parallelism counts: expected integers >= 1, got {counts}")
    if batch % (args.actor_nodes * args.actor_gpus):
        parser.error(
            f"actor GPUs ({args.actor_nodes} x {args.actor_gpus}) must divide train.batch_size {batch}"
        )


def print_command(
    command, args: argparse.Namespace, label: str, source: str, placeholders: list[str]
) -> None:
    env_line = " ".join(f"{k}={shlex.quote(v)}" for k, v in command.env.items())
    print(f"# molt-rl {MOLT_VERSION}, setting {label} ({source} of the reference)")  # the printed word kept
    if args.molt_path is not None:
        print(f"# working directory: {args.molt_path.expanduser().resolve()}")
    if placeholders:
        hint = "pass --train-data, --eval-data, --agent-path"
        print(f"# placeholders to replace: {', '.join(placeholders)} ({hint})")
    print(env_line + " " + shlex.join(command.argv()), flush=True)


def launch(command, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Check the installed Molt, then run it in the foreground (Ray is the caller's)."""
    try:
        installed = importlib.metadata.version(MOLT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        parser.error(
            f"{MOLT_PACKAGE} is not installed: expected {MOLT_PACKAGE}=={MOLT_VERSION}. "
            f"Fix: pip install '{MOLT_PACKAGE}=={MOLT_VERSION}' (and its GPU dependencies)"
        )
    if installed != MOLT_VERSION:
        parser.error(
            f"{MOLT_PACKAGE}: expected version {MOLT_VERSION}, found {installed}. "
            f"Fix: pip install '{MOLT_PACKAGE}=={MOLT_VERSION}'"
        )
    for name in ("data.prompt_dataset", "eval.dataset", "train.agent_path"):
        if not Path(command.flags[name]).exists():
            parser.error(f"{name}: {command.flags[name]} does not exist")
    cwd = str(args.molt_path.expanduser().resolve()) if args.molt_path is not None else None
    env = {**os.environ, **command.env}
    help_run = subprocess.run(
        [sys.executable, "-m", MOLT_MODULE, "--help"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if help_run.returncode:
        parser.error(f"`python -m {MOLT_MODULE} --help` failed:\n{help_run.stderr[-3000:]}")
    available = set(re.findall(r"--[A-Za-z0-9_.-]+", help_run.stdout))
    unknown = command.unknown_flags(available)
    if unknown:
        parser.error(f"the installed Molt's --help lacks {unknown}; expected Molt {MOLT_VERSION}'s flags")
    return subprocess.run(command.argv(), cwd=cwd, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
