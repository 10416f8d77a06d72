"""The learner's weights gathered as bounded buckets: the weight extractor its weight senders send from.

``weight_manifest`` declares every tensor (Hugging Face names, a tied parameter once under its first
name, global shapes of sharded tensors) cut into buckets of at most ``bucket_bytes`` at layer
boundaries (``flashrl.weight_sync.buckets.cut_buckets``), without gathering anything.
``iter_weight_buckets`` then materialises them one bucket at a time (for a sharded model each tensor
is all-gathered: a collective, so every rank consumes the generator to the end) and
``put_weight_buckets`` puts each bucket into the Ray object store as soon as it is complete, so the
learner holds at most one bucket beyond its model; the env runners fetch the refs one at a time.

``PolicyWeights`` is these functions over a learner's policy, as the ``WeightExtractor`` that
``flashrl.weight_sync`` sends from (every transport: the object-store buckets of ``shm``, the push
routes' vLLM weight source). This module lives with the learners, not in ``flashrl.weight_sync``:
gathering a sharded model is the learners' business (``flashrl.learners.fsdp``); weight sync only
defines what a bucket stream is and gets the extractor as an object.

Names: ``names="model"`` sends the learner's own state-dict names (what an engine holding the same
transformers model loads: the torch engine); ``names="checkpoint"`` sends the names and shapes of
the model's checkpoint files, which is what vLLM's loaders take. They differ where transformers
converts a checkpoint at load time: in transformers 5 a mixture of experts keeps each layer's
experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) where the
checkpoint has ``mlp.experts.<e>.gate_proj.weight`` [I, H] and so on. ``checkpoint_items``
applies transformers' own reverse conversion (``revert_weight_conversion``, what
``save_pretrained`` writes) tensor by tensor, so a stream still holds one bucket at a time; the
manifest is made the same way from meta tensors (no data).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from flashrl.learners.fsdp import clean_name, gather_full, iter_full_tensors, unique_state_items
from flashrl.weight_sync.buckets import cut_buckets
from flashrl.weight_sync.shm import put_buckets
from flashrl.weight_sync.wire import (
    DEFAULT_BUCKET_BYTES,
    WEIGHT_NAMES,
    TensorMeta,
    WeightBuckets,
    WeightManifest,
    WeightNames,
)

__all__ = ["PolicyWeights", "checkpoint_items", "iter_weight_buckets", "put_weight_buckets", "weight_manifest"]


def checkpoint_items(
    model: nn.Module, items: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each ``(name, tensor)`` of ``model``'s state dict as the checkpoint spells it (in order).

    A tensor transformers converted at load time (fused experts) becomes the checkpoint tensors it
    came from (transformers' ``revert_weight_conversion``, one entry at a time); every other entry
    is passed through untouched. Models without conversions (and non-transformers modules) pass
    through whole.
    """
    revert = _reverter(model)
    for name, tensor in items:
        if revert is None:
            yield name, tensor
            continue
        yield from revert(model, {name: tensor}).items()


def _reverter(model: nn.Module) -> Callable[..., dict[str, torch.Tensor]] | None:
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, revert_weight_conversion
    except ImportError:  # an older transformers: no load-time conversions
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = get_model_conversion_mapping(model, add_legacy=False)
    if not any(isinstance(c, WeightConverter) for c in conversions or ()):
        return None  # renamings only (legacy spellings): the state dict's names are the checkpoint's
    return revert_weight_conversion


def _check_names(names: str) -> None:
    if names not in WEIGHT_NAMES:
        raise ValueError(f"names: expected one of {WEIGHT_NAMES}, got {names!r}.")


Select = Callable[[str], bool] | None
"""Which state-dict names to send (None: all); a LoRA learner sends its adapter (``is_adapter_name``)."""


def _unique_entries(model: nn.Module, select: Select = None) -> Iterator[tuple[str, torch.Tensor]]:
    """State-dict entries, each tensor object once (a tied head is left out), HF names, ``select``-ed."""
    seen: set[int] = set()
    # keep_vars: the registered parameters themselves, so a tied weight is one object under two names
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if select is None or select(clean_name(name)):
            yield clean_name(name), tensor


def _selected_tensors(model: nn.Module, select: Select, dtype: torch.dtype | None,
                      device: torch.device | str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``iter_full_tensors`` of the ``select``-ed entries only (nothing else is gathered or copied)."""
    if select is None:
        yield from iter_full_tensors(model, dtype=dtype, device=device)
        return
    for name, tensor in unique_state_items(model):
        if select(name):
            yield name, gather_full(tensor.detach(), dtype=dtype, device=device)


def weight_manifest(
    model: nn.Module,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    names: WeightNames = "model",
    select: Select = None,
) -> WeightManifest:
    """The buckets ``iter_weight_buckets`` will produce (names, dtypes after the cast, full shapes)."""
    _check_names(names)
    entries: Iterable[tuple[str, torch.Tensor]] = (
        (name, torch.empty(tuple(tensor.shape), dtype=_cast(tensor, dtype), device="meta"))
        for name, tensor in _unique_entries(model, select)
    )
    if names == "checkpoint":
        entries = checkpoint_items(model, entries)
    metas = [TensorMeta.of(name, tensor) for name, tensor in entries]
    return cut_buckets(metas, bucket_bytes)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def iter_weight_buckets(
    model: nn.Module,
    manifest: WeightManifest,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = "cpu",
    names: WeightNames = "model",
    select: Select = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Bucket ``k`` of ``manifest`` as ``{name: full tensor}``, one bucket at a time.

    Sharded tensors are gathered tensor by tensor (``flashrl.learners.fsdp.iter_full_tensors``, a
    collective: every rank iterates to the end); a tensor already on ``device`` in its dtype is
    handed out as is (no copy), so an unsharded model on the CPU costs nothing extra here. The
    generator keeps no reference to a bucket it has yielded.
    """
    _check_names(names)
    tensors = _selected_tensors(model, select, dtype, device)
    if names == "checkpoint":
        tensors = checkpoint_items(model, tensors)
    for index, declared in enumerate(manifest):
        bucket: dict[str, torch.Tensor] = {}
        for meta in declared:
            name, tensor = next(tensors)
            if name != meta.name:
                raise RuntimeError(
                    f"bucket {index}: the model yielded {name!r} where the manifest has {meta.name!r}; the "
                    "manifest was made from another model (or the model changed). "
                    "Fix: weight_manifest(model) again."
                )
            bucket[name] = tensor
        yield bucket
        del bucket  # the consumer owns it now
    leftover = next(tensors, None)
    if leftover is not None:
        raise RuntimeError(
            f"the model has tensors the manifest lacks (first: {leftover[0]!r}). "
            "Fix: weight_manifest(model) again."
        )


class PolicyWeights:
    """A learner's weights as a ``flashrl.weight_sync.sender.WeightExtractor``.

    Args:
        model: the module whose weights the engines receive, asked for at each use (the policy's
            ``sync_model``: float32 masters of a bfloat16 learner syncing at float32).
        dtype: the dtype the engines receive (``LearnerSpec.sync_torch_dtype``); None keeps each tensor's.
        device: the learner's device (a push gathers each tensor there).
        select: which state-dict names are sent (None: every weight; a LoRA learner: its adapter's).
    """

    def __init__(
        self, model: Callable[[], nn.Module], *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
        select: Select = None,
    ) -> None:
        self._model = model
        self.dtype = dtype
        self.device = device
        self.select = select

    def manifest(self, bucket_bytes: int, names: WeightNames) -> WeightManifest:
        return weight_manifest(self._model(), bucket_bytes=bucket_bytes, dtype=self.dtype, names=names,
                               select=self.select)

    def buckets(
        self, manifest: WeightManifest, names: WeightNames, device: torch.device | str | None
    ) -> Iterator[dict[str, torch.Tensor]]:
        return iter_weight_buckets(self._model(), manifest, dtype=self.dtype, device=device, names=names,
                                   select=self.select)


def put_weight_buckets(
    model: nn.Module,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    is_sender: bool = True,
    put: Callable[[Any], Any] | None = None,
    names: WeightNames = "model",
) -> WeightBuckets | None:
    """``model``'s weights as a ``WeightBuckets`` of Ray object refs, one ``ray.put`` per bucket.

    ``flashrl.weight_sync.shm.put_buckets`` over ``PolicyWeights(model)``: the learner holds at most
    one bucket beyond its model. On a sharded model every rank calls this (the gathers are
    collectives); ranks with ``is_sender=False`` put nothing and get None. ``put`` defaults to
    ``ray.put``; ``names`` as in the module docstring (``checkpoint`` for vLLM engines).
    """
    weights = PolicyWeights(lambda: model, dtype=dtype)
    return put_buckets(weights, bucket_bytes=bucket_bytes, names=names, is_sender=is_sender, put=put)
