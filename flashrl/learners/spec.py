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
    """Optimizer learning rate (one step per batch, so this is the whole per-batch step size)."""
    optimizer: str = "adamw"
    """Name in the OPTIMIZERS registry: "adamw" or "sgd" (or one you registered)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's moment decay rates (ignored by SGD)."""
    eps: float = 1e-8
    """AdamW's denominator epsilon (ignored by SGD)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (SGD); 0 keeps the policy gradient pure."""
    grad_clip: float | None = 1.0
    """Max global L2 norm of the gradient before the step; None turns clipping off."""
    delta: float = 0.01
    """Sequence Trust Region threshold: a trajectory is used iff its mean token drift <= delta."""
    baseline: str = "batch_mean"
    """Name in BASELINES: batch_mean (One-Batch REINFORCE), none, leave_one_out, group_mean."""
    trust_region: str = "bernoulli_kl"
    """Name in TRUST_REGIONS: bernoulli_kl (Sequence Trust Region) or none (ablation)."""
    aggregation: str = "sample_mean"
    """Name in AGGREGATIONS: sample_mean (each trajectory weighs 1/B) or token_mean (ablation)."""
    failure_entropy_quantile: float | None = None
    """If set (0..1), negative-advantage trajectories train only on tokens at/above this entropy quantile."""
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
        _check(self.delta >= 0 and not math.isnan(self.delta), "delta", "a number >= 0", self.delta)
        _check(
            self.failure_entropy_quantile is None or 0.0 <= self.failure_entropy_quantile <= 1.0,
            "failure_entropy_quantile", "None or a number in [0, 1]", self.failure_entropy_quantile,
        )
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
        from flashrl.algorithms.flash_reinforce.components import AGGREGATIONS, BASELINES, TRUST_REGIONS

        for name, registry in (
            ("baseline", BASELINES), ("trust_region", TRUST_REGIONS), ("aggregation", AGGREGATIONS)
        ):
            value = getattr(self, name)
            _check(value in registry, name, f"one of {registry.names()}", value)

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
    def from_dict(cls, data: Mapping[str, Any]) -> LearnerSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown LearnerSpec fields {unknown}; expected a subset of {sorted(known)}.")
        return cls(**dict(data))


def _check(ok: bool, name: str, expected: str, actual: Any) -> None:
    if not ok:
        raise ValueError(f"LearnerSpec.{name}: expected {expected}; got {actual!r}.")
