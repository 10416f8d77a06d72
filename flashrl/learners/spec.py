"""What a learner trains and how: the model, the optimizer, micro-batching, sharding, and the loss hook.

Nothing here is specific to an algorithm: the algorithm's settings live in its ``Loss`` object
(``LearnerSpec.loss``, e.g. ``flashrl.algorithms.flash_reinforce.learner_loss.FlashReinforceLoss``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from flashrl.learners.loss import Loss

__all__ = ["DTYPES", "OPTIMIZERS", "LearnerSpec", "register_optimizer"]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
"""Compute dtypes of a learner (bfloat16 keeps float32 master weights; float64 is for exact tests)."""

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
    """Compute dtype: "float32", or "bfloat16" (float32 master weights, optimizer and gradient reduction)."""
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
    max_tokens_per_micro_batch: int | None = None
    """Token budget of one forward/backward pass (gradients accumulate; one step per batch); None = one pass."""
    pack_sequences: bool | None = None
    """Pack a micro-batch's rows into one row without padding; None = only with flash attention (GPU)."""
    optimizer_offload: bool = False
    """Sharded learners: keep parameter shards, gradients and optimizer state in host memory (FSDP2)."""
    freeze_moe_router: bool = False
    """MoE models: keep the router (gate) weights fixed during RL, as Molt's ``freeze_moe_router``."""
    loss: Loss | None = None
    """The algorithm's loss hook (a flashrl.learners.Loss, e.g. FlashReinforceLoss); from_config builds it."""

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
        _check(
            self.max_tokens_per_micro_batch is None or (
                isinstance(self.max_tokens_per_micro_batch, int) and self.max_tokens_per_micro_batch >= 1),
            "max_tokens_per_micro_batch", "None (one pass per learner) or an integer >= 1",
            self.max_tokens_per_micro_batch,
        )
        _check(self.loss is None or isinstance(self.loss, Loss), "loss",
               "a flashrl.learners.Loss object (e.g. FlashReinforceLoss) or None", self.loss)

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
        """Plain values; the loss as ``{"type": "module:Class", **its fields}`` (a dataclass)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "loss"}
        out["betas"] = tuple(self.betas)
        if self.loss is not None:
            cls = type(self.loss)
            out["loss"] = {"type": f"{cls.__module__}:{cls.__qualname__}", **asdict(self.loss)}
        return out

    @classmethod
    def from_config(cls, config: Any, *, model: str, **overrides: Any) -> LearnerSpec:
        """The spec of an algorithm config: every field both have, by name, and the rest derived.

        The learner's settings are config fields of the same name (``lr``, ``betas``, the schedule,
        ``max_tokens_per_micro_batch``, ...). Derived: ``model`` (the resolved local folder), ``eps``
        (the config's ``adam_eps``) and ``loss`` (the config's ``build_learner_loss()``: the algorithm
        builds its own loss, so this module never imports one). ``overrides`` win.
        """
        shared = {f.name for f in fields(cls)} & {f.name for f in fields(config)}
        settings = {name: getattr(config, name) for name in shared}
        settings.update(model=model, betas=tuple(config.betas), eps=config.adam_eps,
                        loss=config.build_learner_loss(), **overrides)
        return cls(**settings)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LearnerSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown LearnerSpec fields {unknown}; expected a subset of {sorted(known)}.")
        data = dict(data)
        if isinstance(data.get("loss"), Mapping):
            data["loss"] = _build_loss(data["loss"])
        return cls(**data)


def _build_loss(data: Mapping[str, Any]) -> Loss:
    """The loss object that ``LearnerSpec.to_dict`` described (its class imported by name)."""
    import importlib

    settings = dict(data)
    kind = settings.pop("type", None)
    if not isinstance(kind, str) or ":" not in kind:
        raise ValueError(f"LearnerSpec.loss: expected a dict with a 'type' of the form 'module:Class'; got {kind!r}.")
    module, _, name = kind.partition(":")
    return getattr(importlib.import_module(module), name)(**settings)


def _check(ok: bool, name: str, expected: str, actual: Any) -> None:
    if not ok:
        raise ValueError(f"LearnerSpec.{name}: expected {expected}; got {actual!r}.")
