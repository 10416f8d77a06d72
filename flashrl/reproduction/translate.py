"""From a resolved reference experiment (Molt-style flags) to `FlashReinforceConfig` fields.

`TRANSLATION` has one row per flag the reference uses. A row either names the flashrl field it sets
(with a value map where the spelling differs), or says why flashrl has no counterpart and which
value flashrl's own behaviour already equals (`implied`). A flag without a row, or a value outside a
row's map, is an error: nothing is dropped silently. The fields produced are then set with
`FlashReinforceConfig.update_from_dict`, which rejects a field the config does not have, naming it.

The GRPO variants (`actor.loss_mode: ppo`) translate to flashrl's synchronous group mode: with
`train.force_on_policy` and one epoch, Molt evaluates PPO's ratio against `old = current.detach()`,
so the ratio is exactly 1 at the only update and the 0.2/0.2 clip never binds; no behavior correction
is applied (`algo.advantage.is_correction_level: off`). The same gradient in flashrl is token-mean
REINFORCE with the group-normalised advantage, no importance ratio and no trust region.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flashrl.reproduction.experiments import (
    FLASHRL_CHOICE,
    FLASHRL_CHOICES,
    ExperimentError,
    ResolvedExperiment,
)

__all__ = ["ENVIRONMENTS", "GROUP_BASELINE", "TRANSLATION", "Translation", "flashrl_fields"]

GROUP_BASELINE = "group_norm"
"""flashrl's baseline for Molt's `grpo` estimator: (R - group mean) / (group std + eps)."""

ENVIRONMENTS: Mapping[str, str] = {
    "math": "flashrl/Math-v0",
    "python_tool": "flashrl/PythonTool-v0",
    "alfworld": "flashrl/ALFWorld-v0",
}
"""The reference's `agent_kind` -> the flashrl environment that plays those episodes."""


@dataclass(frozen=True)
class Translation:
    """How one reference flag maps onto flashrl."""

    field: str | None
    """The flashrl config field it sets ('engine_options.x' sets a key of that dict); None = none."""
    meaning: str
    """One line: what the flag means, or why flashrl has no counterpart."""
    values: Mapping[Any, Any] | None = None
    """Reference value -> flashrl value, where the spelling differs (others are an error)."""
    convert: Callable[[Any], Any] | None = None
    """Converter applied to the reference value (e.g. 'inf' -> float('inf'))."""
    implied: tuple[Any, ...] = ()
    """For a flag without a field: the values flashrl's fixed behaviour equals (others: error)."""
    expand: Callable[[Any], dict[str, Any]] | None = None
    """For a flag that sets several fields: value -> {field: value}."""


def _delta(value: Any) -> float:
    number = float(value)  # the reference writes the no-trust gate as "inf" or 1e9
    if math.isnan(number) or number <= 0:
        raise ExperimentError(f"actor.flash_gate_delta: expected a number > 0 or 'inf', got {value!r}.")
    return number


def _group(n: Any) -> dict[str, Any]:
    if n == 1:
        return {"rollout_mode": "async"}
    return {"rollout_mode": "sync_group", "group_size": int(n)}


def _loss_mode(mode: Any) -> dict[str, Any]:
    if mode == "flash_reinforce":
        return {"trust_region": "bernoulli_kl", "importance_sampling": "token"}
    if mode == "ppo":  # ratio == 1 under force_on_policy + one epoch: see the module docstring
        return {"trust_region": "none", "importance_sampling": "none", "aggregation": "token_mean"}
    raise ExperimentError(f"actor.loss_mode: expected 'flash_reinforce' or 'ppo', got {mode!r}.")


_NO_COUNTERPART = "no flashrl counterpart: "

TRANSLATION: Mapping[str, Translation] = {
    # --- data: Molt's saved-dataset format; flashrl's environments read their own rows ---------------
    "data.input_key": Translation(
        None,
        _NO_COUNTERPART + "Molt's prompt column; flashrl envs read "
        "question_field (docs/training.md, data preparation)",
        implied=("prompt",),
    ),
    "data.label_key": Translation(
        None,
        _NO_COUNTERPART + "Molt's label column; flashrl envs read answer_field / ALFWorld game files",
        implied=("reward_model", "game_file"),
    ),
    "data.apply_chat_template": Translation(
        None, "flashrl envs always render the model's chat template", implied=(True,)
    ),
    "data.max_samples": Translation(
        "max_samples", "training prompts used: the first max_samples of the training set (Molt cuts it so)"
    ),
    "data.max_len": Translation("max_episode_tokens", "total context of an episode (prompt + all turns)"),
    # --- rollout ---------------------------------------------------------------------------------------
    "rollout.batch_size": Translation(
        None, "prompts per batch: train_batch_size / group_size (checked equal by the experiment's contract)"
    ),
    "rollout.vllm_generate_batch_size": Translation(
        "episodes_in_flight", "rollouts in flight over all engines, split evenly over the env runners"
    ),
    "rollout.micro_batch_size": Translation(
        None, _NO_COUNTERPART + "Molt's rollout micro-batching", implied=(1,)
    ),
    "rollout.n_samples_per_prompt": Translation(
        None,
        "rollouts per prompt: 1 = the method (async), n > 1 = sync_group with group_size n",
        expand=_group,
    ),
    "rollout.max_new_tokens": Translation("max_new_tokens", "tokens the model may generate per turn"),
    "rollout.temperature": Translation("temperature", "sampling temperature"),
    "rollout.top_p": Translation("top_p", "nucleus mass (1.0 keeps the behavior support)"),
    # --- training schedule -----------------------------------------------------------------------------
    "train.batch_size": Translation("train_batch_size", "B: trajectories per update"),
    "train.micro_batch_size": Translation(
        None,
        _NO_COUNTERPART + "Molt's gradient-accumulation "
        "micro-batch; flashrl's learners take their whole share at once",
    ),
    "train.max_epochs": Translation(None, "flashrl takes exactly one optimizer step per batch", implied=(1,)),
    "train.force_on_policy": Translation(
        None,
        "flashrl never re-evaluates an old policy: the ratio's numerator is the current policy",
        implied=(True,),
    ),
    "train.num_episodes": Translation(
        "num_epochs", "passes over the training set; the horizon total_updates follows from the real set size"
    ),
    "train.async_queue_size": Translation(
        "async_queue_size", "finished batches allowed ahead of the learner (the staleness bound)"
    ),
    "train.colocate_fsdp_models": Translation(
        None, _NO_COUNTERPART + "Molt's FSDP placement", implied=(True,)
    ),
    "fsdp.param_dtype": Translation("dtype", "learner parameter dtype", values={"bf16": "bfloat16"}),
    "fsdp.packing_samples": Translation(
        None, _NO_COUNTERPART + "Molt's sequence packing (flashrl pads)", implied=(True,)
    ),
    # --- optimizer -------------------------------------------------------------------------------------
    "actor.gradient_checkpoint": Translation(
        "gradient_checkpointing", "activation checkpointing", values={"full": True, "none": False}
    ),
    "actor.optim": Translation("optimizer", "Adam with decoupled weight decay", values={"adam": "adamw"}),
    "actor.adam.lr": Translation("lr", "peak learning rate"),
    "actor.adam.weight_decay": Translation("weight_decay", "decoupled weight decay"),
    "actor.adam.betas": Translation("betas", "Adam betas", convert=tuple),
    "actor.adam.eps": Translation("adam_eps", "Adam epsilon"),
    "actor.lr_scheduler": Translation(
        "lr_schedule",
        "learning-rate schedule",
        values={"cosine_with_min_lr": "cosine_with_min_lr", "constant": "constant"},
    ),
    "actor.lr_warmup_ratio": Translation("lr_warmup_ratio", "warmup share of total_updates"),
    "actor.min_lr_ratio": Translation("min_lr_ratio", "final learning rate / peak (cosine)"),
    "actor.max_norm": Translation("grad_clip", "global gradient-norm clip"),
    "actor.entropy_coef": Translation(None, "flashrl's loss has no entropy bonus", implied=(0, 0.0)),
    # --- the loss --------------------------------------------------------------------------------------
    "actor.loss_mode": Translation(
        None,
        "flash_reinforce = the method; ppo = the GRPO comparison (see the module docstring)",
        expand=_loss_mode,
    ),
    "actor.flash_neg_topq": Translation(
        "negative_token_fraction",
        "q: a failed trajectory trains on its ceil(q T_i) highest-entropy tokens (1 = all: the base method)",
    ),
    "actor.flash_gate_delta": Translation(
        "delta",
        "Sequence Trust Region threshold on the mean Bernoulli KL ('inf' / 1e9 = no trust region)",
        convert=_delta,
    ),
    "actor.flash_gate_level": Translation(
        None, "flashrl's trust decision is per trajectory", implied=("seq",)
    ),
    "actor.flash_loss_agg": Translation(
        "aggregation",
        "loss aggregation",
        values={
            "seq-mean-token-mean": "sample_mean",
            "token-mean": "token_mean",
            "seq-mean-token-sum-norm": "constant_length",
        },
    ),
    "actor.loss_scale_factor": Translation(
        "constant_length_normalizer", "the constant length L of constant_length aggregation"
    ),
    "actor.flash_no_is": Translation(
        "importance_sampling",
        "no_is: the detached current policy replaces the behavior one (ratio 1, the gate inactive)",
        values={True: "none", False: "token"},
    ),
    "actor.eps_clip_low_high": Translation(
        None, "PPO clip of the GRPO variant: never binds at ratio 1", implied=((0.2, 0.2),)
    ),
    "algo.advantage.estimator": Translation(
        "baseline", "advantage baseline", values={"flash_reinforce": "batch_mean", "grpo": GROUP_BASELINE}
    ),
    "algo.advantage.is_correction_level": Translation(
        None,
        "off: the native loss applies the behavior correction itself (no double correction)",
        implied=("off",),
    ),
    "algo.advantage.no_whiten": Translation(None, "flashrl never whitens advantages", implied=(True,)),
    "algo.kl.init_coef": Translation(None, "flashrl has no reference model or KL term", implied=(0, 0.0)),
    # --- evaluation, checkpoints, logging, engine --------------------------------------------------------
    "eval.steps": Translation("evaluation_interval", "updates between online evaluations"),
    "eval.n_samples_per_prompt": Translation("evaluation_num_samples_per_prompt", "k of avg@k"),
    "eval.temperature": Translation("evaluation_temperature", "evaluation sampling temperature"),
    "eval.top_p": Translation("evaluation_top_p", "evaluation nucleus mass"),
    "eval.eval_at_start": Translation("evaluation_at_start", "evaluate before the first update"),
    "ckpt.save_steps": Translation("checkpoint_frequency", "updates between checkpoints"),
    "logger.logging_steps": Translation("console_every", "updates between progress lines"),
    "vllm.sync_backend": Translation(
        None, _NO_COUNTERPART + "flashrl broadcasts weights its own way", implied=("nccl",)
    ),
    "vllm.gpu_memory_utilization": Translation(
        "engine_options.gpu_memory_utilization", "share of GPU memory vLLM may use"
    ),
}
"""Every reference flag the experiments use -> its flashrl meaning."""


@dataclass
class FlashrlFields:
    """The flashrl fields of an experiment and where each value comes from."""

    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def set(self, name: str, value: Any, source: str) -> None:
        if name.startswith("engine_options."):
            self.values.setdefault("engine_options", {})[name.split(".", 1)[1]] = value
        else:
            self.values[name] = value
        self.sources[name] = source


def flashrl_fields(
    resolved: ResolvedExperiment, *, env_config: Mapping[str, Any] | None = None
) -> FlashrlFields:
    """The `FlashReinforceConfig` fields of a resolved experiment, each with its source.

    Flags that set several fields (`actor.loss_mode`, `rollout.n_samples_per_prompt`) go first, so
    that a specific flag (`actor.flash_no_is`) refines what they set.

    Args:
        resolved: the experiment with its variants.
        env_config: the environment's data arguments (task files, games), merged under the
            experiment's turn limit.

    Raises:
        ExperimentError: a flag without a row in `TRANSLATION`, or a value its row does not accept.
    """
    experiment, flags = resolved.experiment, resolved.flags
    choices = FLASHRL_CHOICES[experiment.name]
    out = FlashrlFields()
    runners = choices.num_env_runners
    unknown = [key for key in flags if key not in TRANSLATION]
    if unknown:
        raise ExperimentError(
            f"reference flags {unknown} (from {experiment.source}) have no row in "
            "flashrl.reproduction.translate.TRANSLATION; expected every flag to be translated or explained. "
            "Fix: add their rows."
        )
    for key in sorted(flags, key=lambda k: TRANSLATION[k].expand is None):
        _translate_flag(key, flags[key], resolved.origin[key], out, runners)
    if out.values.get("lr_schedule") == "constant":
        # Molt builds transformers' get_scheduler("constant", ...) with the warmup and min-lr arguments
        # (molt/trainer/fsdp/strategy.py); that schedule takes neither, so they are inert there
        for name in ("lr_warmup_ratio", "min_lr_ratio"):
            out.set(
                name,
                0.0,
                f"{out.sources[name]}, inert under actor.lr_scheduler=constant (Molt 0.2.1 "
                "passes it to transformers' constant schedule, which ignores it)",
            )
    out.set("model", experiment.model, f"{experiment.source}: model")
    out.set("env", ENVIRONMENTS[experiment.agent_kind], f"{experiment.source}: agent_kind={experiment.agent_kind!r}")
    env = dict(env_config or {})
    if experiment.agent_kind != "math":
        env["max_turns"] = experiment.max_agent_turns
        out.sources["env_config.max_turns"] = f"{experiment.source}: max_agent_turns"
    out.values["env_config"] = env  # its data arguments come from the command line (--data, ...)
    _choices(resolved, out)
    _evaluation_data(resolved, out)
    return out


def _translate_flag(key: str, value: Any, source: str, out: FlashrlFields, runners: int) -> None:
    """One reference flag into `out` (flags that set several fields go first: see the caller)."""
    rule = TRANSLATION[key]
    if rule.expand is not None:
        for name, val in rule.expand(value).items():
            out.set(name, val, f"{source}: {key}={value!r}")
        return
    if rule.field is None:
        if rule.implied and value not in rule.implied:
            raise ExperimentError(
                f"reference flag {key}={value!r} (from {source}): flashrl only supports "
                f"{list(rule.implied)} ({rule.meaning})."
            )
        return
    if rule.values is not None:
        if value not in rule.values:
            raise ExperimentError(
                f"reference flag {key}={value!r} (from {source}): expected one of {list(rule.values)}."
            )
        value = rule.values[value]
    if rule.convert is not None:
        value = rule.convert(value)
    if rule.field == "episodes_in_flight":
        per_runner = max(1, -(-int(value) // runners))
        out.set(
            "episodes_in_flight_per_env_runner",
            per_runner,
            f"{source}: {key}={value} over {runners} env runners",
        )
        return
    out.set(rule.field, value, f"{source}: {key}")


def _evaluation_data(resolved: ResolvedExperiment, out: FlashrlFields) -> None:
    """Which held-out sets the online evaluation reports (examples/README.md)."""
    readme = "examples/README.md"
    if resolved.experiment.agent_kind == "alfworld":
        games = f"{readme}: 140 seen + 134 unseen games ({resolved.experiment.source} notes)"
        out.set(
            "evaluation_splits",
            {"valid_seen": {"split": "valid_seen"}, "valid_unseen": {"split": "valid_unseen"}},
            games,
        )
        # evaluation_num_episodes counts prompts per split: every seen game once; the unseen split
        # is capped at its 134 games (a finite game list is walked once)
        out.set(
            "evaluation_num_episodes",
            FLASHRL_CHOICES[resolved.name].evaluation_num_episodes,
            f"{games}: prompts per split, the larger split's count",
        )
    else:
        out.set(
            "evaluation_datasource_key",
            "datasource",
            f"{readme}: math data carry a benchmark 'datasource' ({resolved.experiment.evaluation})",
        )


def _choices(resolved: ResolvedExperiment, out: FlashrlFields) -> None:
    """flashrl's own choices: the hardware layout and what the reference leaves open."""
    c = FLASHRL_CHOICES[resolved.name]
    for name, value in (
        ("engine", "vllm"),
        ("num_env_runners", c.num_env_runners),
        ("num_gpus_per_env_runner", float(c.num_gpus_per_env_runner)),
        ("num_cpus_per_env_runner", float(c.num_cpus_per_env_runner)),
        ("num_learners", c.num_learners),
        ("num_gpus_per_learner", 1.0),
        ("num_cpus_per_learner", float(c.num_cpus_per_learner)),
        ("top_k", 0),
        ("sample_timeout_s", c.sample_timeout_s),
        ("evaluation_num_episodes", c.evaluation_num_episodes),
        ("num_checkpoints_to_keep", c.num_checkpoints_to_keep),
    ):
        out.set(name, value, FLASHRL_CHOICE)
    layout = FLASHRL_CHOICE + (f" ({c.learner_layout})" if c.learner_layout else "")
    out.set("max_tokens_per_micro_batch", c.max_tokens_per_micro_batch, layout)
    out.set("optimizer_offload", c.optimizer_offload, layout)
    out.set("engine_options.dtype", "bfloat16", FLASHRL_CHOICE + " (Molt's vllm.dtype default)")
    engine_args, source = dict(c.engine_args), FLASHRL_CHOICE
    if c.model_config:
        # vLLM reads the model's config with these fields replaced (its `hf_overrides`); without it,
        # vLLM refuses a max_model_len above the config's max_position_embeddings at engine start
        engine_args["hf_overrides"] = dict(c.model_config)
        source = c.model_config_source if not c.engine_args else f"{FLASHRL_CHOICE}; hf_overrides: {c.model_config_source}"
    if engine_args:
        out.set("engine_options.engine_args", engine_args, source)
