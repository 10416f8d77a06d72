"""Weights as a stream of bounded buckets: cutting a manifest, viewing weights as a stream, checking it.

A full ``state_dict()`` copy per hop does not scale (a 30B model is 61 GB in bfloat16, per copy).
Instead the learner declares the tensors it will send (``TensorMeta``: name, dtype, shape), cuts
them into buckets of at most ``bucket_bytes`` (``cut_buckets``: the stream's manifest) and produces the buckets one at
a time; an engine loads each bucket before it asks for the next, so no process on the way holds
more than about one bucket beyond the model itself.

Bucket boundaries fall only **between layers** (tensors that share the outermost integer segment of
their name, ``model.layers.3.``, stay together; un-indexed tensors such as the embedding, the final
norm and the output head are layers of their own). vLLM fuses a layer's checkpoint tensors (q/k/v
into one projection, gate/up into another) and processes the fused layer only once all of its parts
have arrived; a boundary inside a layer would keep the earlier part of it alive until the next
bucket. A single layer larger than ``bucket_bytes`` forms a bucket of its own, so the bound is
``max(bucket_bytes, largest layer)``.

The types (``TensorMeta``, ``WeightManifest``, ``WeightBuckets``) and ``DEFAULT_BUCKET_BYTES`` are
``flashrl.weight_sync.wire``'s.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Mapping, Sequence
from typing import Any

import torch

from flashrl.weight_sync.wire import TensorMeta, WeightBuckets, WeightManifest

__all__ = [
    "BucketItem",
    "Weights",
    "aiter_buckets",
    "as_buckets",
    "check_bucket",
    "cut_buckets",
    "layer_key",
    "metas_of",
]

BucketItem = Mapping[str, torch.Tensor] | Awaitable[Mapping[str, torch.Tensor]]
"""One bucket, or something that resolves to one when awaited (a Ray ``ObjectRef``)."""

Weights = Mapping[str, torch.Tensor] | WeightBuckets
"""What ``Engine.update_weights`` takes: a full ``state_dict()`` or a ``WeightBuckets`` stream."""


def layer_key(name: str) -> str:
    """The layer a tensor belongs to: its name up to the outermost integer segment, else itself.

    ``model.layers.3.self_attn.q_proj.weight`` -> ``model.layers.3``; ``model.norm.weight`` ->
    ``model.norm.weight`` (vLLM's ``layerwise_groups`` keys on the same segment).
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def cut_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> WeightManifest:
    """Cut ``metas`` (in order) into buckets of at most ``bucket_bytes``, only between layers.

    Consecutive tensors of one layer (``layer_key``) are never split; a layer larger than
    ``bucket_bytes`` is a bucket of its own. Order is kept, every tensor appears exactly once.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive; got {bucket_bytes}.")
    layers: list[list[TensorMeta]] = []
    for meta in metas:
        if layers and layer_key(layers[-1][-1].name) == layer_key(meta.name):
            layers[-1].append(meta)
        else:
            layers.append([meta])
    manifest: list[tuple[TensorMeta, ...]] = []
    bucket: list[TensorMeta] = []
    size = 0
    for layer in layers:
        nbytes = sum(m.nbytes for m in layer)
        if bucket and size + nbytes > bucket_bytes:
            manifest.append(tuple(bucket))
            bucket, size = [], 0
        bucket.extend(layer)
        size += nbytes
    if bucket:
        manifest.append(tuple(bucket))
    return tuple(manifest)


def metas_of(weights: Mapping[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta.of(name, tensor) for name, tensor in weights.items()]


def as_buckets(weights: Weights, bucket_bytes: int) -> WeightBuckets:
    """A ``WeightBuckets`` view of ``weights``: a full mapping is cut into buckets of its own tensors.

    The buckets of a mapping are views (no copy): what the bucketing bounds is the memory of the
    next hop (the shared-memory file, a broadcast buffer), not of the caller who already holds it.
    """
    if isinstance(weights, WeightBuckets):
        return weights
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"weights: expected a {{name: tensor}} mapping or a WeightBuckets stream; got "
            f"{type(weights).__name__}. Fix: pass model.state_dict() or the learner's weight buckets."
        )
    manifest = cut_buckets(metas_of(weights), bucket_bytes)
    return WeightBuckets(manifest, [{m.name: weights[m.name] for m in bucket} for bucket in manifest])


async def aiter_buckets(stream: WeightBuckets) -> AsyncIterator[tuple[tuple[TensorMeta, ...], dict[str, torch.Tensor]]]:
    """``(manifest entry, bucket)`` pairs in order, each bucket resolved (awaited) only when reached.

    Raises ``ValueError`` when the stream yields more or fewer buckets than its manifest, or a bucket
    that disagrees with its manifest entry (``check_bucket``).
    """
    source = stream.buckets
    index = 0
    # Each bucket is dropped from this frame before the next is asked for (`del`): a consumer that
    # drops its own reference leaves no bucket alive while the producer makes the next one.
    if isinstance(source, AsyncIterable):
        async for item in source:
            expected, bucket = _entry(stream, index), await _resolve(item, stream, index)
            del item
            yield expected, bucket
            del bucket
            index += 1
    else:
        for item in source:
            expected, bucket = _entry(stream, index), await _resolve(item, stream, index)
            del item
            yield expected, bucket
            del bucket
            index += 1
    if index != len(stream.manifest):
        raise ValueError(
            f"the weight stream yielded {index} buckets but its manifest has {len(stream.manifest)}; "
            "the producer stopped early. Fix: produce every bucket of the manifest."
        )


def _entry(stream: WeightBuckets, index: int) -> tuple[TensorMeta, ...]:
    if index >= len(stream.manifest):
        raise ValueError(
            f"the weight stream yielded more buckets than its manifest ({len(stream.manifest)}). Fix: build "
            "the manifest from the same tensors and bucket size as the stream."
        )
    return stream.manifest[index]


async def _resolve(item: Any, stream: WeightBuckets, index: int) -> dict[str, torch.Tensor]:
    bucket = await item if inspect.isawaitable(item) else item
    check_bucket(bucket, stream.manifest[index], index)
    return dict(bucket)


def check_bucket(bucket: Any, declared: Sequence[TensorMeta], index: int) -> None:
    """Raise ``ValueError`` unless ``bucket`` holds exactly the declared names, dtypes and shapes."""
    if not isinstance(bucket, Mapping):
        raise TypeError(f"weight bucket {index}: expected a {{name: tensor}} dict; got {type(bucket).__name__}.")
    expected = {m.name: m for m in declared}
    got = {name: TensorMeta.of(name, t) for name, t in bucket.items()}
    if got != expected:
        missing = sorted(set(expected) - set(got))
        unknown = sorted(set(got) - set(expected))
        wrong = [f"{n}: declared {expected[n].dtype}{list(expected[n].shape)}, "
                 f"got {got[n].dtype}{list(got[n].shape)}"
                 for n in expected if n in got and got[n] != expected[n]]  # fmt: skip
        raise ValueError(
            f"weight bucket {index} disagrees with its manifest: missing {missing[:5]}, "
            f"unknown {unknown[:5]}, "
            f"wrong dtype/shape {wrong[:5]}. Fix: produce the buckets from the same tensors as the manifest."
        )
