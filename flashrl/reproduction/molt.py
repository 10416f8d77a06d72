"""The reference experiments as a command line of NVIDIA Molt 0.2.1 (`python -m molt.cli.train_rl_ray`).

Molt 0.2.1 (registry package `molt-rl`) has no native FlashREINFORCE loss (`actor.loss_mode` offers
ppo, cispo, gspo; no `actor.flash_*` flag). It runs the base method through its behavior correction,
as the reference's `scripts/train_molt.py` does:

    --algo.advantage.estimator flash_reinforce           A_i = R_i - batch mean
    --train.force_on_policy --train.max_epochs 1         old = current.detach(): PPO's ratio is 1
    --algo.advantage.is_correction_level seq             one decision per trajectory ...
    --algo.advantage.is_correction_gating binary_kl      ... on the mean sampled-token Bernoulli KL
    --algo.advantage.is_correction_mode mask             ... rejected trajectories contribute nothing
    --algo.advantage.is_correction_threshold DELTA       accept iff mean KL <= delta (survivors keep
                                                         their detached token ratio)
    --actor.loss_agg_mode seq-mean-token-mean           Sample-Mean Optimization

(molt/models/loss.py: `PolicyLoss`, molt/trainer/algorithm/advantage.py: `flash_reinforce`). What
0.2.1 cannot express is refused with the reason: a failure-token filter q < 1, `no_is`, the
`constant_length` reduction; those run natively in flashrl (`tuned_examples/`). The GRPO variants
run as Molt's own GRPO (`actor.loss_mode ppo`, `algo.advantage.estimator grpo`).

`MOLT_0_2_1_FLAGS` (flashrl/reproduction/molt_rl_0_2_1_flags.py) records every flag of 0.2.1's RL CLI,
extracted from its parser by `python -m flashrl.reproduction.molt extract <folder holding molt/>`.
"""

from __future__ import annotations

import argparse
import ast
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashrl.reproduction.experiments import FLASHRL_CHOICES, ResolvedExperiment
from flashrl.reproduction.molt_rl_0_2_1_flags import MOLT_0_2_1_CHOICES, MOLT_0_2_1_FLAGS

__all__ = [
    "MOLT_0_2_1_CHOICES",
    "MOLT_0_2_1_FLAGS",
    "MOLT_PACKAGE",
    "MOLT_VERSION",
    "MoltCommand",
    "extract_flags",
    "molt_command",
]

MOLT_PACKAGE = "molt-rl"
MOLT_VERSION = "0.2.1"
MOLT_MODULE = "molt.cli.train_rl_ray"
CLI_SOURCE = "molt/cli/train_rl_ray.py"


@dataclass(frozen=True)
class Placement:
    """Where Molt puts the actor (FSDP) and the rollout engines (vLLM)."""

    actor_nodes: int = 1
    actor_gpus: int = 1
    rollout_engines: int = 7
    rollout_tp: int = 1
    actor_tp: int = 1
    actor_ep: int = 1
    actor_cp: int = 1
    attention: str = "flash_attention_2"


@dataclass
class MoltCommand:
    """The Molt flags of a resolved experiment, or why Molt 0.2.1 cannot run it."""

    flags: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    refusals: list[str] = field(default_factory=list)

    def argv(self, python: str = sys.executable) -> list[str]:
        """`python -u -m molt.cli.train_rl_ray --flag value ...` (switches bare, False omitted)."""
        command = [python, "-u", "-m", MOLT_MODULE]
        for key, value in self.flags.items():
            if value is False or value is None:
                continue
            command.append(f"--{key}")
            if value is not True:
                command.extend(_render(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
        return command

    def unknown_flags(self, known: Mapping[str, Any] | set[str] = MOLT_0_2_1_FLAGS) -> list[str]:
        """Flags about to be passed that `known` (a flag list, or a `--help` scan) lacks."""
        return sorted(
            f"--{key}"
            for key, value in self.flags.items()
            if value is not False and value is not None and f"--{key}" not in known
        )


def _render(value: Any) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return str(value)


def molt_command(
    resolved: ResolvedExperiment,
    *,
    model: str,
    train_data: str,
    eval_data: str,
    agent_path: str,
    output: str,
    placement: Placement = Placement(),
) -> MoltCommand:
    """The Molt 0.2.1 command of a resolved experiment (with the refusals, if it cannot run there)."""
    flags = dict(resolved.flags)
    out = MoltCommand()
    script = FLASHRL_CHOICES[resolved.name].script
    native = f"run it natively: python tuned_examples/{script}.py" + "".join(
        f" --variant {v}" for v in resolved.variants
    )
    if resolved.is_flash_reinforce:
        _flash_reinforce_flags(flags, out, native)
    else:
        flags.setdefault("actor.loss_agg_mode", "token-mean")  # the trainer's PPO reduction, made explicit
        if (
            flags["rollout.vllm_generate_batch_size"] > flags["rollout.batch_size"]
            and flags["algo.advantage.is_correction_level"] == "off"
        ):
            out.refusals.append(
                f"rollout.vllm_generate_batch_size={flags['rollout.vllm_generate_batch_size']} > "
                f"rollout.batch_size={flags['rollout.batch_size']} without behavior correction: Molt 0.2.1 "
                "turns on partial rollout and then rejects the uncorrected off-policy tokens at start "
                f"(molt/cli/train_rl_ray.py); {native}"
            )
    flags.update(
        {
            "actor.model_name_or_path": model,
            "train.agent_path": agent_path,
            "data.prompt_dataset": train_data,
            "eval.dataset": eval_data,
            "actor.num_nodes": placement.actor_nodes,
            "actor.num_gpus_per_node": placement.actor_gpus,
            "ref.num_nodes": placement.actor_nodes,
            "ref.num_gpus_per_node": placement.actor_gpus,
            "fsdp.tp_size": placement.actor_tp,
            "fsdp.ep_size": placement.actor_ep,
            "fsdp.cp_size": placement.actor_cp,
            "vllm.num_engines": placement.rollout_engines,
            "vllm.tensor_parallel_size": placement.rollout_tp,
            "fsdp.attn_implementation": placement.attention,
            "ckpt.output_dir": str(Path(output) / "hf"),
            "ckpt.path": str(Path(output) / "state"),
        }
    )
    out.flags = flags
    out.env = {
        "MAX_AGENT_TURNS": str(resolved.experiment.max_agent_turns),  # read by the agent, not by Molt
        "RAY_USAGE_STATS_ENABLED": "0",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "TOKENIZERS_PARALLELISM": "true",
    }
    return out


def _flash_reinforce_flags(flags: dict[str, Any], out: MoltCommand, native: str) -> None:
    """Replace the native-loss flags (`actor.flash_*`) by 0.2.1's behavior-correction route."""
    q = flags.pop("actor.flash_neg_topq")
    if q != 1:
        out.refusals.append(
            f"actor.flash_neg_topq={q} (failure-token entropy filter, q < 1): Molt 0.2.1 has "
            f"no such option; {native}"
        )
    if flags.pop("actor.flash_no_is", False):
        out.refusals.append(
            f"actor.flash_no_is (no_is): Molt 0.2.1 always divides by the behavior probability; {native}"
        )
    reduction = flags.pop("actor.flash_loss_agg")
    flags.pop("actor.loss_scale_factor", None)
    modes = {"seq-mean-token-mean": "seq-mean-token-mean", "token-mean": "token-mean"}
    if reduction in modes:
        flags["actor.loss_agg_mode"] = modes[reduction]
    else:
        out.refusals.append(
            f"actor.flash_loss_agg={reduction} (constant_length): Molt 0.2.1's "
            f"actor.loss_agg_mode has no constant-length reduction; {native}"
        )
    level = flags.pop("actor.flash_gate_level")
    if level != "seq":
        out.refusals.append(f"actor.flash_gate_level={level}: expected 'seq' (one decision per trajectory)")
    del flags["actor.loss_mode"]  # 0.2.1's default ppo, evaluated at old = current.detach()
    flags["train.force_on_policy"] = True
    flags["algo.advantage.is_correction_level"] = "seq"
    flags["algo.advantage.is_correction_gating"] = "binary_kl"
    flags["algo.advantage.is_correction_mode"] = "mask"
    flags["algo.advantage.is_correction_threshold"] = float(flags.pop("actor.flash_gate_delta"))


# ------------------------------------------------------------------------------------ flag extraction
def extract_flags(package_root: str | Path) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """Every option of Molt's RL CLI -> its kind ('switch', 'value' or 'values:N'), and the choices
    of the options that have them; without importing Ray or vLLM.

    Runs only the parser-building statements of the `if __name__ == "__main__":` block of
    `molt/cli/train_rl_ray.py` (everything before `args = parser.parse_args()`), with `package_root`
    (the folder holding `molt/`) first on `sys.path` for `molt.cli.common_args`.
    """
    root = Path(package_root)
    source = (root / CLI_SOURCE).read_text(encoding="utf-8")
    tree = ast.parse(source)
    main = next(
        node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
    )
    body = []
    for statement in main.body:
        if isinstance(statement, ast.Assign) and "parse_args" in ast.unparse(statement.value):
            break
        body.append(statement)
    namespace: dict[str, Any] = {"argparse": argparse}
    sys.path.insert(0, str(root))
    try:
        exec(compile(ast.Module(body=body, type_ignores=[]), CLI_SOURCE, "exec"), namespace)  # noqa: S102
    finally:
        sys.path.remove(str(root))
    flags, choices = {}, {}
    for action in namespace["parser"]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        kind = (
            "switch"
            if action.nargs == 0
            else "value"
            if action.nargs in (None, "?")
            else f"values:{action.nargs}"
        )
        for option in action.option_strings:
            flags[option] = kind
            if action.choices is not None:
                choices[option] = tuple(str(c) for c in action.choices)
    return flags, choices


def _module_text(flags: Mapping[str, str], choices: Mapping[str, tuple[str, ...]]) -> str:
    lines = [
        f'"""Every option of Molt {MOLT_VERSION}\'s RL CLI (`python -m {MOLT_MODULE}`), as data.',
        "",
        f"Extracted from the registry package {MOLT_PACKAGE}=={MOLT_VERSION} (its wheel, unpacked) with",
        "`python -m flashrl.reproduction.molt extract <folder holding molt/>` (then `ruff format`): that runs",
        'only the parser-building statements of the `if __name__ == "__main__":` block of',
        f"`{CLI_SOURCE}` (up to `args = parser.parse_args()`), which lists the flags without importing",
        "Ray or vLLM.",
        "Kinds: 'switch' (takes no value), 'value' (one), 'values:N' / 'values:+' (N / one or more).",
        '"""',
        "",
        "MOLT_0_2_1_FLAGS: dict[str, str] = {",
    ]
    lines += [f'    "{flag}": "{kind}",' for flag, kind in flags.items()]
    lines += ["}", '"""Flag -> kind."""', "", "MOLT_0_2_1_CHOICES: dict[str, tuple[str, ...]] = {"]
    lines += [f'    "{flag}": {values!r},' for flag, values in choices.items()]
    lines += ["}", '"""Flag -> the values its parser accepts (flags with `choices` only)."""']
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Extract Molt's RL CLI flags.", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    extract = sub.add_parser(
        "extract", help="print the flag module for a folder holding molt/", allow_abbrev=False
    )
    extract.add_argument("package_root", help="the folder that holds the molt/ package (an unpacked wheel)")
    args = parser.parse_args(argv)
    print(_module_text(*extract_flags(args.package_root)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
