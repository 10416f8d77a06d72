"""The five experiments of the FlashREINFORCE release, as data, and how they resolve.

This module is the one table of hyperparameters behind the GPU tuned examples
(`tuned_examples/*.py`) and the Molt launcher (`scripts/train_molt.py`). Every value is copied from
a file of the public reference repository `yifanzhang-pro/FlashREINFORCE` and every entry names that
file (`source`): `examples/settings/common.json` holds the flags shared by all experiments, each
experiment's file (the release's "settings" files) overrides some of them and names its variants.
The keys are the reference's own Molt-style flag names (`actor.flash_gate_delta`,
`rollout.n_samples_per_prompt`, ...); `flashrl.reproduction.translate` turns them into
`FlashReinforceConfig` fields and `flashrl.reproduction.molt` into the flags of the public Molt 0.2.1
CLI.

Resolution follows the reference's `examples/run_experiment.py` semantics: the experiment's flags are
merged over `common.json` (itself over the two optimizer defaults the reference inherits from Molt
0.2.1, `RUNTIME_DEFAULTS`), then each selected variant in order (the last value wins); an unknown
variant is an error that lists the known ones; a variant that leaves the FlashREINFORCE loss
(`actor.loss_mode` other than `flash_reinforce`, i.e. `grpo`) drops the `actor.flash_*` flags; and
every resolved experiment keeps one full-batch update per collected batch.

What the reference does not fix (the hardware layout, the number of evaluation episodes, the
success bar of `--as-test`) is flashrl's own choice and lives in `FLASHRL_CHOICES`, marked as such.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "COMMON",
    "COMMON_SOURCE",
    "EXPERIMENTS",
    "FLASHRL_CHOICE",
    "FLASHRL_CHOICES",
    "REFERENCE",
    "RUNTIME_DEFAULTS",
    "Experiment",
    "ExperimentError",
    "FlashrlChoices",
    "ResolvedExperiment",
    "resolve_experiment",
]

REFERENCE = "yifanzhang-pro/FlashREINFORCE"
"""The public repository the experiments are copied from (files below are paths inside it)."""

COMMON_SOURCE = "examples/settings/common.json"
FLASHRL_CHOICE = "flashrl's choice (the reference fixes no value)"
"""The tag of every value flashrl chose itself."""


class ExperimentError(ValueError):
    """An unknown experiment or variant, or a resolved experiment that breaks the reference's contract."""


def _frozen(data: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(data))


COMMON: Mapping[str, Any] = _frozen(
    {  # examples/settings/common.json, every key in file order
        "data.input_key": "prompt",
        "data.label_key": "reward_model",
        "data.apply_chat_template": True,
        "rollout.batch_size": 128,
        "rollout.vllm_generate_batch_size": 16,
        "rollout.micro_batch_size": 1,
        "rollout.n_samples_per_prompt": 1,
        "rollout.temperature": 1.0,
        "rollout.top_p": 1.0,
        "train.batch_size": 128,
        "train.micro_batch_size": 1,
        "train.max_epochs": 1,
        "train.force_on_policy": True,
        "train.async_queue_size": 1,
        "train.colocate_fsdp_models": True,
        "fsdp.param_dtype": "bf16",
        "fsdp.packing_samples": True,
        "actor.gradient_checkpoint": "full",
        "actor.optim": "adam",
        "actor.adam.lr": 1e-06,
        "actor.adam.weight_decay": 0.1,
        "actor.lr_scheduler": "cosine_with_min_lr",
        "actor.lr_warmup_ratio": 0.03,
        "actor.min_lr_ratio": 0.1,
        "actor.max_norm": 1.0,
        "actor.entropy_coef": 0.0,
        "actor.loss_mode": "flash_reinforce",
        "actor.flash_neg_topq": 1.0,
        "actor.flash_gate_delta": 0.001,
        "actor.flash_gate_level": "seq",
        "actor.flash_loss_agg": "seq-mean-token-mean",
        "algo.advantage.estimator": "flash_reinforce",
        "algo.advantage.is_correction_level": "off",
        "algo.kl.init_coef": 0,
        "eval.steps": 100,
        "eval.n_samples_per_prompt": 4,
        "eval.temperature": 0.7,
        "eval.top_p": 0.7,
        "eval.eval_at_start": True,
        "ckpt.save_steps": 10,
        "logger.logging_steps": 1,
        "vllm.sync_backend": "nccl",
        "vllm.gpu_memory_utilization": 0.9,
    }
)
"""The flags every experiment starts from (`examples/settings/common.json`)."""

RUNTIME_DEFAULTS_SOURCE = "molt-rl 0.2.1 default (molt/cli/common_args.py), not set by the reference"
RUNTIME_DEFAULTS: Mapping[str, Any] = _frozen(
    {  # what the reference's runs take from Molt 0.2.1's parser because no experiment's file sets it
        "actor.adam.betas": (0.9, 0.95),
        "actor.adam.eps": 1e-08,
    }
)
"""Optimizer values the reference inherits from its runtime; merged under `COMMON`."""


@dataclass(frozen=True)
class Experiment:
    """One reference experiment: its file's fields, verbatim, plus the evaluation it describes."""

    name: str
    """The reference's short name (`examples/README.md`), e.g. 'r1'."""
    source: str
    """The file in the reference repository this entry is copied from."""
    model: str
    """Hugging Face id of the policy (`model`)."""
    agent_kind: str
    """'math', 'python_tool' or 'alfworld' (`agent_kind`): which environment plays the episodes."""
    max_agent_turns: int
    """Model turns per episode (`max_agent_turns`)."""
    flags: Mapping[str, Any]
    """Overrides of `COMMON` (`flags`)."""
    variants: Mapping[str, Mapping[str, Any]]
    """Named overrides of the merged flags (`variants`), in the file's order."""
    notes: tuple[str, ...]
    """The file's `notes`."""
    evaluation: str
    """What the online evaluation scores (the 'Online evaluation' column of `examples/README.md`)."""


EXPERIMENTS: Mapping[str, Experiment] = _frozen(
    {
        "r1": Experiment(
            name="r1",
            source="examples/settings/deepseek_r1_distill_qwen_1p5b_math_sanity.json",
            model="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
            agent_kind="math",
            max_agent_turns=1,
            flags=_frozen(
                {
                    "data.max_samples": 1460,
                    "data.max_len": 9216,
                    "rollout.max_new_tokens": 8192,
                    "rollout.vllm_generate_batch_size": 512,
                    "train.async_queue_size": 8,
                    "train.num_episodes": 350,
                    "actor.flash_gate_delta": 0.003,
                    "eval.steps": 128,
                    "eval.n_samples_per_prompt": 32,
                    "eval.temperature": 0.6,
                    "eval.top_p": 0.95,
                }
            ),
            variants=_frozen(
                {
                    "gate_5e3": _frozen({"actor.flash_gate_delta": 0.005}),
                    "no_trust": _frozen({"actor.flash_gate_delta": "inf"}),
                }
            ),
            notes=(
                "Fresh-start segment with AIME24/25 avg@32 evaluation. Episodes count dataset passes.",
                (
                    "gate_5e3 is a separate setting; selecting it does not reconstruct checkpoint continuation "
                    "or schedule changes."
                ),
            ),
            evaluation="AIME24/25, avg@32, every 128 updates",
        ),
        "qwen_math": Experiment(
            name="qwen_math",
            source="examples/settings/qwen2p5_math_1p5b_dapo_math.json",
            model="Qwen/Qwen2.5-Math-1.5B",
            agent_kind="math",
            max_agent_turns=1,
            flags=_frozen(
                {
                    "data.max_samples": 7500,
                    "data.max_len": 6144,
                    "rollout.max_new_tokens": 4096,
                    "train.num_episodes": 68,
                    "actor.flash_gate_delta": 0.003,
                    "train.micro_batch_size": 2,
                }
            ),
            variants=_frozen(
                {
                    "gate_1e3": _frozen({"actor.flash_gate_delta": 0.001}),
                    "negative_q09": _frozen({"actor.flash_gate_delta": 0.001, "actor.flash_neg_topq": 0.9}),
                    "negative_q02": _frozen({"actor.flash_gate_delta": 0.001, "actor.flash_neg_topq": 0.2}),
                    "five_benchmark_eval16": _frozen({"eval.n_samples_per_prompt": 16}),
                }
            ),
            notes=(
                "Use deduplicated 7,500-problem DAPO training data.",
                (
                    "Default online evaluation uses AMC23/Minerva/AIME25 avg@4; five_benchmark_eval16 requires "
                    "the five-task dataset."
                ),
                "Model configuration must support a total context of 6,144 tokens.",
            ),
            evaluation="AMC23/Minerva/AIME25, avg@4, every 100 updates",
        ),
        "qwen7b_tool": Experiment(
            name="qwen7b_tool",
            source="examples/settings/qwen2p5_7b_instruct_python_tool_10turn.json",
            model="Qwen/Qwen2.5-7B-Instruct",
            agent_kind="python_tool",
            max_agent_turns=10,
            flags=_frozen(
                {
                    "data.max_samples": 7500,
                    "data.max_len": 8192,
                    "rollout.max_new_tokens": 6144,
                    "train.num_episodes": 68,
                }
            ),
            variants=_frozen(
                {
                    "negative_q09": _frozen({"actor.flash_neg_topq": 0.9}),
                    "negative_q02": _frozen({"actor.flash_neg_topq": 0.2}),
                    "negative_q00": _frozen({"actor.flash_neg_topq": 0.0}),
                    "token_mean": _frozen({"actor.flash_loss_agg": "token-mean"}),
                    "constant_length": _frozen(
                        {"actor.flash_loss_agg": "seq-mean-token-sum-norm", "actor.loss_scale_factor": 6144}
                    ),
                    "grpo": _frozen(
                        {
                            "actor.loss_mode": "ppo",
                            "algo.advantage.estimator": "grpo",
                            "algo.advantage.no_whiten": True,
                            "rollout.batch_size": 32,
                            "rollout.n_samples_per_prompt": 4,
                            "train.num_episodes": 17,
                            "actor.eps_clip_low_high": (0.2, 0.2),
                        }
                    ),
                }
            ),
            notes=(
                (
                    "Use tool-formatted DAPO prompts and a Python-tool agent that grades only the committed final "
                    "answer."
                ),
                "This is the 10-turn / 8,192-context setting, not a later expanded-context continuation.",
                (
                    "Reduction variants select the loss only; they do not load a checkpoint or reproduce a "
                    "continuation run."
                ),
                (
                    "GRPO uses the same one-pass collection/update schedule and the trainer's token-mean PPO "
                    "reduction."
                ),
            ),
            evaluation="AMC23/Minerva/AIME25, avg@4, every 100 updates",
        ),
        "qwen3_tool_ablation": Experiment(
            name="qwen3_tool_ablation",
            source="examples/settings/qwen3_tool_ablation.json",
            model="Qwen/Qwen3-30B-A3B",
            agent_kind="python_tool",
            max_agent_turns=20,
            flags=_frozen(
                {
                    "data.max_samples": 7500,
                    "data.max_len": 16384,
                    "rollout.max_new_tokens": 14336,
                    "train.num_episodes": 17,
                    "train.async_queue_size": 4,
                    "actor.flash_gate_delta": 0.003,
                }
            ),
            variants=_frozen(
                {
                    "no_trust": _frozen({"actor.flash_gate_delta": 1000000000.0}),
                    "no_is": _frozen({"actor.flash_no_is": True, "actor.flash_gate_delta": 0.001}),
                }
            ),
            notes=(
                "20-turn tool trust ablation; distinct from the 10-turn / 18,432-context setting in the paper.",
                (
                    "no_is uses the current policy as the detached denominator; the binary-KL gate then also "
                    "becomes inactive."
                ),
                "Choose actor EP/CP and rollout TP to fit the MoE model on the available GPUs.",
            ),
            evaluation="AMC23/Minerva/AIME25, avg@4, every 100 updates",
        ),
        "alfworld": Experiment(
            name="alfworld",
            source="examples/settings/qwen2p5_7b_instruct_alfworld_50turn.json",
            model="Qwen/Qwen2.5-7B-Instruct",
            agent_kind="alfworld",
            max_agent_turns=50,
            flags=_frozen(
                {
                    "data.label_key": "game_file",
                    "data.max_samples": 1024,
                    "data.max_len": 16384,
                    "rollout.max_new_tokens": 8192,
                    "rollout.batch_size": 64,
                    "train.batch_size": 64,
                    "train.num_episodes": 20,
                    "actor.lr_scheduler": "constant",
                    "actor.flash_neg_topq": 0.9,
                    "eval.steps": 40,
                    "eval.n_samples_per_prompt": 3,
                    "eval.temperature": 1.0,
                    "eval.top_p": 0.7,
                }
            ),
            variants=_frozen(
                {
                    "negative_q02": _frozen({"actor.flash_neg_topq": 0.2}),
                    "no_is": _frozen({"actor.flash_no_is": True}),
                    "grpo": _frozen(
                        {
                            "actor.loss_mode": "ppo",
                            "algo.advantage.estimator": "grpo",
                            "algo.advantage.no_whiten": True,
                            "rollout.batch_size": 8,
                            "rollout.n_samples_per_prompt": 8,
                            "train.num_episodes": 3,
                            "actor.eps_clip_low_high": (0.2, 0.2),
                        }
                    ),
                }
            ),
            notes=(
                "Requires ALFWorld, its game data, and an agent returning terminal success reward.",
                "Evaluation contains 140 seen and 134 unseen games, with three samples per game.",
                (
                    "Set ALFWORLD_DATA to a local installation; game_file values must resolve in the worker "
                    "environment."
                ),
                (
                    "GRPO uses the same one-pass collection/update schedule and the trainer's token-mean PPO "
                    "reduction."
                ),
            ),
            evaluation="140 seen + 134 unseen games, 3 samples/game, every 40 updates",
        ),
    }
)
"""The five experiments by the reference's names (`examples/README.md`, first table)."""


@dataclass(frozen=True)
class FlashrlChoices:
    """What flashrl chose for an experiment where the reference fixes nothing (all `FLASHRL_CHOICE`)."""

    script: str
    """The tuned example that runs the experiment (`tuned_examples/<script>.py`)."""
    description: str
    """One line for `--help` and the dry-run."""
    num_nodes: int
    gpus_per_node: int
    """The node plan the layout is made for (the reference's launch commands are examples only)."""
    num_env_runners: int
    num_gpus_per_env_runner: int
    num_cpus_per_env_runner: int
    num_learners: int
    num_cpus_per_learner: int = 4
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    """vLLM engine arguments (tensor / expert parallel for the MoE model)."""
    sample_timeout_s: float = 1800.0
    """Seconds to wait for the next finished episode (long multi-turn episodes)."""
    evaluation_num_episodes: int = 500
    """Held-out prompts per evaluation (set it to your held-out file's size)."""
    success_threshold: float = 0.5
    """`--stop-reward` / `--as-test` bar on `evaluation/episode_return_mean` (no reference value)."""
    num_checkpoints_to_keep: int = 3
    """Periodic checkpoints kept (the reference saves every `ckpt.save_steps` and keeps Molt's default)."""
    max_tokens_per_micro_batch: int | None = None
    """Tokens per learner pass (None: one pass over a learner's share of the batch)."""
    optimizer_offload: bool = False
    """Keep the sharded learners' parameters, gradients and optimizer state in host memory."""
    learner_layout: str = ""
    """One line: why the learner layout (micro-batch budget, offload) is what it is."""
    model_config: Mapping[str, Any] = field(default_factory=dict)
    """Model config fields the engines read differently from the hub's ``config.json`` (vLLM's
    ``hf_overrides``), where the reference's context needs a config the hub's does not allow."""
    model_config_source: str = ""
    """Where ``model_config`` comes from (the reference's requirement and what its runtime does)."""


QWEN_MATH_CONTEXT = 6144
QWEN_MATH_CONTEXT_SOURCE = (
    "examples/settings/qwen2p5_math_1p5b_dapo_math.json notes ('Model configuration must support a total "
    "context of 6,144 tokens') and examples/README.md ('The Qwen Math checkpoint configuration must support "
    "6,144-token contexts'): the hub config of Qwen/Qwen2.5-Math-1.5B has max_position_embeddings 4096; "
    "Molt 0.2.1 passes data.max_len to vLLM as max_model_len (molt/cli/train_rl_ray.py, "
    "create_vllm_engines) and changes no model config, so the reference's checkpoint config allowed "
    "6,144. flashrl makes that config change explicit: max_position_embeddings 6144, RoPE unchanged "
    "(theta 10000, no scaling: the reference names none)"
)
"""The reference's context for `qwen_math` and where the model-config change behind it comes from."""

FLASHRL_CHOICES: Mapping[str, FlashrlChoices] = _frozen(
    {
        "r1": FlashrlChoices(
            script="r1_distill_qwen_1p5b_long_cot",
            description="DeepSeek-R1-Distill-Qwen-1.5B, long chain-of-thought math (reference experiment 'r1')",
            num_nodes=2,
            gpus_per_node=8,
            num_env_runners=8,
            num_gpus_per_env_runner=1,
            num_cpus_per_env_runner=4,
            num_learners=8,
            evaluation_num_episodes=60,
            success_threshold=0.30,
        ),
        "qwen_math": FlashrlChoices(
            script="qwen25_math_1p5b",
            description="Qwen2.5-Math-1.5B, single-turn math on DAPO problems (reference experiment 'qwen_math')",
            num_nodes=1,
            gpus_per_node=8,
            num_env_runners=4,
            num_gpus_per_env_runner=1,
            num_cpus_per_env_runner=4,
            num_learners=4,
            sample_timeout_s=600.0,
            success_threshold=0.30,
            model_config=_frozen({"max_position_embeddings": QWEN_MATH_CONTEXT}),
            model_config_source=QWEN_MATH_CONTEXT_SOURCE,
        ),
        "qwen7b_tool": FlashrlChoices(
            script="python_tool_qwen25_7b",
            description="Qwen2.5-7B-Instruct, 10-turn math with a sandboxed Python tool "
            "(reference experiment 'qwen7b_tool')",
            num_nodes=1,
            gpus_per_node=8,
            num_env_runners=4,
            num_gpus_per_env_runner=1,
            num_cpus_per_env_runner=8,
            num_learners=4,
            max_tokens_per_micro_batch=16384,
            learner_layout="FSDP2 over 4 learners, passes of at most 16,384 tokens: about 53 GiB of 80; one "
            "padded pass of 32 x 8,192 tokens per learner needs about 187 GiB (flashrl/recipes/memory.py)",
            success_threshold=0.30,
        ),
        "qwen3_tool_ablation": FlashrlChoices(
            script="python_tool_qwen3_30b_a3b",
            description="Qwen3-30B-A3B (MoE), 20-turn Python-tool trust ablation "
            "(reference experiment 'qwen3_tool_ablation')",
            num_nodes=2,
            gpus_per_node=8,
            num_env_runners=2,
            num_gpus_per_env_runner=4,
            num_cpus_per_env_runner=16,
            num_learners=8,
            engine_args=_frozen({"tensor_parallel_size": 4, "enable_expert_parallel": True}),
            max_tokens_per_micro_batch=16384,
            learner_layout="FSDP2 over 8 learners, passes of one 16,384-token episode: about 76 GiB of 80 (63 "
            "GiB of it static); one padded pass of 16 x 16,384 tokens per learner needs about 190 GiB "
            "(flashrl/recipes/memory.py)",
            success_threshold=0.30,
            num_checkpoints_to_keep=2,
        ),
        "alfworld": FlashrlChoices(
            script="alfworld_qwen25_7b",
            description="Qwen2.5-7B-Instruct, ALFWorld, 50 turns (reference experiment 'alfworld')",
            num_nodes=1,
            gpus_per_node=8,
            num_env_runners=4,
            num_gpus_per_env_runner=1,
            num_cpus_per_env_runner=8,
            num_learners=4,
            max_tokens_per_micro_batch=16384,
            learner_layout="FSDP2 over 4 learners, passes of one 16,384-token episode: about 53 GiB of 80; one "
            "padded pass of 16 x 16,384 tokens per learner needs about 193 GiB (flashrl/recipes/memory.py)",
            # Prompts per split: the reference evaluates 140 seen + 134 unseen games (the experiment
            # file's notes, examples/README.md); 140 plays every seen game once, the 134 unseen too.
            evaluation_num_episodes=140,
            success_threshold=0.80,
        ),
    }
)
"""flashrl's own choices per experiment, keyed like `EXPERIMENTS`."""


@dataclass(frozen=True)
class ResolvedExperiment:
    """An experiment with its variants applied: the reference flags a run uses, and where each came from."""

    experiment: Experiment
    variants: tuple[str, ...]
    flags: Mapping[str, Any]
    """Reference-style flags after merging (common < experiment < variants, in order)."""
    origin: Mapping[str, str]
    """Flag -> the reference file (and variant) its value comes from."""
    dropped: tuple[str, ...] = ()
    """`actor.flash_*` flags removed because a variant left the FlashREINFORCE loss (as the reference does)."""

    @property
    def name(self) -> str:
        return self.experiment.name

    @property
    def is_flash_reinforce(self) -> bool:
        return self.flags["actor.loss_mode"] == "flash_reinforce"

    @property
    def total_updates(self) -> int:
        """Optimizer steps of the run: ceil(data.max_samples / rollout.batch_size) x train.num_episodes.

        This is Molt 0.2.1's scheduler horizon with `train.force_on_policy` (molt/trainer/rl_trainer.py:
        one step per rollout batch, the last partial batch counted, times the dataset passes), for a
        training set of exactly `data.max_samples` prompts.
        """
        rounds = -(-int(self.flags["data.max_samples"]) // int(self.flags["rollout.batch_size"]))
        return rounds * int(self.flags["train.num_episodes"]) * int(self.flags["train.max_epochs"])

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: the experiment, the selected variants, the merged flags and their origin."""
        return {
            "setting": self.name,  # the key --print-config prints (the release's word)
            "reference": REFERENCE,
            "source": self.experiment.source,
            "variants": list(self.variants),
            "model": self.experiment.model,
            "agent_kind": self.experiment.agent_kind,
            "max_agent_turns": self.experiment.max_agent_turns,
            "evaluation": self.experiment.evaluation,
            "flags": {k: _jsonable(v) for k, v in self.flags.items()},
            "flag_sources": dict(self.origin),
            "dropped_flags": list(self.dropped),
            "notes": list(self.experiment.notes),
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def resolve_experiment(name: str, variants: Sequence[str] = ()) -> ResolvedExperiment:
    """Merge `COMMON`, the experiment's flags and each variant in order; check the one-update contract.

    Raises:
        ExperimentError: unknown experiment or variant (the message lists the known ones), or a
            merged experiment whose rollout batch is not one full training batch.
    """
    if name not in EXPERIMENTS:
        raise ExperimentError(f"unknown experiment {name!r}: expected one of {sorted(EXPERIMENTS)}.")
    experiment = EXPERIMENTS[name]
    flags = {**RUNTIME_DEFAULTS, **COMMON}
    origin = {key: RUNTIME_DEFAULTS_SOURCE for key in RUNTIME_DEFAULTS} | {
        key: COMMON_SOURCE for key in COMMON
    }
    flags.update(experiment.flags)
    origin.update({key: experiment.source for key in experiment.flags})
    for variant in variants:
        if variant not in experiment.variants:
            raise ExperimentError(
                f"unknown variant {variant!r} of experiment {name!r}: expected one of {list(experiment.variants)} "
                f"(several apply in order). Fix: pick a listed name."
            )
        flags.update(experiment.variants[variant])
        origin.update({key: f"{experiment.source} (variant {variant})" for key in experiment.variants[variant]})
    dropped: tuple[str, ...] = ()
    if flags["actor.loss_mode"] != "flash_reinforce":  # the reference drops the native-loss flags
        dropped = tuple(key for key in flags if key.startswith("actor.flash_"))
        for key in dropped:
            del flags[key]
            del origin[key]
    resolved = ResolvedExperiment(
        experiment=experiment,
        variants=tuple(variants),
        flags=_frozen(copy.deepcopy(flags)),
        origin=_frozen(origin),
        dropped=dropped,
    )
    _check_contract(resolved)
    return resolved


def _check_contract(resolved: ResolvedExperiment) -> None:
    flags = resolved.flags
    where = f"experiment {resolved.name!r} with variants {list(resolved.variants)}"
    batch = flags["rollout.batch_size"] * flags["rollout.n_samples_per_prompt"]
    if batch != flags["train.batch_size"] or flags["train.max_epochs"] != 1:
        raise ExperimentError(
            f"{where}: expected one full-batch update per collected batch (rollout.batch_size x "
            f"rollout.n_samples_per_prompt == train.batch_size, train.max_epochs == 1), got {batch} vs "
            f"{flags['train.batch_size']} and {flags['train.max_epochs']} epochs."
        )
    if resolved.is_flash_reinforce and flags["rollout.n_samples_per_prompt"] != 1:
        raise ExperimentError(
            f"{where}: FlashREINFORCE samples one rollout per prompt, got "
            f"rollout.n_samples_per_prompt={flags['rollout.n_samples_per_prompt']}."
        )
    if flags["data.max_len"] <= flags["rollout.max_new_tokens"]:
        raise ExperimentError(
            f"{where}: expected data.max_len > rollout.max_new_tokens, got {flags['data.max_len']} and "
            f"{flags['rollout.max_new_tokens']}."
        )


def dumps(resolved: ResolvedExperiment, extra: Mapping[str, Any] | None = None) -> str:
    """The resolved experiment as indented JSON (infinite floats as strings)."""
    return json.dumps({**resolved.to_json(), **(extra or {})}, indent=2, default=_jsonable)
