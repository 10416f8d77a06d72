"""Fully sharded data parallelism (torch FSDP2) for the policy, with sharded checkpoints (torch DCP).

Today every learner holds a full float32 copy of the policy and its AdamW state, and sums gradients
by hand (``flashrl.learners.distributed``). This module is the building block that shards them
instead, with torch's own engines and nothing home-made where those serve:

- ``load_pretrained_sharded``: build a Hugging Face model on the meta device, shard it, and fill the
  shards from rank 0's copy of the weights, so only rank 0 ever holds the whole model.
- ``shard_model``: ``fully_shard`` on every decoder layer and on the root (parameters, gradients and
  optimizer state live as dim-0 shards, ``DTensor`` s); optional bf16 compute with float32 reduction
  (``MixedPrecisionPolicy``), activation checkpointing per decoder layer, CPU offload
  (``CPUOffloadPolicy``). Gradients are reduce-scattered as a SUM, not FSDP's default mean: the
  learner's loss is already normalised by the GLOBAL batch (``-(1/B) sum_{i in shard} ...``, see
  ``docs/design.md`` section 1), so the summed shard gradients are exactly the global gradient, as with
  today's all-reduce.
- The optimizer is a plain ``torch.optim.AdamW`` over the sharded parameters (it steps ``DTensor`` s
  shard by shard), built by the learner (``flashrl/learners/spec.py``: one group).
- ``clip_grad_norm``: the global gradient norm across shards (``torch.nn.utils`` on ``DTensor``
  gradients reduces the per-shard norms), optional clipping.
- ``save_sharded`` / ``load_sharded``: a DCP checkpoint folder; every rank writes its own shards, and
  a load may use another world size (DCP reshards).
- ``load_sharded_full``: the whole DCP checkpoint as full tensors in one process, no process group
  (a single learner resuming from sharded ones).
- ``export_hf``: the full weights streamed to rank 0 bucket by bucket, written as a Hugging Face
  safetensors folder (transformers and vLLM load it; tied embeddings are stored once).
- ``iter_full_tensors``: the full tensors one at a time, for streaming weights into inference engines
  without materialising the whole model.

Every function that gathers or saves is a collective: call it on every rank, in the same order.
"""

from __future__ import annotations

import copy
import importlib
import io
import json
import os
import pickle
import re
import shutil
import tempfile
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
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

from flashrl.checkpoint_files import CheckpointError, load_error_reason, open_regular
from flashrl.learners.distributed import check_collective_device

__all__ = [
    "call_through_root",
    "clean_name",
    "clip_grad_norm",
    "decoder_layers",
    "export_hf",
    "iter_full_tensors",
    "load_pretrained_sharded",
    "load_sharded",
    "load_sharded_full",
    "save_sharded",
    "shard_model",
]

EXPORT_BUCKET_BYTES = 1 << 30
"""``export_hf``: the bytes rank 0 gathers before writing them (one safetensors file per bucket)."""
DCP_METADATA_FILE = ".metadata"
"""DCP writes this file last (rank 0, after every shard): a folder without it is an interrupted save."""
_EXTRA_KEY = "extra_state"
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
    **shard_options: Any,
) -> nn.Module:
    """A Hugging Face causal LM from ``path``, sharded, without every rank loading the whole model.

    Every rank builds the model on the meta device (no memory) and shards it; the shards are then
    allocated on ``device`` and filled from rank 0, which alone loads the checkpoint (host memory),
    through DCP's ``set_model_state_dict(..., broadcast_from_rank0=True)``. Buffers that are not in the
    checkpoint (rotary ``inv_freq``) are broadcast from rank 0's loaded copy as well. ``dtype`` is the
    master dtype (what the optimizer steps); ``shard_options`` go to ``shard_model``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(device)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
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
# Sharded checkpoints (DCP)
def save_sharded(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra_state: dict[str, Any] | None = None,
) -> str:
    """Write a DCP checkpoint folder: every rank writes its shards of the model and optimizer state.

    ``extra_state`` (version, counters, RNG, data cursors: anything picklable) is stored once, from
    rank 0, as in a replicated learner. The folder must be on storage every rank can reach (one
    node's disk, or a shared filesystem across nodes). Returns the absolute path.
    """
    path = os.path.abspath(os.fspath(path))
    state: dict[str, Any] = {}
    if optimizer is None:
        state["model"] = get_model_state_dict(model)
    else:
        state["model"], state["optimizer"] = get_state_dict(model, optimizer)
    # One opaque leaf (a pickled blob), not a nested dict: DCP loads only the keys the target already
    # has, and the caller of load_sharded does not know them in advance.
    blob = io.BytesIO()
    torch.save(extra_state or {}, blob)
    blob.seek(0)
    state[_EXTRA_KEY] = blob
    dcp.save(state, checkpoint_id=path)
    return path


def load_sharded(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load what ``save_sharded`` wrote into a sharded ``model`` (and ``optimizer``), in place.

    The model must be sharded (and the optimizer built) the same way as before saving, on any number of
    ranks. Returns the ``extra_state`` that was saved.
    """
    path = _complete_folder(path)
    state: dict[str, Any] = {}
    if optimizer is None:
        state["model"] = get_model_state_dict(model)
    else:
        state["model"], state["optimizer"] = get_state_dict(model, optimizer)
    state[_EXTRA_KEY] = io.BytesIO()
    _load_or_refuse(path, state, _SafeReader(path), _SafeLoadPlanner())
    set_state_dict(model, optimizer if optimizer is not None else (),
                   model_state_dict=state["model"], optim_state_dict=state.get("optimizer", {}))
    return state[_EXTRA_KEY]


def load_sharded_full(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Everything ``save_sharded`` wrote, as full CPU tensors in this process (no process group needed).

    ``{"model": {name: tensor}, "optimizer": {"state": {name: {...}}, "param_groups": [...]},
    "extra_state": {...}}`` (no ``optimizer`` when none was saved), names as ``get_state_dict`` spells
    them (Hugging Face names). What one learner loads from the shards of several: DCP reads every
    shard of every tensor (``_EmptyStateDictLoadPlanner``, as ``format_utils.dcp_to_torch_save``),
    through the same allow-listed readers as ``load_sharded``.
    """
    path = _complete_folder(path)
    state: dict[str, Any] = {}
    # dcp.load copies back only the keys the target already has; torch's own converter
    # (format_utils.dcp_to_torch_save) calls the loader underneath for the same reason.
    _load_or_refuse(path, state, _SafeReader(path), _SafeFullLoadPlanner(), load=_load_state_dict, no_dist=True)
    return state


def _complete_folder(path: str | os.PathLike[str]) -> str:
    """The absolute path of a DCP folder whose ``.metadata`` (written last) exists."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(os.path.join(path, DCP_METADATA_FILE)):
        raise FileNotFoundError(
            f"{path} is not a complete sharded checkpoint: {DCP_METADATA_FILE} is missing (expected a folder "
            "written by save_sharded; an interrupted save has shard files but no metadata)."
        )
    return path


def _load_or_refuse(path: str, state: dict[str, Any], reader: _SafeReader, planner: Any, *,
                    load: Callable[..., Any] = dcp.load, **kwargs: Any) -> None:
    try:
        load(state, storage_reader=reader, planner=planner, **kwargs)
    except (Exception, CheckpointException) as error:  # CheckpointException derives from BaseException
        # DCP gathers a rank's failure into its own exception (AssertionError, CheckpointException);
        # the refusal itself is kept by whichever of the two raised it.
        if reader.refused is not None:  # names the metadata file
            raise reader.refused from error
        if planner.refused is not None:
            raise CheckpointError(f"{path}: {planner.refused}") from error
        raise


# DCP's own loader unpickles two things a copied checkpoint controls: the ``.metadata`` file (plain
# ``pickle.load`` in ``FileSystemReader.read_metadata``) and every bytes entry (a full, not weights-only,
# ``torch.load`` in ``DefaultLoadPlanner.load_bytes``; torch 2.13). Either runs any code the file asks
# for. The two classes below read the same data with allow-lists instead.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": None,  # None: every class of the module (plain dataclasses)
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file, refusing every global outside ``_METADATA_GLOBALS``."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _METADATA_GLOBALS.get(module, set())
        if allowed is None:  # a class defined in DCP's metadata module, not one it imports
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and found.__module__ == module:
                return found
        elif name in allowed:
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"global {module}.{name} is not allowed in DCP metadata (expected only DCP's metadata classes, "
            "torch.Size and dtypes)"
        )


class _SafeReader(dcp.FileSystemReader):
    refused: CheckpointError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        file = self._get_metadata_path(kwargs.get("rank"))
        try:
            # A regular file inside the folder, opened without blocking (never a FIFO or a device).
            fd = open_regular(file, root=self.path, what="DCP metadata")
            with os.fdopen(fd, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
        except FileNotFoundError:
            raise  # DCP probes for per-rank metadata files that a plain save does not write
        except CheckpointError as error:
            self.refused = error
            raise
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError) as error:
            self.refused = CheckpointError(
                f"{file} is not readable DCP metadata ({type(error).__name__}: {error}). The checkpoint is "
                "truncated, corrupt or was altered; nothing in it was run. Restore it from an intact copy."
            )
            raise self.refused from error
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self._check_storage(file, metadata)
        return metadata

    def _check_storage(self, file: Any, metadata: Any) -> None:
        """Every shard file the metadata names is a plain name in this folder, and a regular file.

        DCP reads ``folder / relative_path`` as written in the metadata: ``../other/__0_0.distcp`` or an
        absolute path would load another checkpoint's shards (or any file) unverified.
        """
        storage = getattr(metadata, "storage_data", None) or {}
        names = {getattr(info, "relative_path", None) for info in storage.values()}
        for name in sorted(names, key=repr):
            if not _plain_name(name):
                self.refused = CheckpointError(
                    f"{file}: a shard's storage path is {name!r}; expected a file name inside {self.path} (as "
                    "save_sharded writes, e.g. '__0_0.distcp'). The metadata points outside its folder, so the "
                    "checkpoint was altered; nothing was loaded. Restore it from an intact copy."
                )
                raise self.refused
            try:
                os.close(open_regular(os.path.join(self.path, name), root=self.path, what="a DCP shard"))
            except FileNotFoundError:
                continue  # DCP names the missing shard itself
            except CheckpointError as error:
                self.refused = error
                raise


def _plain_name(name: Any) -> bool:
    """A file name with no folder part (no separator, not ``.`` or ``..``, not absolute)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


class _SafeLoadPlanner(DefaultLoadPlanner):
    refused: CheckpointError | None = None

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            # DCP stored the BytesIO object itself (torch.save of it), so the outer load must allow
            # that one class; the blob inside is what save_sharded wrote, loaded weights-only too.
            with torch.serialization.safe_globals([io.BytesIO]):
                loaded = torch.load(value, map_location="cpu", weights_only=True)
            if isinstance(loaded, io.BytesIO):
                loaded.seek(0)
                loaded = torch.load(loaded, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
            self.refused = CheckpointError(
                f"the entry {read_item.dest_index.fqn!r} of the DCP checkpoint is not plain data (expected "
                f"tensors and Python values; {load_error_reason(error)}); nothing in it was run. Restore the "
                "checkpoint from an intact copy."
            )
            raise self.refused from error
        if self.flatten_state_dict:  # the same placement as DefaultLoadPlanner.load_bytes
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class _SafeFullLoadPlanner(_SafeLoadPlanner, _EmptyStateDictLoadPlanner):
    """Rebuilds the whole state dict from the metadata (full tensors), bytes entries loaded safely."""


# --------------------------------------------------------------------------------------------------
# Full weights: the Hugging Face export and the bucketed gather for weight sync
def export_hf(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    tokenizer_source: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = EXPORT_BUCKET_BYTES,
) -> str:
    """Write the policy as a Hugging Face folder on rank 0, streamed: one bucket at a time; returns the path.

    The full tensors are gathered one by one (``iter_full_tensors``: a collective, every rank takes
    part and keeps only its shard) and packed into buckets of about ``bucket_bytes``; a decoder layer
    is never split over two buckets (transformers' weight conversions, e.g. fused MoE experts, work
    within a layer). Rank 0 writes each bucket as one safetensors file (``model-0000k-of-0000n``, with
    ``model.safetensors.index.json``; a single ``model.safetensors`` when one bucket holds everything),
    reverting transformers' load-time weight conversions per bucket as ``save_pretrained`` does, and
    drops it before the next: rank 0 holds one bucket beyond its shards, never the whole model. Tied
    weights are stored once (under the embedding's name). The config (the architecture without
    FSDP's class prefix, ``dtype``), the generation config and, from ``tokenizer_source``, the
    tokenizer complete the folder, which is written beside the target and renamed into place.
    ``dtype`` casts floating-point weights (e.g. ``torch.bfloat16`` for serving). Every rank calls this.
    """
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"export_hf needs a transformers PreTrainedModel; got {type(model).__name__}.")
    target = Path(path).resolve()
    plan = _export_plan(model, dtype=dtype, bucket_bytes=bucket_bytes)
    buckets = _GatheredBuckets(model, plan, dtype=dtype)
    if _rank() == 0:
        replace_folder(target, lambda tmp: _write_hf_folder(model, buckets, len(plan), tmp,
                                                            tokenizer_source=tokenizer_source, dtype=dtype))
    for _ in buckets:  # the other ranks join the same gathers (rank 0 consumed them while writing)
        pass
    if dist.is_initialized():
        dist.barrier()
    return str(target)


_LAYER_PREFIX = re.compile(r"^(.*?\.layers\.\d+)\.")


def _export_plan(model: nn.Module, *, dtype: torch.dtype | None, bucket_bytes: int) -> list[list[str]]:
    """The export's buckets (state-dict names, in order): whole layers, about ``bucket_bytes`` each."""
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    groups: list[tuple[str, list[str], int]] = []  # (layer key or name, names, bytes)
    for name, tensor in _unique_state_items(model):
        if name in ignored:
            continue
        key = m.group(1) if (m := _LAYER_PREFIX.match(name)) else name
        size = tensor.numel() * _out_dtype(tensor, dtype).itemsize
        if groups and groups[-1][0] == key:
            groups[-1][1].append(name)
            groups[-1] = (key, groups[-1][1], groups[-1][2] + size)
        else:
            groups.append((key, [name], size))
    buckets: list[list[str]] = []
    filled = 0
    for _, names, size in groups:
        if not buckets or filled + size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].extend(names)
        filled += size
    return buckets


class _GatheredBuckets:
    """Iterates the buckets of a plan as ``{name: full CPU tensor}`` on rank 0 ({} elsewhere), gathering
    each tensor when its bucket is reached; a second iteration resumes where the first stopped."""

    def __init__(self, model: nn.Module, plan: list[list[str]], *, dtype: torch.dtype | None) -> None:
        self._tensors = dict(_unique_state_items(model))
        self._plan = iter(plan)
        self._dtype = dtype

    def __iter__(self) -> _GatheredBuckets:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        names = next(self._plan)
        bucket = {}
        for name in names:
            full = _gather(self._tensors[name], dtype=self._dtype, device="cpu")
            if _rank() == 0:
                bucket[name] = full.contiguous()
            del full
        return bucket


def _write_hf_folder(
    model: nn.Module,
    buckets: Iterable[dict[str, torch.Tensor]],
    num_buckets: int,
    folder: Path,
    *,
    tokenizer_source: str | os.PathLike[str] | None,
    dtype: torch.dtype | None,
) -> None:
    """Rank 0: the safetensors files of ``buckets`` (one file each), the index, configs, tokenizer."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    weight_map: dict[str, str] = {}
    total = 0
    for k, bucket in enumerate(buckets):
        bucket = revert_weight_conversion(model, bucket)
        file = "model.safetensors" if num_buckets == 1 else f"model-{k + 1:05d}-of-{num_buckets:05d}.safetensors"
        save_file({n: t.contiguous() for n, t in bucket.items()}, str(folder / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in bucket.values())
        weight_map.update(dict.fromkeys(bucket, file))
        del bucket
    if num_buckets > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    master = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    config.dtype = str(dtype or master).removeprefix("torch.")
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(folder)
    if tokenizer_source is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(folder)


def replace_folder(path: str | os.PathLike[str], write: Callable[[Path], None]) -> str:
    """Write a model folder beside ``path`` with ``write(tmp)`` and rename it into place; returns it.

    Readers (inference engines in other processes) never see a half-written folder. A non-empty
    folder that is not a model folder (no ``config.json``) is never replaced.
    """
    target = Path(path).resolve()
    for folder in (target, *target.parents):
        if folder.exists() and not folder.is_dir():
            raise FileExistsError(
                f"{folder} is a file, expected a folder (or nothing) there to write the model folder {target}. "
                "Fix: pass a path whose folders are folders, or move the file away."
            )
    if target.exists() and any(target.iterdir()) and not (target / "config.json").is_file():
        raise FileExistsError(
            f"{target} exists and is not a Hugging Face model folder (no config.json); not replacing it. "
            "Pass a new or empty folder."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; inference engines in other processes read it
    try:
        write(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


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
    for name, tensor in _unique_state_items(model):
        yield name, _gather(tensor, dtype=dtype, device=device)


def _unique_state_items(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
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


def _gather(
    tensor: torch.Tensor, *, dtype: torch.dtype | None, device: torch.device | str | None
) -> torch.Tensor:
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
