"""What a learner trains and how: the model, the optimizer, micro-batching, sharding, and the loss hook.

Nothing here is specific to an algorithm: the algorithm's settings live in its ``Loss`` object
(``LearnerSpec.loss``, e.g. ``flashrl.algorithms.flash_reinforce.learner_loss.FlashReinforceLossSpec``),
and the learner group's size and resources are fields here, so one spec describes the learner side.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from flashrl.learners.loss import Loss
from flashrl.learners.schedule import LR_SCHEDULES
from flashrl.models.lora import LoRASettings
from flashrl.models.packed_attention import PACK_ATTENTION
from flashrl.models.routing_replay import routing_replay_problem
from flashrl.user_code import UserCodeError, import_path
from flashrl.validation import Checks, is_number, setting

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
        params, lr=spec.lr, betas=spec.betas, eps=spec.adam_eps, weight_decay=spec.weight_decay, foreach=False
    )


@register_optimizer("sgd")
def _sgd(params: Iterable[torch.nn.Parameter], spec: LearnerSpec) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=spec.lr, weight_decay=spec.weight_decay, foreach=False)


@dataclass
class LearnerSpec:
    """Everything a ``Learner`` (and its group) needs to build the policy, optimizer and loss (picklable).

    Each field is declared and checked only here; an algorithm's config holds these settings by their
    names and builds the spec with ``config.learner_spec()``. ``section`` metadata names the config
    builder method that sets a field (``training`` unless said otherwise); ``derived`` fields are not
    settings of a config but filled in when it builds the spec (``flashrl.validation``).
    """

    # --- the learner actors ------------------------------------------------------------------------
    num_learners: int = setting(0, section="learners", integer=True, ge=0)
    """Learner actors; 0 = one learner inside the algorithm's process (like RLlib)."""
    num_cpus_per_learner: float = setting(1.0, section="learners", ge=0)
    """Logical CPUs each Learner actor reserves (with num_learners = 0: the algorithm's process)."""
    num_gpus_per_learner: float = setting(0.0, section="learners", ge=0)
    """GPUs each Learner actor reserves; > 0 trains on CUDA (NCCL between learners)."""
    custom_resources_per_learner: dict[str, float] = setting(default_factory=dict, section="learners")
    """Ray custom resources each Learner actor asks for, e.g. {"learner_node": 1} (RLlib's name; docs/training.md,
    Running on a cluster); {} = any node; unused with num_learners = 0 (the learner is the algorithm's process)."""
    max_tokens_per_micro_batch: int | None = setting(
        None, section="learners", integer=True, ge=1, optional="one pass per learner",
        fix="use e.g. 8192, at least the longest episode (max_episode_tokens) to keep passes full")
    """Tokens per learner forward/backward pass (gradients accumulate; one step per batch); None = one."""
    pack_sequences: bool | None = setting(None, section="learners")
    """Pack a micro-batch's episodes into one row without padding; None = only with flash attention (GPU)."""
    pack_attention: str | None = setting(None, section="learners")
    """Attention of packed passes: 'flex' (FlexAttention, CUDA), 'sdpa_mask' or 'flash_varlen'; None = auto."""
    optimizer_offload: bool = setting(False, section="learners")
    """With num_learners >= 2 (FSDP2): keep parameter shards, gradients and optimizer state in host memory."""
    freeze_moe_router: bool = setting(False, section="learners")
    """Freeze the MoE router (gate) weights during RL (``flashrl.learners.freeze``); MoE models only."""
    lora_rank: int | None = setting(None, section="learners", integer=True, ge=1, optional="full training",
                                    fix="use e.g. 16 (vLLM serves ranks 1, 8, 16, 32, 64, 128, 256, 320, 512)")
    """Train a LoRA adapter of this rank (peft; ``docs/training.md``, LoRA) instead of every weight; None = full."""
    lora_alpha: float = setting(32.0, section="learners", gt=0, fix="use e.g. 2 * lora_rank")
    """LoRA's alpha: the adapter's update is scaled by lora_alpha / lora_rank."""
    lora_target_modules: str = setting("all-linear", section="learners")
    """The layers LoRA adapts: 'all-linear' (every linear layer but the head) or names, e.g. 'q_proj,v_proj'."""
    lora_dropout: float = setting(0.0, section="learners", ge=0, lt=1, fix="use 0.0 (RL recomputes exact log-probs)")
    """Dropout on the adapter's input while training (0.0 keeps the learner's log-probs the sampler's)."""

    # --- the model and the optimizer ----------------------------------------------------------------
    model: str = "smollm2-135m-instruct"
    """Policy model: a local Hugging Face folder, a hub id, or a flashrl model name (the learner loads a
    local folder: an algorithm resolves the name first, ``flashrl.models.resolve_model``)."""
    dtype: str = setting("float32", choices=DTYPES, fix="use 'float32' on CPU, 'bfloat16' on GPU")
    """Learner compute dtype: 'float32' or 'bfloat16' (float32 master weights, optimizer, gradient sums)."""
    weight_sync_dtype: str | None = setting(
        None, choices=("float32", "bfloat16"), optional="the compute dtype",
        fix="use 'float32' when a bfloat16 learner feeds float32 engines, else None")
    """Dtype of the weights sent to the engines: None = the compute dtype; 'float32' with a bfloat16
    learner sends its float32 master weights, which a float32 engine (vLLM on CPU, the torch engine)
    needs to see small steps: a bfloat16 weight moves only when its master crosses a rounding step
    (about 0.4% of the weight), so at RL learning rates a bf16-rounded push leaves the sampler's
    policy nearly frozen for many updates."""
    lr: float = setting(1e-6, gt=0)
    """Peak learning rate of the single optimizer step per batch (lr_schedule scales it per update)."""
    lr_schedule: str = "constant"
    """'constant' or 'cosine_with_min_lr' (linear warmup, half cosine down to min_lr_ratio * lr)."""
    lr_warmup_ratio: float = setting(0.0, ge=0, le=1, fix="e.g. lr_warmup_ratio=0.0")
    """cosine_with_min_lr: ceil(total_updates * ratio) warmup updates from lr 0 (the reference: 0.03)."""
    min_lr_ratio: float = setting(0.0, ge=0, le=1, fix="e.g. min_lr_ratio=0.0")
    """cosine_with_min_lr: the final lr as a fraction of lr (the reference: 0.1)."""
    total_updates: int | None = setting(None, integer=True, ge=1, optional=True,
                                        fix="the run's number of updates, e.g. 500")
    """Updates (optimizer steps) of the whole run, the schedule's horizon; cosine_with_min_lr needs it."""
    grad_clip: float | None = setting(1.0, gt=0, optional=True, fix="use None to disable clipping")
    """Global gradient-norm clip; None = no clipping."""
    optimizer: str = "adamw"
    """Optimizer name in the learners' registry (OPTIMIZERS): 'adamw' or 'sgd'."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas (ignored by sgd); the reference's runtime uses (0.9, 0.95)."""
    adam_eps: float = setting(1e-8, gt=0)
    """Adam's denominator epsilon (ignored by sgd)."""
    weight_decay: float = setting(0.0, ge=0)
    """Decoupled weight decay on every parameter (norms and biases too); 0 = a pure policy-gradient step."""
    logprob_chunk_size: int = setting(1024, integer=True, ge=1)
    """Tokens per chunk when the learner recomputes log-probs (bounds the [N, V] memory)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, about 30% slower)."""

    # --- filled in by whoever builds the spec ---------------------------------------------------------
    temperature: float = setting(1.0, derived="the env runners' sampling temperature", gt=0)
    """The sampling temperature; current log-probs are recomputed under the same temperature."""
    seed: int = setting(0, derived="the run's seed (the env runners' seed)", integer=True, ge=0)
    """Seed of the learner's random number generators."""
    device: str = setting("auto", derived="'auto'; the learner group places each rank")
    """Where the policy lives: "auto" (the visible GPU if any, else CPU), "cpu", "cuda" or "cuda:N"."""
    loss: Loss | None = setting(None, derived="the algorithm's loss object", code="path")
    """The algorithm's loss hook (a flashrl.learners.Loss, e.g. FlashReinforceLossSpec)."""
    log_level: str = setting("WARNING", derived="the run's log_level (the debugging section's)")
    """Python logging level of the flashrl loggers in a learner actor's process."""
    routing_replay: bool = setting(False, derived="the env runners' routing_replay")
    """R3: the forward routes every token to the experts the engine recorded (gates recomputed from the current
    router); MoE models only (``flashrl.models.routing_replay``)."""

    def __post_init__(self) -> None:
        check = Checks("LearnerSpec")
        check.fields(self)
        _check_values(self, check)
        check.done()
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        self.custom_resources_per_learner = dict(self.custom_resources_per_learner)  # not the caller's dict

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def lora(self) -> LoRASettings | None:
        """The adapter's settings (``flashrl.models.lora``), or None for full training."""
        if self.lora_rank is None:
            return None
        return LoRASettings(rank=int(self.lora_rank), alpha=float(self.lora_alpha),
                            target_modules=self.lora_target_modules, dropout=float(self.lora_dropout))

    @property
    def sync_torch_dtype(self) -> torch.dtype:
        """The dtype of the weights the engines receive (``weight_sync_dtype``, else the compute dtype)."""
        return DTYPES[self.weight_sync_dtype] if self.weight_sync_dtype is not None else self.torch_dtype

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
        out["custom_resources_per_learner"] = dict(self.custom_resources_per_learner)
        if self.loss is not None:
            cls = type(self.loss)
            # A loss's own to_dict (when it has one) writes its user code as text (flashrl.user_code).
            settings = self.loss.to_dict() if hasattr(self.loss, "to_dict") else asdict(self.loss)
            out["loss"] = {"type": f"{cls.__module__}:{cls.__qualname__}", **settings}
        return out

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
    """The loss object that ``LearnerSpec.to_dict`` described: its class by path, where a path may lead
    (flashrl's or the user's own code, ``flashrl.user_code``), and a `Loss` subclass."""
    settings = dict(data)
    kind = settings.pop("type", None)
    if not isinstance(kind, str) or ":" not in kind:
        raise ValueError(f"LearnerSpec.loss: expected a dict with a 'type' of the form 'module:Class'; got {kind!r}.")
    try:
        cls = import_path(kind)
    except UserCodeError as err:
        raise ValueError(f"LearnerSpec.loss: expected the 'type' of a loss class, got {kind!r}: {err}") from err
    if not (isinstance(cls, type) and issubclass(cls, Loss)):
        raise TypeError(f"LearnerSpec.loss: expected the 'type' of a flashrl.learners.Loss subclass, got {kind!r}, "
                        "which is not one. Fix: name the loss class (e.g. the algorithm's loss spec)")
    return cls(**settings)


def _check_values(spec: LearnerSpec, check: Checks) -> None:
    check.gpus(spec, "num_gpus_per_learner")
    check.custom_resources(spec, "custom_resources_per_learner")
    check.expect(spec.pack_sequences in (None, True, False), "pack_sequences", "None (auto), True or False",
                 spec.pack_sequences, "use None")
    check.expect(spec.pack_attention is None or spec.pack_attention in PACK_ATTENTION, "pack_attention",
                 f"None (auto) or one of {', '.join(PACK_ATTENTION)}", spec.pack_attention, "use None")
    # Whether the learners are sharded is known where the group is formed (the group size reaches
    # LearnerGroup as an argument): the Learner refuses offload on one rank, and an algorithm config,
    # which holds both settings, refuses it before anything starts.
    check.expect(spec.optimizer_offload in (True, False), "optimizer_offload", "True or False",
                 spec.optimizer_offload, "use False unless num_learners >= 2")
    check.expect(spec.freeze_moe_router in (True, False), "freeze_moe_router", "True or False",
                 spec.freeze_moe_router, "use True only for a mixture-of-experts model")
    _check_lora(spec, check)
    check.expect(spec.routing_replay in (True, False), "routing_replay", "True or False", spec.routing_replay,
                 "use True only for a mixture-of-experts model")
    if spec.routing_replay is True and isinstance(spec.model, str) and spec.model:
        dense = routing_replay_problem(spec.model)
        check.expect(dense is None, "routing_replay", "False for this model, or a mixture-of-experts model "
                     f"({dense})", True, "set routing_replay=False, or train an MoE model (e.g. Qwen3-MoE)")
    check.expect(isinstance(spec.model, str) and spec.model != "", "model",
                 "a local Hugging Face folder, a hub id or a flashrl model name", spec.model,
                 "e.g. .training(model='smollm2-135m-instruct')")
    if spec.dtype == "float64" and spec.weight_sync_dtype is not None:
        check.expect(False, "weight_sync_dtype", "None with dtype='float64' (exact tests sync at float64)",
                     spec.weight_sync_dtype, "leave weight_sync_dtype unset")
    check.expect(spec.optimizer in OPTIMIZERS, "optimizer", f"one of {sorted(OPTIMIZERS)}", spec.optimizer,
                 "use 'adamw', or register yours with flashrl.learners.register_optimizer")
    check.expect(isinstance(spec.betas, (tuple, list)) and len(spec.betas) == 2
                 and all(is_number(b) and 0 <= b < 1 for b in spec.betas),
                 "betas", "two numbers in [0, 1)", spec.betas, "use (0.9, 0.999)")
    check.expect(isinstance(spec.device, str) and (spec.device in ("auto", "cpu") or spec.device.startswith("cuda")),
                 "device", '"auto", "cpu", "cuda" or "cuda:N"', spec.device, 'use "auto"')
    check.expect(spec.loss is None or isinstance(spec.loss, Loss), "loss",
                 "a flashrl.learners.Loss object (e.g. FlashReinforceLossSpec) or None", spec.loss,
                 "pass the algorithm's loss object")
    _check_schedule(spec, check)


def _check_lora(spec: LearnerSpec, check: Checks) -> None:
    """The adapter's settings (the rank's and alpha's bounds are their fields'); only with lora_rank set."""
    if spec.lora_rank is None:
        return
    check.expect(isinstance(spec.lora_target_modules, str) and spec.lora_target_modules.strip() != "",
                 "lora_target_modules", "'all-linear' or comma-separated layer names", spec.lora_target_modules,
                 "use 'all-linear' or e.g. 'q_proj,k_proj,v_proj,o_proj'")
    if isinstance(spec.model, str) and spec.model and isinstance(spec.lora_target_modules, str):
        from flashrl.models.lora import lora_target_problem

        problem = lora_target_problem(spec.model, spec.lora_target_modules)  # says expected, actual and fix
        if problem is not None:
            check.problems.append(problem)


def _check_schedule(spec: LearnerSpec, check: Checks) -> None:
    total = spec.total_updates
    if spec.lr_schedule not in LR_SCHEDULES:
        check.expect(False, "lr_schedule", f"one of {tuple(LR_SCHEDULES)}", spec.lr_schedule,
                     "use 'constant' or 'cosine_with_min_lr'")
    elif spec.lr_schedule == "cosine_with_min_lr" and total is None:
        check.expect(False, "total_updates", "the run's number of updates with lr_schedule='cosine_with_min_lr' (the "
                     "schedule's horizon)", total, "set total_updates, e.g. .training(total_updates=500)")
    elif spec.lr_schedule == "constant":
        for name in ("lr_warmup_ratio", "min_lr_ratio"):
            value = getattr(spec, name)
            check.expect(not is_number(value) or value == 0, name, "0.0 with lr_schedule='constant' (only "
                         "cosine_with_min_lr uses it; Molt's constant schedule ignores it too)", value,
                         f"set {name}=0.0 or lr_schedule='cosine_with_min_lr'")
