"""Weight buckets without vLLM: the manifest, the stream checks, the space check, the learner side."""

from __future__ import annotations

import asyncio
import io
import itertools
import weakref
from collections import namedtuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashrl.learners.weight_gather import iter_weight_buckets, put_weight_buckets, weight_manifest
from flashrl.weight_sync.buckets import aiter_buckets, as_buckets, cut_buckets, layer_key
from flashrl.weight_sync.shm import ALIGN, TransferSpaceError, bucket_file_bytes, check_transfer_space
from flashrl.weight_sync.wire import TensorMeta, WeightBuckets


def _meta(name: str, numel: int) -> TensorMeta:
    return TensorMeta(name, "float32", (numel,))


def test_layer_key_is_the_outermost_index() -> None:
    assert layer_key("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert layer_key("model.layers.3.mlp.experts.7.w1") == "model.layers.3"
    assert layer_key("model.norm.weight") == "model.norm.weight"


def test_cut_buckets_by_hand() -> None:
    metas = [
        _meta("model.embed_tokens.weight", 100),  # 400 bytes
        _meta("model.layers.0.q.weight", 10), _meta("model.layers.0.k.weight", 10),  # 80 bytes together
        _meta("model.layers.1.q.weight", 10), _meta("model.layers.1.k.weight", 10),
        _meta("model.norm.weight", 5),
    ]  # fmt: skip
    manifest = cut_buckets(metas, bucket_bytes=200)
    assert [[m.name for m in b] for b in manifest] == [
        ["model.embed_tokens.weight"],  # larger than a bucket: alone
        ["model.layers.0.q.weight", "model.layers.0.k.weight", "model.layers.1.q.weight", "model.layers.1.k.weight",
         "model.norm.weight"],  # 180 bytes
    ]  # fmt: skip
    # 100 bytes: a layer (80) fits, two do not; a layer is never split although 100 < 80 + 40
    manifest = cut_buckets(metas, bucket_bytes=100)
    assert [len(b) for b in manifest] == [1, 2, 3]
    with pytest.raises(ValueError, match="positive"):
        cut_buckets(metas, 0)


@given(
    layers=st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=4), min_size=1, max_size=12),
    bucket=st.integers(4, 400),
)
def test_cut_buckets_properties(layers: list[list[int]], bucket: int) -> None:
    metas = [_meta(f"model.layers.{i}.t{j}", n) for i, sizes in enumerate(layers) for j, n in enumerate(sizes)]
    manifest = cut_buckets(metas, bucket)
    assert [m for b in manifest for m in b] == metas  # order kept, each tensor once
    for b in manifest:
        keys = [layer_key(m.name) for m in b]
        nbytes = sum(m.nbytes for m in b)
        assert nbytes <= bucket or len(set(keys)) == 1  # over the bound only as one whole layer
    boundaries = [(a[-1].name, b[0].name) for a, b in itertools.pairwise(manifest)]
    assert all(layer_key(x) != layer_key(y) for x, y in boundaries)  # never inside a layer


def test_the_stream_checks_every_bucket_against_its_manifest() -> None:
    weights = {"a.0.w": torch.zeros(3), "a.1.w": torch.ones(2)}
    stream = as_buckets(weights, bucket_bytes=12)
    assert [[m.name for m in b] for b in stream.manifest] == [["a.0.w"], ["a.1.w"]]

    async def drain(s: WeightBuckets):
        return [(p, b) async for p, b in aiter_buckets(s)]

    assert [list(b) for _, b in asyncio.run(drain(stream))] == [["a.0.w"], ["a.1.w"]]

    async def resolved(value):  # an awaitable item, as a Ray ObjectRef is
        return value

    refs = WeightBuckets(stream.manifest, [resolved({"a.0.w": torch.zeros(3)}), resolved({"a.1.w": torch.ones(2)})])
    assert len(asyncio.run(drain(refs))) == 2
    with pytest.raises(ValueError, match=r"wrong dtype/shape \['a.1.w: declared float32\[2\], got float32\[5\]'\]"):
        asyncio.run(drain(WeightBuckets(stream.manifest, [{"a.0.w": torch.zeros(3)}, {"a.1.w": torch.ones(5)}])))
    with pytest.raises(ValueError, match="yielded 1 buckets but its manifest has 2"):
        asyncio.run(drain(WeightBuckets(stream.manifest, [{"a.0.w": torch.zeros(3)}])))
    with pytest.raises(TypeError, match="mapping or a WeightBuckets"):
        as_buckets([("a.0.w", torch.zeros(3))], 12)  # type: ignore[arg-type]


def test_space_check_names_the_bytes_and_the_fix(tmp_path) -> None:
    usage = namedtuple("usage", "total used free")
    check_transfer_space(str(tmp_path), 10, disk_usage=lambda _: usage(100, 50, 50))
    with pytest.raises(TransferSpaceError) as err:
        check_transfer_space(str(tmp_path), 67_108_864, disk_usage=lambda _: usage(2**26, 2**26 - 1000, 1000))
    message = str(err.value)
    assert "needs 67,108,864 bytes (64.0 MiB" in message and "has 1,000 bytes" in message
    assert "--shm-size" in message and "weight_transfer_dir" in message and "bucket" in message
    with pytest.raises(TransferSpaceError, match="does not exist"):
        check_transfer_space(str(tmp_path / "nope"), 1)
    assert bucket_file_bytes([_meta("a", 1), _meta("b", 17)]) == ALIGN + 128  # 4 -> 64, 68 -> 128


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


def test_learner_manifest_and_buckets_cover_the_model_once(tiny_model) -> None:
    manifest = weight_manifest(tiny_model, bucket_bytes=2**18)
    names = [m.name for b in manifest for m in b]
    state = tiny_model.state_dict()
    tied = tiny_model.config.tie_word_embeddings
    assert names == [n for n in state if not (tied and n == "lm_head.weight")]
    buckets = list(iter_weight_buckets(tiny_model, manifest))
    assert len(buckets) == len(manifest) >= 4
    for bucket, declared in zip(buckets, manifest):
        assert [TensorMeta.of(n, t) for n, t in bucket.items()] == list(declared)
        assert all(torch.equal(t, state[n]) for n, t in bucket.items())
    half = weight_manifest(tiny_model, bucket_bytes=2**18, dtype=torch.bfloat16)
    assert {m.dtype for b in half for m in b} == {"bfloat16"}


def test_putting_buckets_holds_one_bucket_beyond_the_model(tiny_model) -> None:
    """With a cast (the learner's bfloat16 copies), each bucket is a new allocation: at every put,
    the buckets put before it are gone from the learner's process."""
    manifest = weight_manifest(tiny_model, bucket_bytes=2**18, dtype=torch.bfloat16)
    alive: list[weakref.ref] = []
    held_before_put: list[int] = []
    stored: list[bytes] = []

    def put(bucket):  # an object store: a serialized copy elsewhere
        held_before_put.append(sum(r().nbytes for r in alive if r() is not None))
        alive.extend(weakref.ref(t) for t in bucket.values())
        buffer = io.BytesIO()
        torch.save(bucket, buffer)
        stored.append(buffer.getvalue())
        return len(stored) - 1

    stream = put_weight_buckets(tiny_model, bucket_bytes=2**18, dtype=torch.bfloat16, put=put)
    assert stream is not None and stream.manifest == manifest and stream.buckets == list(range(len(manifest)))
    assert held_before_put == [0] * len(manifest)
    assert all(r() is None for r in alive)
    # the bound: max(bucket_bytes, the largest layer); here the embedding is that layer
    sizes = [sum(m.nbytes for m in b) for b in manifest]
    embedding = tiny_model.get_input_embeddings().weight.numel() * 2
    assert max(sizes) == embedding
    assert all(n <= 2**18 or len({layer_key(m.name) for m in b}) == 1 for n, b in zip(sizes, manifest))
    assert put_weight_buckets(tiny_model, bucket_bytes=2**18, is_sender=False, put=put) is None


def test_the_torch_engine_loads_a_stream(tiny_llama_path: str, tiny_model) -> None:
    from flashrl.engines import make_engine

    gen = torch.Generator().manual_seed(0)
    state = tiny_model.state_dict()
    if tiny_model.config.tie_word_embeddings:
        del state["lm_head.weight"]  # one storage with the embedding: sent once
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    manifest = cut_buckets([TensorMeta.of(n, t) for n, t in new.items()], 2**18)

    async def produce():
        for b in manifest:
            yield {m.name: new[m.name] for m in b}

    with make_engine("torch", tiny_llama_path, seed=0) as eng:
        asyncio.run(eng.update_weights(WeightBuckets(manifest, produce()), version=2))
        assert eng.version == 2
        served = eng.model.state_dict()
        assert all(torch.equal(served[n], new[n]) for n in new)
        with pytest.raises(ValueError, match="Missing"):
            asyncio.run(eng.update_weights(WeightBuckets(manifest[:1], [{m.name: new[m.name] for m in manifest[0]}]), 3))
        assert eng.version == 2
