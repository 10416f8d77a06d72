"""The learner's side of weight sync: the policy's weights gathered as bounded buckets.

``weight_manifest`` declares every tensor (Hugging Face names, a tied parameter once under its first
name, global shapes of sharded tensors) cut into buckets of at most ``bucket_bytes`` at layer
boundaries (``flashrl.weight_sync.buckets.cut_buckets``), without gathering anything.
``iter_weight_buckets`` then materialises them one bucket at a time (for a sharded model each tensor
is all-gathered: a collective, so every rank consumes the generator to the end) and
``put_weight_buckets`` puts each bucket into the Ray object store as soon as it is complete, so the
learner holds at most one bucket beyond its model; the env runners fetch the refs one at a time.

The push routes (vLLM's NCCL / IPC weight-transfer engines) are fed from the same
``iter_weight_buckets`` (``flashrl.weight_sync.vllm_push``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from flashrl.weight_sync.buckets import (
    DEFAULT_BUCKET_BYTES,
    TensorMeta,
    WeightBuckets,
    WeightManifest,
    cut_buckets,
)

__all__ = ["iter_weight_buckets", "put_weight_buckets", "weight_manifest"]


def _unique_entries(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """State-dict entries, each tensor object once (a tied head is left out), HF names."""
    from flashrl.learners.fsdp import clean_name

    seen: set[int] = set()
    # keep_vars: the registered parameters themselves, so a tied weight is one object under two names
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        yield clean_name(name), tensor


def weight_manifest(
    model: nn.Module, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None
) -> WeightManifest:
    """The buckets ``iter_weight_buckets`` will produce (names, dtypes after the cast, full shapes)."""
    metas = []
    for name, tensor in _unique_entries(model):
        out = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        metas.append(TensorMeta(name, str(out).removeprefix("torch."), tuple(int(s) for s in tensor.shape)))
    return cut_buckets(metas, bucket_bytes)


def iter_weight_buckets(
    model: nn.Module,
    manifest: WeightManifest,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = "cpu",
) -> Iterator[dict[str, torch.Tensor]]:
    """Bucket ``k`` of ``manifest`` as ``{name: full tensor}``, one bucket at a time.

    Sharded tensors are gathered tensor by tensor (``flashrl.learners.fsdp.iter_full_tensors``, a
    collective: every rank iterates to the end); a tensor already on ``device`` in its dtype is
    handed out as is (no copy), so an unsharded model on the CPU costs nothing extra here. The
    generator keeps no reference to a bucket it has yielded.
    """
    from flashrl.learners.fsdp import iter_full_tensors

    tensors = iter_full_tensors(model, dtype=dtype, device=device)
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


def put_weight_buckets(
    model: nn.Module,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    is_sender: bool = True,
    put: Callable[[Any], Any] | None = None,
) -> WeightBuckets | None:
    """The weights as a ``WeightBuckets`` of Ray object refs, one ``ray.put`` per bucket.

    Each bucket is put as soon as it is complete and then dropped: the learner holds at most one
    bucket beyond its model. On a sharded model every rank calls this (the gathers are collectives);
    ranks with ``is_sender=False`` put nothing and get None. ``put`` defaults to ``ray.put``.
    """
    if put is None:
        import ray

        put = ray.put
    manifest = weight_manifest(model, bucket_bytes=bucket_bytes, dtype=dtype)
    refs = []
    for bucket in iter_weight_buckets(model, manifest, dtype=dtype):
        if is_sender:
            refs.append(put(bucket))
        del bucket
    return WeightBuckets(manifest, refs) if is_sender else None
