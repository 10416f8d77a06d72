"""What a learner trains and how: the model, the optimizer and the FlashREINFORCE loss settings."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

__all__ = ["DTYPES", "OPTIMIZERS", "LearnerSpec", "register_optimizer"]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Parameter dtypes a learner can train in."""

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter], "LearnerSpec"], torch.optim.Optimizer]

OPTIMIZERS: dict[str, OptimizerFactory] = {}
"""Optimizer name -> factory(parameters, spec). Add one with ``register_optimizer``."""


def register_optimizer(name: str) -> Callable[[OptimizerFactory], OptimizerFactory]:
    """Register ``factory(parameters, spec) -> torch.optim.Optimizer`` under ``name``."""

    def decorator(factory: OptimizerFactory) -> OptimizerFactory:
        if name in OPTIMIZERS:
            raise ValueError(f"An optimizer named {name!r} is already registered.")
        OPTIMIZERS[name] = factory
        return factory

    return decorator


@register_optimizer("adamw")
def _adamw(params: Iterable[torch.nn.Parameter], spec: LearnerSpec) -> torch.optim.Optimizer:
    # One parameter group: weight decay applies to every trainable parameter, norms and biases
    # included, as in Molt's AdamW (molt/trainer/fsdp/strategy.py, `_init_train_model`: all
    # `requires_grad` parameters in one group; only its Muon path exempts embeddings and the head).
    # foreach=False keeps the update order-independent and identical across data-parallel ranks.
    return torch.optim.AdamW(
        params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay, foreach=False
    )


@register_optimizer("sgd")
def _sgd(params: Iterable[torch.nn.Parameter], spec: LearnerSpec) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=spec.lr, weight_decay=spec.weight_decay, foreach=False)


@dataclass
class LearnerSpec:
    """Everything a ``Learner`` needs to build its policy, optimizer and loss (picklable)."""

    model: str
    """Local Hugging Face folder of the policy (config, weights, tokenizer), e.g. from resolve_model."""
    dtype: str = "float32"
    """Compute dtype of the policy: "float32", or "bfloat16" (with float32 master weights and optimizer)."""
    lr: float = 1e-6
    """Peak optimizer learning rate (one step per batch); the schedule multiplies it per update."""
    lr_schedule: str = "constant"
    """Name in LR_SCHEDULES: "constant" or "cosine_with_min_lr" (linear warmup, half cosine to a floor)."""
    lr_warmup_ratio: float = 0.0
    """cosine_with_min_lr: warmup updates = ceil(total_updates * ratio), lr rising linearly from 0."""
    min_lr_ratio: float = 0.0
    """cosine_with_min_lr: the final lr as a fraction of lr (held after total_updates)."""
    total_updates: int | None = None
    """Optimizer steps the run will take (the schedule's horizon); cosine_with_min_lr needs it."""
    optimizer: str = "adamw"
    """Name in the OPTIMIZERS registry: "adamw" or "sgd" (or one you registered)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's moment decay rates (ignored by SGD); Molt, the method's runtime, uses (0.9, 0.95)."""
    eps: float = 1e-8
    """AdamW's denominator epsilon (ignored by SGD)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (SGD) on every parameter; 0 keeps the gradient pure."""
    grad_clip: float | None = 1.0
    """Max global L2 norm of the gradient before the step; None turns clipping off."""
    delta: float = 0.01
    """Sequence Trust Region threshold: a trajectory is used iff its mean token drift <= delta (inf: all)."""
    baseline: str = "batch_mean"
    """Name in BASELINES: batch_mean (One-Batch REINFORCE), none, leave_one_out, group_mean, group_norm."""
    importance_sampling: str = "token"
    """Name in IMPORTANCE_SAMPLINGS: token (rho = q / p) or none (rho = 1, the reference's no_is)."""
    trust_region: str = "bernoulli_kl"
    """Name in TRUST_REGIONS: bernoulli_kl (clamped, as published), bernoulli_kl_exact, tv or none."""
    aggregation: str = "sample_mean"
    """Name in AGGREGATIONS: sample_mean (each trajectory weighs 1/B), token_mean or constant_length."""
    constant_length_normalizer: int | None = None
    """The L of aggregation="constant_length" (token sum / (B x L)), e.g. 6144."""
    negative_token_fraction: float = 1.0
    """q: a failed episode trains on its ceil(q * T_i) highest-entropy tokens; 1 = off (needs success labels)."""
    temperature: float = 1.0
    """The sampling temperature; current log-probs are recomputed under the same temperature."""
    logprob_chunk_size: int = 1024
    """Rows per chunk of the vocabulary projection when recomputing log-probs (memory vs speed)."""
    seed: int = 0
    """Seed of the learner's random number generators."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, about 30% more compute)."""
    device: str = "auto"
    """Where the policy lives: "auto" (the visible GPU if any, else CPU), "cpu", "cuda" or "cuda:N"."""

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        _check(isinstance(self.model, str) and self.model != "", "model", "a local model folder", self.model)
        _check(self.dtype in DTYPES, "dtype", f"one of {sorted(DTYPES)}", self.dtype)
        _check(self.optimizer in OPTIMIZERS, "optimizer", f"one of {sorted(OPTIMIZERS)}", self.optimizer)
        _check(math.isfinite(self.lr) and self.lr > 0, "lr", "a finite number > 0", self.lr)
        _check(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
            "betas", "two numbers in [0, 1)", self.betas,
        )
        _check(self.eps > 0, "eps", "a number > 0", self.eps)
        _check(self.weight_decay >= 0, "weight_decay", "a number >= 0", self.weight_decay)
        _check(
            self.grad_clip is None or (math.isfinite(self.grad_clip) and self.grad_clip > 0),
            "grad_clip", "None (off) or a finite number > 0", self.grad_clip,
        )
        _check(self.delta >= 0 and not math.isnan(self.delta), "delta", "a number >= 0 (inf = no trust region)",
               self.delta)
        _check(
            0.0 <= self.negative_token_fraction <= 1.0,
            "negative_token_fraction", "a number in [0, 1] (1 = no filter)", self.negative_token_fraction,
        )
        _check(
            self.constant_length_normalizer is None or (
                isinstance(self.constant_length_normalizer, int) and self.constant_length_normalizer >= 1),
            "constant_length_normalizer", "None or an integer >= 1", self.constant_length_normalizer,
        )
        _check(
            self.aggregation != "constant_length" or self.constant_length_normalizer is not None,
            "constant_length_normalizer", 'an integer >= 1 with aggregation="constant_length" (e.g. 6144)',
            self.constant_length_normalizer,
        )
        self._check_schedule()
        _check(
            math.isfinite(self.temperature) and self.temperature > 0,
            "temperature", "the sampling temperature, > 0 (greedy sampling has no log-probs to correct)",
            self.temperature,
        )
        _check(self.logprob_chunk_size >= 1, "logprob_chunk_size", "an integer >= 1", self.logprob_chunk_size)
        _check(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            "device", '"auto", "cpu", "cuda" or "cuda:N"', self.device,
        )
        from flashrl.algorithms.flash_reinforce.components import (
            AGGREGATIONS,
            BASELINES,
            IMPORTANCE_SAMPLINGS,
            TRUST_REGIONS,
        )

        for name, registry in (
            ("baseline", BASELINES), ("importance_sampling", IMPORTANCE_SAMPLINGS),
            ("trust_region", TRUST_REGIONS), ("aggregation", AGGREGATIONS),
        ):
            value = getattr(self, name)
            _check(value in registry, name, f"one of {registry.names()}", value)

    def _check_schedule(self) -> None:
        from flashrl.learners.schedule import LR_SCHEDULES

        _check(self.lr_schedule in LR_SCHEDULES, "lr_schedule", f"one of {sorted(LR_SCHEDULES)}", self.lr_schedule)
        _check(
            self.total_updates is None or (isinstance(self.total_updates, int) and self.total_updates >= 1),
            "total_updates", "None or an integer >= 1", self.total_updates,
        )
        for name in ("lr_warmup_ratio", "min_lr_ratio"):
            value = getattr(self, name)
            _check(0.0 <= value <= 1.0, name, "a number in [0, 1]", value)
        if self.lr_schedule == "cosine_with_min_lr":
            _check(self.total_updates is not None, "total_updates",
                   'the number of updates of the run with lr_schedule="cosine_with_min_lr"', self.total_updates)
        else:
            for name in ("lr_warmup_ratio", "min_lr_ratio"):
                _check(getattr(self, name) == 0.0, name,
                       f'0.0 with lr_schedule={self.lr_schedule!r} (only cosine_with_min_lr uses it)',
                       getattr(self, name))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def resolve_device(self) -> torch.device:
        """The torch device of ``device`` ("auto" picks the visible GPU when there is one)."""
        device = torch.device(self.device if self.device != "auto" else
                              "cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # NCCL and set_device need an index
        return device

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_config(cls, config: Any, *, model: str, **overrides: Any) -> LearnerSpec:
        """The spec of a ``FlashReinforceConfig``: every field both have, by name, and the rest derived.

        The learner's settings are config fields of the same name (``lr``, ``delta``, ``betas``, the
        component names, the schedule, ...). Derived: ``model`` (the resolved local folder), ``baseline``
        (the config's ``effective_baseline``), ``eps`` (the config's ``adam_eps``). ``overrides`` win.
        """
        shared = {f.name for f in fields(cls)} & {f.name for f in fields(config)}
        settings = {name: getattr(config, name) for name in shared}
        settings.update(model=model, baseline=config.effective_baseline, betas=tuple(config.betas),
                        eps=config.adam_eps, **overrides)
        return cls(**settings)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LearnerSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown LearnerSpec fields {unknown}; expected a subset of {sorted(known)}.")
        return cls(**dict(data))


def _check(ok: bool, name: str, expected: str, actual: Any) -> None:
    if not ok:
        raise ValueError(f"LearnerSpec.{name}: expected {expected}; got {actual!r}.")
