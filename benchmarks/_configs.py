"""The CPU main job's arithmetic task at a benchmark's size, and the reference's variants as config fields.

* `main_job()` (in `_repo`) is `tuned_examples/smollm2_arithmetic_cpu.py`, imported, not copied: its
  `make_config` gives the task (easy sums with the held-out split), the model and the
  hyperparameters every arm starts from.
* `reference_fields(name)`: a variant of the method's public release (`grpo`, `no_trust`, `no_is`,
  `token_mean`, `constant_length`, `negative_q09`) as the config fields it changes, derived from
  `flashrl.reproduction.experiments` through `flashrl.reproduction.translate` (the same translation the tuned
  examples use), never retyped; `staleness_fields(q)` likewise for the reference's queue depths.
* `Scale` (`FULL`, `QUICK`) and `arithmetic_config(scale, ...)`: the main job's config at a size.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _repo import main_job

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


def _setting_fields(setting: str, variants: Sequence[str] = ()) -> dict[str, Any]:
    from flashrl.reproduction.experiments import resolve_experiment
    from flashrl.reproduction.translate import flashrl_fields

    return flashrl_fields(resolve_experiment(setting, variants)).values


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
    from flashrl.reproduction.experiments import EXPERIMENTS, REFERENCE

    setting, variant = REFERENCE_VARIANTS[name]
    return f"{REFERENCE}: {EXPERIMENTS[setting].source}, variant {variant!r}"


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
