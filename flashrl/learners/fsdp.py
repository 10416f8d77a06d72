"""Fully sharded data parallelism (torch FSDP2) for the policy: sharding, the root call, full tensors.

With two or more learners every rank holds dim-0 shards of the policy, its gradients and its optimizer
state (``flashrl.learners.policies.ShardedPolicy``); one learner holds the whole model and needs no
collective (``LocalPolicy``). Nothing replicates the model and sums gradients by hand: FSDP2's backward
reduce-scatters them (``flashrl.learners.distributed`` only sets up the process group and reduces the
update's metrics). This module is the building block, with torch's own engines and nothing home-made
where those serve:

- ``load_pretrained_sharded``: build a Hugging Face model on the meta device, shard it, and fill the
  shards from rank 0's copy of the weights, so only rank 0 ever holds the whole model.
- ``shard_model``: ``fully_shard`` on every decoder layer and on the root (parameters, gradients and
  optimizer state live as dim-0 shards, ``DTensor`` s); optional bf16 compute with float32 reduction
  (``MixedPrecisionPolicy``), activation checkpointing per decoder layer, CPU offload
  (``CPUOffloadPolicy``). Gradients are reduce-scattered as a SUM, not FSDP's default mean: the
  learner's loss is already normalised by the GLOBAL batch (``-(1/B) sum_{i in shard} ...``, see
  ``docs/design.md`` section 1), so the summed shard gradients are exactly the global gradient.
- The optimizer is a plain ``torch.optim.AdamW`` over the sharded parameters (it steps ``DTensor`` s
  shard by shard), built by the learner (``flashrl/learners/spec.py``: one group).
- ``clip_grad_norm``: the global gradient norm across shards (``torch.nn.utils`` on ``DTensor``
  gradients reduces the per-shard norms), optional clipping.
- ``iter_full_tensors`` (``unique_state_items`` gathered by ``gather_full``): the full tensors one at
  a time, for streaming weights into inference engines and for the Hugging Face export without
  materialising the whole model.

Checkpoints of a sharded policy (DCP shards, the Hugging Face export) are written and read by
``flashrl.checkpoints`` (``dcp``, ``export``); the policy hands it the model, the optimizer and these
full-tensor helpers.

Every function that gathers is a collective: call it on every rank, in the same order.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

from flashrl.learners.distributed import check_collective_device

__all__ = [
    "call_through_root",
    "clean_name",
    "clip_grad_norm",
    "decoder_layers",
    "gather_full",
    "iter_full_tensors",
    "load_pretrained_sharded",
    "shard_model",
    "tied_aliases",
    "unique_state_items",
]

_ROOT_CALL = "_flashrl_call_through_root"
_T = TypeVar("_T")


# --------------------------------------------------------------------------------------------------
# Sharding
def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a Hugging Face causal LM, in forward order.

    ``model.model.layers`` (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, ...) when it exists; otherwise
    every module whose class is named in ``model._no_split_modules`` (what transformers itself keeps
    whole when it splits a model across devices), outermost first.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) > 0:
        return list(layers)
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: list[nn.Module] = []
    for module in model.modules():
        if type(module).__name__ in names and not any(_contains(outer, module) for outer in found):
            found.append(module)
    if not found:
        raise ValueError(
            f"Found no decoder layers in {type(model).__name__}: expected a non-empty nn.ModuleList at "
            f"model.model.layers or modules of the classes in _no_split_modules ({sorted(names) or 'none'}). "
            "Pass the layers explicitly with shard_model(..., layers=[...])."
        )
    return found


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def shard_model(
    model: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    gradient_reduction: Literal["sum", "mean"] = "sum",
    layers: Sequence[nn.Module] | None = None,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2: each decoder layer is one unit, the root holds the rest.

    The root unit holds the embeddings, the final norm and the LM head, so tied embeddings
    (``lm_head.weight is model.embed_tokens.weight``, SmolLM2) stay one parameter: FSDP2 registers a
    parameter shared by two modules of one unit on both.

    Activation checkpointing uses torch's ``checkpoint_wrapper`` (non-reentrant) around each layer,
    applied before ``fully_shard`` so that FSDP's hooks sit outside the checkpointed region: the
    all-gather happens once before the layer's forward and once before its backward, and the
    recomputation runs on the already-gathered parameters. transformers' own
    ``gradient_checkpointing_enable`` would also compose (FSDP2 skips its pre-forward hook during the
    recompute), but it checkpoints a layer only while ``layer.training`` is set, and the learner keeps
    the policy in eval mode (no dropout). The wrapper adds ``_checkpoint_wrapped_module.`` to
    ``named_parameters()`` names; ``state_dict()``, DCP and every function here strip it.

    Args:
        model: the policy, on the device it will train on (``cuda`` with NCCL, ``cpu`` with gloo), its
            parameters in the master dtype (float32: the optimizer steps these).
        mesh: the data-parallel mesh; default: 1-D over the default process group on the model's device.
        param_dtype: dtype of the gathered parameters, i.e. of forward and backward (``torch.bfloat16``
            on GPUs); None computes in the master dtype (exact; the CPU default).
        reduce_dtype: dtype of the gradient reduce-scatter. None: float32 when ``param_dtype`` is a 16-bit
            type (bf16 gradients then sum without rounding each partial sum), else the master dtype (a
            float64 model must not reduce in float32).
        activation_checkpointing: recompute each decoder layer's activations in backward.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory
            (``CPUOffloadPolicy``; the optimizer step then runs on the CPU).
        reshard_after_forward: free each layer's gathered parameters after its forward (gathered again
            in backward): less memory, one more all-gather per layer.
        gradient_reduction: ``"sum"`` (the learner's global-normaliser losses) or ``"mean"`` (FSDP's
            default, for losses that are a per-rank mean).
        layers: the units to shard one by one; default ``decoder_layers(model)``.

    Returns:
        ``model`` itself, now an ``FSDPModule`` whose parameters are ``DTensor`` s.
    """
    if gradient_reduction not in ("sum", "mean"):
        raise ValueError(f"gradient_reduction must be 'sum' or 'mean'; got {gradient_reduction!r}.")
    if not dist.is_initialized():
        raise RuntimeError(
            "shard_model needs torch.distributed: call flashrl.learners.distributed.init_process_group "
            "(or torch.distributed.init_process_group) on every rank first; one rank works with world_size=1."
        )
    if isinstance(model, FSDPModule):
        raise ValueError(f"{type(model).__name__} is already sharded; call shard_model once per model.")  # noqa: TRY004  a state, not a type, is wrong
    units = list(layers) if layers is not None else decoder_layers(model)
    mesh = mesh or _default_mesh(model)
    if reduce_dtype is None and param_dtype is not None and param_dtype.itemsize < 4:
        reduce_dtype = torch.float32
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    if activation_checkpointing:
        units = [_wrap_in_place(model, layer) for layer in units]
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy, offload_policy=offload,
                    reshard_after_forward=reshard_after_forward)
    # The root is gathered last in forward and needed first in backward: keep it gathered in between.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=False)
    if gradient_reduction == "sum":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # Divide by 1 and use a plain SUM (gloo has no PREMUL_SUM, which a bare factor would pick).
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
    return model


def load_pretrained_sharded(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    prepare: Callable[[nn.Module], Any] | None = None,
    **shard_options: Any,
) -> nn.Module:
    """A Hugging Face causal LM from ``path``, sharded, without every rank loading the whole model.

    Every rank builds the model on the meta device (no memory) and shards it; the shards are then
    allocated on ``device`` and filled from rank 0, which alone loads the checkpoint (host memory),
    through DCP's ``set_model_state_dict(..., broadcast_from_rank0=True)``. Buffers that are not in the
    checkpoint (rotary ``inv_freq``) are broadcast from rank 0's loaded copy as well. ``dtype`` is the
    master dtype (what the optimizer steps); ``shard_options`` go to ``shard_model``.

    ``prepare(model)`` changes the model in place before it is sharded (a LoRA learner injects its
    adapter, ``flashrl.models.lora.apply_lora``): it runs on every rank's meta model, under a forked
    random state (so the meta build draws nothing from the seeded generator), and on rank 0's loaded
    copy, whose values (the adapter's random initialisation included) every rank then receives.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(device)
    config = AutoConfig.from_pretrained(path)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if prepare is not None:
            prepare(model)
    shard_options.setdefault("mesh", init_device_mesh(device.type, (dist.get_world_size(),)))
    shard_model(model, **shard_options)
    # Offloaded shards live in host memory; buffers (rotary tables) are used by compute on ``device``.
    model.to_empty(device="cpu" if shard_options.get("cpu_offload") else device)
    for module in model.modules():
        for key, buffer in module.named_buffers(recurse=False):
            module._buffers[key] = buffer.to(device)
    full: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    if _rank() == 0:
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        if prepare is not None:
            prepare(loaded)
        full = loaded.state_dict()
        buffers = {clean_name(k): v for k, v in loaded.named_buffers()}
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if _rank() == 0:
                buffer.copy_(buffers[clean_name(name)])
            check_collective_device(buffer)
            dist.broadcast(buffer, src=0)
    return model.eval()


def call_through_root(model: nn.Module, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``fn(model, *args, **kwargs)``, run as the root's forward: FSDP's root hooks around it.

    FSDP gathers the root unit (embeddings, final norm, LM head) in the root's pre-forward hook and
    reduce-scatters its gradients from hooks that forward installs. Code that never calls the root's
    ``forward`` -- ``flashrl.models.compute_token_logprobs`` runs ``model.get_decoder()`` and reads
    ``lm_head.weight`` itself, so that no ``[N, V]`` logits exist -- must go through this
    (``torch.distributed.fsdp.register_fsdp_forward_method`` under the hood). A model that is not
    sharded is called directly.
    """
    if not isinstance(model, FSDPModule):
        return fn(model, *args, **kwargs)
    if _ROOT_CALL not in vars(model):
        object.__setattr__(model, _ROOT_CALL, types.MethodType(_call_with_self, model))
        register_fsdp_forward_method(model, _ROOT_CALL)
    return getattr(model, _ROOT_CALL)(fn, *args, **kwargs)


def _call_with_self(self: nn.Module, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    return fn(self, *args, **kwargs)


def _default_mesh(model: nn.Module) -> DeviceMesh:
    device = next(model.parameters()).device
    if device.type == "meta":
        raise ValueError("shard_model got a model on the meta device; materialise it first, or pass a mesh.")
    return init_device_mesh(device.type, (dist.get_world_size(),))


def _wrap_in_place(root: nn.Module, layer: nn.Module) -> nn.Module:
    """Replace ``layer`` in its parent by a non-reentrant checkpoint wrapper around it; return the wrapper."""
    for parent in root.modules():
        for name, child in parent.named_children():
            if child is layer:
                wrapped = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
                parent.register_module(name, wrapped)
                return wrapped
    raise ValueError(f"Layer {type(layer).__name__} is not a submodule of {type(root).__name__}.")


def clean_name(name: str) -> str:
    """A parameter name as the state dict and Hugging Face spell it (no checkpoint-wrapper segment)."""
    return name.replace(_CHECKPOINT_PREFIX, "")


# --------------------------------------------------------------------------------------------------
# Optimizer and gradient clipping
def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """The global L2 norm of the gradients across every shard; clips them to ``max_norm`` if given.

    Returns a plain 0-dim tensor, equal on every rank (the norm of the unsharded gradient). A
    non-finite norm is returned without clipping, so the caller can skip the step.
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)  # a DTensor when the grads are sharded
    full = _full(total)
    if max_norm is not None and bool(torch.isfinite(full)):
        # The DTensor norm, not the plain copy: DTensor grads refuse to be scaled by a plain tensor.
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return full


def _full(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, DTensor):
        return t
    check_collective_device(t.to_local())  # an offloaded norm is a CPU tensor: the group needs a CPU backend
    return t.full_tensor()


# --------------------------------------------------------------------------------------------------
# Full weights: gathered one tensor at a time (weight sync, the Hugging Face export, get_state)
def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: primary}`` for parameters registered under several names (tied embeddings)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = clean_name(name)
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def iter_full_tensors(
    model: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every entry of the state dict, one at a time, gathered on demand.

    Names are the Hugging Face ones; a tied parameter is yielded once, under its first name
    (``model.embed_tokens.weight``; vLLM and transformers re-tie ``lm_head.weight`` from the config).
    Each tensor is all-gathered on every rank (a collective: consume the generator on every rank, to
    the end), cast to ``dtype`` if given (floating point only) and moved to ``device`` (None: where it
    was gathered). The caller holds one full tensor at a time beyond the sharded model.
    """
    for name, tensor in unique_state_items(model):
        yield name, gather_full(tensor, dtype=dtype, device=device)


def unique_state_items(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state dict entries (sharded where sharded), each tensor object once."""
    seen: set[int] = set()
    # keep_vars: the registered parameters themselves, so a tied weight is one object under two names
    # (a plain state_dict() detaches each entry into a new tensor).
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        yield clean_name(name), tensor.detach()


def _out_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def gather_full(
    tensor: torch.Tensor, *, dtype: torch.dtype | None, device: torch.device | str | None
) -> torch.Tensor:
    """The full tensor of one state-dict entry (a collective for a sharded one), cast to ``dtype`` if
    given (floating point only) and moved to ``device`` (None: where it was gathered)."""
    tensor = tensor.to(dtype=_out_dtype(tensor, dtype))  # cast the shard first: fewer bytes on the wire
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        mesh_device = tensor.device_mesh.device_type
        if local.device.type != mesh_device:  # CPU-offloaded shard: gather on the mesh's device
            tensor = DTensor.from_local(local.to(mesh_device), tensor.device_mesh, tensor.placements,
                                        run_check=False, shape=tensor.shape, stride=tensor.stride())
        full = tensor.full_tensor()
    else:
        full = tensor
    return full if device is None else full.to(device)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
