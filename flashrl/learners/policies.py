"""Where a learner's policy, gradients and optimizer state live: one process, or FSDP2 shards.

- ``LocalPolicy``: one learner, the whole model in this process (the CPU main job's learner in the
  driver, tests). A bfloat16 model keeps float32 master weights and optimizer state.
- ``ShardedPolicy``: rank ``r`` of ``W`` data-parallel learners. Parameters, gradients and optimizer
  state are dim-0 shards (torch FSDP2, ``flashrl.learners.fsdp``); each backward reduce-scatters the
  gradients as a SUM, which is exactly the gradient of the whole batch because every rank's loss is
  normalised by the GLOBAL batch (``docs/design.md`` §1; ``flashrl.learners.loss``). A bfloat16
  policy computes in bfloat16 and reduces in float32 over float32 master shards.

Both expose the same small surface to ``Learner``: ``run`` (a computation on the model),
``zero_grad``, ``clip_and_step``, ``full_weights``, ``sync_model`` (the module weight sync sends,
at ``LearnerSpec.weight_sync_dtype``), ``train_state`` / ``load_train_state`` (full tensors, parameter
names as keys, so a state moves between the two), ``save_state`` / ``load_state`` and ``save_policy``.
The last three hand the state to ``flashrl.checkpoints`` (``learner_state``, ``export``), which writes,
reads and unpickles every file. Every method of ``ShardedPolicy`` is a collective: call it on every
rank, in the same order.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flashrl.checkpoints import DCP_LAYOUT, SINGLE_FILE_LAYOUT
from flashrl.checkpoints.export import export_hf, replace_folder, save_adapter, save_pretrained
from flashrl.checkpoints.learner_state import (
    load_sharded_state,
    read_full_state,
    read_state_file,
    save_sharded_state,
    state_layout,
    write_state_file,
)
from flashrl.learners.freeze import freeze_moe_router
from flashrl.learners.fsdp import tied_aliases
from flashrl.learners.spec import OPTIMIZERS, LearnerSpec
from flashrl.models.lora import apply_lora, is_adapter_name, write_adapter_folder

__all__ = ["LocalPolicy", "ShardedPolicy", "attention_implementation"]


def attention_implementation(device: torch.device, dtype: torch.dtype) -> str | None:
    """flash_attention_2 for bfloat16 on a GPU where the package is installed (varlen packing), else None.

    None keeps transformers' default (sdpa where the architecture supports it).
    """
    if device.type == "cuda" and dtype == torch.bfloat16:
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
    return None


class LocalPolicy:
    """The whole policy and its optimizer in this process (no collectives)."""

    def __init__(self, spec: LearnerSpec, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        self.spec = spec
        self.model = AutoModelForCausalLM.from_pretrained(
            spec.model, dtype=spec.torch_dtype, attn_implementation=attention_implementation(device, spec.torch_dtype)
        ).to(device)
        self.model.config.use_cache = False
        # Eval mode: no dropout, so recomputed log-probs describe the policy the engines sample from.
        self.model.eval()
        if spec.gradient_checkpointing:
            _enable_hf_checkpointing(self.model)
        if spec.freeze_moe_router:  # before the optimizer: a frozen router gets no state, no decay
            freeze_moe_router(self.model)
        self.peft_model: Any = None
        """With LoRA (``spec.lora``): the ``PeftModel`` around ``model``, which peft injected the adapter into in
        place (base weights frozen), so ``model`` runs the learner's kernels unchanged; it saves the adapter."""
        if spec.lora is not None:
            self.peft_model = apply_lora(self.model, spec.lora)
            self.model.eval()
        self.names = [name for name, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # Low-precision training keeps float32 master weights (and so float32 optimizer state): a bf16
        # weight cannot register a step smaller than about 0.4% of itself, which RL learning rates are.
        # The masters are a float32 copy of the model (never run forward), so they can also be sent to
        # the engines as weights (``weight_sync_dtype='float32'``). A LoRA adapter is its own master:
        # peft keeps adapter weights in float32 over a bfloat16 base (``autocast_adapter_dtype``), and
        # the frozen base needs none.
        bf16_full = spec.torch_dtype == torch.bfloat16 and spec.lora is None
        self.master_model = copy.deepcopy(self.model).float() if bf16_full else self.model
        self.master_params = [p for p in self.master_model.parameters() if p.requires_grad]
        self.optimizer = OPTIMIZERS[spec.optimizer](self.master_params, spec)

    @property
    def sync_model(self) -> torch.nn.Module:
        """The module whose weights the engines receive: the float32 masters when the sync dtype asks for
        float32 and the model computes in bfloat16, else the model itself."""
        if self.master_model is not self.model and self.spec.sync_torch_dtype == torch.float32:
            return self.master_model
        return self.model

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for p in self.master_params:
            p.grad = None

    def clip_and_step(self, grad_clip: float | None) -> float | None:
        """Clip and take one optimizer step; None (and no step) if the gradient is not finite.

        Returns the gradient norm before clipping. A parameter without a gradient steps on zeros.
        """
        for p, master in zip(self.params, self.master_params):
            if p.grad is None:
                master.grad = torch.zeros_like(master)
            elif master is not p:
                master.grad = p.grad.to(master.dtype)
                p.grad = None
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.master_params])
        if not bool(torch.isfinite(grad_norm)):
            self.zero_grad()
            return None
        if grad_clip is not None:
            torch.nn.utils.clip_grads_with_norm_(self.master_params, grad_clip, grad_norm)
        self.optimizer.step()
        if self.master_model is not self.model:
            with torch.no_grad():
                for p, master in zip(self.params, self.master_params):
                    p.copy_(master)
        self.zero_grad()
        return float(grad_norm)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The ``state_dict`` as CPU copies; tied names share one copy."""
        copies: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, tensor in self.model.state_dict().items():
                key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
                if key not in copies:
                    copies[key] = tensor.detach().to("cpu", copy=True)
                out[name] = copies[key]
        return out

    def train_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(weights at master precision by name, optimizer state keyed by parameter name), CPU copies.

        With LoRA the weights are the adapter's only: the frozen base is the config's model.
        """
        model = self.full_weights() if self.peft_model is None else {}
        for name, master in zip(self.names, self.master_params):
            model[name] = master.detach().to("cpu", copy=True)
        for alias, primary in tied_aliases(self.model).items():
            if primary in model:  # LoRA: a tied base weight is not in the state
                model[alias] = model[primary]
        optimizer = _to_cpu(self.optimizer.state_dict())
        optimizer["state"] = {self.names[i]: v for i, v in optimizer["state"].items()}
        for group in optimizer["param_groups"]:
            group["params"] = [self.names[i] for i in group["params"]]
        return model, optimizer

    def load_train_state(self, model: dict[str, torch.Tensor], optimizer: dict[str, Any] | None) -> None:
        """Load full weights by name and the optimizer state (None: a fresh optimizer, as not yet stepped)."""
        index = {name: i for i, name in enumerate(self.names)}
        missing = sorted(set(self.names) - set(model))
        if missing:
            raise ValueError(f"Learner state has no weights for {missing[:3]}...; it belongs to another model.")
        if self.peft_model is not None:
            _check_adapter_state(model, self.names)
        with torch.no_grad():
            for name, tensor in self.model.state_dict(keep_vars=True).items():
                if self.peft_model is None or name in index:  # LoRA: the adapter; the base is the model's own
                    tensor.copy_(model[name])
            if self.master_model is not self.model:
                for name, tensor in self.master_model.state_dict(keep_vars=True).items():
                    tensor.copy_(model[name])
        if optimizer is None:
            self.optimizer.state.clear()
            return
        converted = dict(optimizer)
        converted["state"] = {index[name]: v for name, v in optimizer["state"].items()}
        converted["param_groups"] = [
            {**group, "params": [index[name] for name in group["params"]]} for group in optimizer["param_groups"]
        ]
        self.optimizer.load_state_dict(converted)

    def save_state(self, path: str | os.PathLike[str], extra: dict[str, Any]) -> str:
        """One file in the folder ``path``: the full weights and optimizer state, and ``extra``."""
        model, optimizer = self.train_state()
        return write_state_file(path, model, optimizer, extra)

    def load_state(self, path: str | os.PathLike[str], layout: str | None = None, *,
                   check: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Load a single learner's state file, or the DCP shards of sharded learners (every shard, in full).

        ``layout`` (a checkpoint manifest's ``learner_layout``) says which; None: the one present.
        ``check(extra)`` runs before anything loads (it raises for a state this learner must refuse).
        """
        state = read_full_state(path, layout)
        if check is not None:
            check(state.extra)
        self.load_train_state(state.model, state.optimizer)
        return state.extra

    def save_policy(self, path: str | os.PathLike[str], *, merged: bool = False) -> str:
        """The policy as a Hugging Face folder; with LoRA, the adapter in PEFT's format (``merged``: the
        base with the adapter merged into it, a plain model folder)."""
        if self.peft_model is not None:
            return save_adapter(self.peft_model, path, tokenizer_source=self.spec.model, merged=merged)
        return save_pretrained(self.model, path, tokenizer_source=self.spec.model)


class ShardedPolicy:
    """Rank ``rank`` of an FSDP2-sharded policy over the default process group."""

    def __init__(self, spec: LearnerSpec, device: torch.device, rank: int) -> None:
        from flashrl.learners import fsdp

        self.spec = spec
        self.rank = rank
        master = torch.float64 if spec.torch_dtype == torch.float64 else torch.float32
        lora = spec.lora
        # LoRA: the frozen base is stored in the compute dtype (it needs no master) and peft's adapter in
        # float32 over a 16-bit base, as ``LocalPolicy`` holds them; FSDP2 gathers a unit of mixed dtypes as
        # they are (it wants one dtype among the trainable parameters only, the adapter's), so nothing is cast.
        self.model = fsdp.load_pretrained_sharded(
            spec.model,
            dtype=master if lora is None else spec.torch_dtype,
            device=device,
            prepare=None if lora is None else (lambda model: apply_lora(model, lora)),
            param_dtype=None if spec.torch_dtype == master or lora is not None else spec.torch_dtype,
            activation_checkpointing=spec.gradient_checkpointing,
            cpu_offload=spec.optimizer_offload,
        )
        self.model.config.use_cache = False
        implementation = attention_implementation(device, spec.torch_dtype)
        if implementation is not None and self.model.config._attn_implementation != implementation:
            self.model.set_attn_implementation(implementation)
        if spec.freeze_moe_router:
            freeze_moe_router(self.model)
        # after the router is frozen: these are the optimizer's parameters, in its order
        self.names = [fsdp.clean_name(n) for n, p in self.model.named_parameters() if p.requires_grad]
        """The trainable parameters' names (every weight, or with LoRA the adapter's), the optimizer's order."""
        self.optimizer = OPTIMIZERS[spec.optimizer](self._trainable(), spec)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` as the root module's forward, so FSDP gathers and reshards the root around it.

        The learner's log-prob kernels call the decoder and the output layer themselves (no ``[N, V]``
        logits), not ``model.forward`` (``flashrl.learners.fsdp.call_through_root``).
        """
        from flashrl.learners import fsdp

        return fsdp.call_through_root(self.model, lambda _model: fn(*args))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def clip_and_step(self, grad_clip: float | None) -> float | None:
        from flashrl.learners import fsdp

        grad_norm = fsdp.clip_grad_norm(self.model.parameters(), grad_clip)  # global: equal on every rank
        if not bool(torch.isfinite(grad_norm)):
            self.zero_grad()
            return None
        self.optimizer.step()
        self.zero_grad()
        return float(grad_norm)

    @property
    def sync_model(self) -> torch.nn.Module:
        """The module whose weights the engines receive: the sharded model (its shards are the float32
        masters; the sync dtype casts them as they are gathered)."""
        return self.model

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Rank 0: the full tensors on the CPU under Hugging Face names (tied names share one); others: {}."""
        from flashrl.learners import fsdp

        gathered: dict[str, torch.Tensor] = {}
        for name, tensor in fsdp.iter_full_tensors(self.model, dtype=self.spec.torch_dtype, device="cpu"):
            if self.rank == 0:
                gathered[name] = tensor
        if self.rank != 0:
            return {}
        aliases = tied_aliases(self.model)
        names = [fsdp.clean_name(k) for k in self.model.state_dict(keep_vars=True)]
        return {name: gathered[aliases.get(name, name)] for name in names}

    def train_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Rank 0: full master weights and optimizer state by parameter name (CPU); others: empty.

        The optimizer state is gathered here, tensor by tensor, rather than by ``get_state_dict``, which
        initialises the state of a fresh optimizer with a zero step (AdamW's step count would then be
        one ahead of a single learner's).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from flashrl.learners import fsdp

        if self.spec.lora is None:
            model = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:  # the adapter only (the frozen base is the config's model), gathered tensor by tensor
            model = {name: fsdp.gather_full(p.detach(), dtype=None, device="cpu")
                     for name, p in zip(self.names, self._trainable(), strict=True)}
        names = self.names
        saved = self.optimizer.state_dict()  # keyed by position in the parameter list, shards as DTensors
        state = {
            names[i]: {k: fsdp.gather_full(v, dtype=None, device="cpu") if isinstance(v, torch.Tensor) else v
                       for k, v in entry.items()}
            for i, entry in sorted(saved["state"].items())  # the same order on every rank: each is a gather
        }
        if self.rank != 0:
            return {}, {}
        groups = [{**group, "params": [names[i] for i in group["params"]]} for group in saved["param_groups"]]
        return model, {"state": state, "param_groups": groups}

    def load_train_state(self, model: dict[str, torch.Tensor], optimizer: dict[str, Any] | None) -> None:
        """Load a full state (every rank holds it): each rank keeps its own shards.

        The optimizer state is sharded here, tensor by tensor like its parameter, rather than by
        ``set_state_dict``, which needs the optimizer to hold tensor state already (a fresh SGD has none).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.tensor import DTensor, distribute_tensor

        named = list(zip(self.names, self._trainable(), strict=True))
        index = {name: i for i, (name, _) in enumerate(named)}
        if self.spec.lora is None:
            set_model_state_dict(self.model, model, options=StateDictOptions(full_state_dict=True))
        else:  # the adapter's tensors into this rank's shards; the base stays the model's own
            _check_adapter_state(model, self.names)
            with torch.no_grad():
                for name, param in named:
                    _load_shard(param, model[name])
        if optimizer is None:
            self.optimizer.state.clear()
            return
        state: dict[int, dict[str, Any]] = {}
        for name, entry in optimizer["state"].items():
            param = named[index[name]][1]
            state[index[name]] = {
                key: distribute_tensor(value.to(param.device_mesh.device_type), param.device_mesh, param.placements)
                if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param.shape
                else value
                for key, value in entry.items()
            }
        groups = [{**group, "params": [index[name] for name in group["params"]]}
                  for group in optimizer["param_groups"]]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    def save_state(self, path: str | os.PathLike[str], extra: dict[str, Any]) -> str:
        """A DCP folder: every rank writes its own shards of the weights and optimizer state; ``extra`` once.

        An optimizer that has not stepped yet is not saved (``get_state_dict`` would first give it a
        zero step, one step ahead of a fresh one); a marker file says so. With LoRA the state is the
        adapter and its optimizer state (megabytes, no base weight): gathered to rank 0, which writes the
        single learner's one file (the manifest's ``learner_layout`` then says ``single_file``).
        """
        if self.spec.lora is not None:
            model, optimizer = self.train_state()
            if self.rank != 0:
                return str(Path(path).resolve())
            return write_state_file(path, model, optimizer, extra)
        return save_sharded_state(path, self.model, self.optimizer, extra, rank=self.rank)

    def load_state(self, path: str | os.PathLike[str], layout: str | None = None, *,
                   check: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Load a DCP folder (from any number of sharded ranks) or a single learner's state file.

        ``layout`` (a checkpoint manifest's ``learner_layout``) says which; None: the one present.
        ``check(extra)`` as ``LocalPolicy.load_state``'s (for DCP shards: after they load).
        """
        folder = Path(path).resolve()
        default = DCP_LAYOUT if self.spec.lora is None else SINGLE_FILE_LAYOUT
        found = state_layout(folder, layout, default=default)
        if self.spec.lora is not None and found == DCP_LAYOUT:
            raise ValueError(
                f"Learner state {folder}: expected a LoRA adapter's state (one file, learner_layout "
                f"'{SINGLE_FILE_LAYOUT}'), got DCP shards, which only a full-training run writes. Fix: resume it "
                "with lora_rank=None, or resume a checkpoint of a run with this run's lora_* settings."
            )
        if found == SINGLE_FILE_LAYOUT:
            model, optimizer, extra = read_state_file(folder)
            if check is not None:
                check(extra)
            self.load_train_state(model, optimizer)
            return extra
        extra = load_sharded_state(folder, self.model, self.optimizer)
        if check is not None:
            check(extra)
        return extra

    def save_policy(self, path: str | os.PathLike[str], *, merged: bool = False) -> str:
        """The policy as a Hugging Face folder, gathered to rank 0, which writes it (a collective).

        With LoRA: the adapter in PEFT's format, as ``LocalPolicy`` writes it; ``merged``: rank 0 loads the
        base model (host memory, once), injects the adapter and writes the merged model.
        """
        from flashrl.learners import fsdp

        if self.spec.lora is not None:
            adapter = {name: fsdp.gather_full(p.detach(), dtype=None, device="cpu")
                       for name, p in zip(self.names, self._trainable(), strict=True)}
            if self.rank != 0:
                return str(Path(path).resolve())
            return save_adapter_tensors(adapter, self.spec, path, merged=merged)
        if merged:
            raise ValueError("save_policy(merged=True) merges a LoRA adapter; this learner trains every weight.")
        dtype = None if self.spec.torch_dtype == torch.float32 else self.spec.torch_dtype
        return export_hf(self.model, path, tensors=fsdp.unique_state_items(self.model), gather=fsdp.gather_full,
                         tokenizer_source=self.spec.model, dtype=dtype)


    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


# --------------------------------------------------------------------------------------------------
def save_adapter_tensors(adapter: dict[str, torch.Tensor], spec: LearnerSpec, path: str | os.PathLike[str], *,
                         merged: bool = False) -> str:
    """An adapter's full tensors (state-dict names) as ``LocalPolicy.save_policy`` writes a live one.

    Unmerged: PEFT's two files from the tensors alone (``write_adapter_folder``, no base weight read) and
    the tokenizer. ``merged``: the base model of ``spec`` is loaded on the CPU, the adapter injected and
    filled, and peft merges and saves it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not merged:
        def write(tmp: Path) -> None:
            write_adapter_folder(tmp, adapter, spec.lora, spec.model)
            AutoTokenizer.from_pretrained(spec.model).save_pretrained(tmp)

        return replace_folder(path, write)
    base = AutoModelForCausalLM.from_pretrained(spec.model, dtype=spec.torch_dtype)
    with torch.random.fork_rng(devices=[]):  # the adapter's initialisation is overwritten: draw nothing
        peft_model = apply_lora(base, spec.lora)
    with torch.no_grad():
        for name, tensor in base.state_dict(keep_vars=True).items():
            if is_adapter_name(name):
                tensor.copy_(adapter[name])
    return save_adapter(peft_model, path, tokenizer_source=spec.model, merged=True)


def _load_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's shard of the full tensor ``full`` into the (FSDP2-sharded) parameter ``param``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        param.copy_(full)
        return
    local = param.to_local()
    mesh = param.device_mesh
    shard = distribute_tensor(full.to(device=mesh.device_type, dtype=param.dtype), mesh, param.placements)
    local.copy_(shard.to_local())


def _enable_hf_checkpointing(model: torch.nn.Module) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Transformers checkpoints a decoder layer only while that layer is in training mode; flag the
    # layers themselves (not their children) so checkpointing runs while dropout stays off.
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing:
            module.training = True


def _check_adapter_state(model: dict[str, torch.Tensor], names: list[str]) -> None:
    """A LoRA learner restores an adapter: weights of its own adapter's names only (not a full model's)."""
    foreign = sorted(name for name in model if not is_adapter_name(name))
    extra = sorted(set(model) - set(names) - set(foreign))
    if foreign or extra:
        raise ValueError(
            f"LoRA learner state: expected only this adapter's {len(names)} tensors (lora_A / lora_B), got "
            f"{len(foreign)} base-model weights (e.g. {foreign[:2]}) and {len(extra)} other adapter tensors "
            f"(e.g. {extra[:2]}). Fix: resume a checkpoint of a run with the same lora_* settings, or train with "
            "the checkpoint's settings (lora_rank=None for a full-training checkpoint)."
        )


def _to_cpu(value: Any) -> Any:
    """A deep copy of a nested structure with every tensor copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
