"""Streamed weight updates into the real vLLM CPU build (tiny random Llama, several buckets).

After an update made of several buckets, generation's recorded log-probs are those of the new
weights (recomputed with transformers); the engine's process holds one bucket at a time and the
transfer folder one bucket file; a folder too small for a bucket is a clear error before anything
moves, and the engine keeps serving the old weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import weakref
from collections import namedtuple

import pytest
import torch

from flashrl.engines import SamplingConfig, make_engine
from flashrl.engines.agreement import measure_agreement
from flashrl.learners.weight_gather import iter_weight_buckets, weight_manifest
from flashrl.weight_sync.shm import TransferSpaceError, bucket_file_bytes
from flashrl.weight_sync.wire import WeightBuckets

pytestmark = pytest.mark.vllm

BUCKET_BYTES = 2**18  # the tiny Llama is ~26 MB: embedding alone, each decoder layer (~0.5 MB), the norm


@pytest.fixture(scope="module")
def engine(tiny_llama_path: str, event_loop_runner):  # the loop must outlive the engine
    eng = make_engine("vllm", tiny_llama_path, seed=0, max_model_len=256)
    yield eng
    eng.close()


def _perturbed(path: str, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _sample(engine, prompts, run):
    async def go():
        return await asyncio.gather(
            *[engine.generate(p, SamplingConfig(max_tokens=12, seed=i)) for i, p in enumerate(prompts)]
        )

    return run(go())


def test_a_streamed_update_serves_the_new_weights_one_bucket_at_a_time(
    engine, tiny_llama_path, chat_prompts, event_loop_runner, tmp_path, monkeypatch
) -> None:
    run = event_loop_runner.run_until_complete
    model = _perturbed(tiny_llama_path, seed=0)
    prompts = chat_prompts(engine.tokenizer)
    before = _sample(engine, prompts, run)
    manifest = weight_manifest(model, bucket_bytes=BUCKET_BYTES)
    assert len(manifest) >= 4  # embedding, 2 decoder layers, norm: several buckets

    # The producer hands out fresh copies (as a fetch from the object store does) and records, each
    # time it makes a bucket, the bytes of earlier buckets still alive anywhere in this process.
    alive: list[weakref.ref] = []
    held_at_production: list[int] = []

    def produce():
        for bucket in iter_weight_buckets(model, manifest):
            held_at_production.append(sum(r().nbytes for r in alive if r() is not None))
            copy = {n: t.detach().clone() for n, t in bucket.items()}
            del bucket
            alive.extend(weakref.ref(t) for t in copy.values())
            yield copy
            del copy

    # the bucket files: one at a time in the transfer folder, none left behind
    from flashrl.engines import vllm_engine

    files_seen: list[tuple[int, int]] = []
    write = vllm_engine.write_bucket_file

    def recording_write(folder, bucket, declared):
        others = [f for f in os.listdir(folder) if f.startswith("flashrl-weights-")]
        path, total, entries = write(folder, bucket, declared)
        files_seen.append((len(others), total))
        return path, total, entries

    monkeypatch.setattr(vllm_engine, "write_bucket_file", recording_write)
    engine.options = dataclasses.replace(engine.options, weight_transfer_dir=str(tmp_path))
    run(engine.update_weights(WeightBuckets(manifest, produce()), version=3))

    assert engine.version == 3
    assert held_at_production == [0] * len(manifest), held_at_production  # never two buckets at once
    assert [others for others, _ in files_seen] == [0] * len(manifest)
    assert max(total for _, total in files_seen) == max(bucket_file_bytes(b) for b in manifest)
    # the largest file is the largest layer (the embedding), not the model
    assert max(total for _, total in files_seen) == model.get_input_embeddings().weight.numel() * 4
    assert not os.listdir(tmp_path)

    after = _sample(engine, prompts, run)
    assert [c.version for c in after] == [3] * len(prompts)
    report = measure_agreement(model, prompts, after)
    print(f"vLLM after a {len(manifest)}-bucket streamed update, vs transformers: {report}")
    assert report.mean_drift < 1e-5 and report.max_abs_diff < 1e-3
    assert measure_agreement(model, prompts, before).max_abs_diff > 1e-2  # the old samples: old policy


def test_a_transfer_folder_too_small_is_a_clear_error_before_anything_moves(
    engine, tiny_llama_path, chat_prompts, event_loop_runner, monkeypatch
) -> None:
    import shutil

    run = event_loop_runner.run_until_complete
    model = _perturbed(tiny_llama_path, seed=1)
    run(engine.update_weights(model.state_dict(), version=4))
    manifest = weight_manifest(model, bucket_bytes=BUCKET_BYTES)
    need = max(bucket_file_bytes(b) for b in manifest)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: usage(64 * 2**20, 64 * 2**20 - need + 1, need - 1))
    produced = []

    def produce():
        for bucket in iter_weight_buckets(_perturbed(tiny_llama_path, seed=2), manifest):
            produced.append(1)
            yield bucket

    with pytest.raises(TransferSpaceError, match=rf"needs {need:,} bytes .* has {need - 1:,} bytes.*--shm-size"):
        run(engine.update_weights(WeightBuckets(manifest, produce()), version=5))
    assert produced == []  # checked up front: not one bucket was fetched
    monkeypatch.undo()
    assert engine.version == 4
    prompts = chat_prompts(engine.tokenizer, 4)
    comps = _sample(engine, prompts, run)  # still serving, with the version-4 weights
    assert [c.version for c in comps] == [4] * 4
    assert measure_agreement(model, prompts, comps).max_abs_diff < 1e-3


def _stream_with_a_bad_bucket(model, bad_index: int) -> WeightBuckets:
    manifest = weight_manifest(model, bucket_bytes=BUCKET_BYTES)

    def produce():
        for k, bucket in enumerate(iter_weight_buckets(model, manifest)):
            if k == bad_index:  # one tensor of the wrong shape: the producer's bug
                name = next(iter(bucket))
                bucket = {**bucket, name: torch.zeros(3)}
            yield bucket

    return WeightBuckets(manifest, produce())


def test_a_stream_that_fails_before_loading_anything_leaves_the_engine_serving(
    engine, tiny_llama_path, chat_prompts, event_loop_runner
) -> None:
    run = event_loop_runner.run_until_complete
    old = _perturbed(tiny_llama_path, seed=3)
    run(engine.update_weights(old.state_dict(), version=8))
    with pytest.raises(ValueError, match="weight bucket 0 disagrees with its manifest"):
        run(engine.update_weights(_stream_with_a_bad_bucket(_perturbed(tiny_llama_path, seed=4), 0), version=9))
    prompts = chat_prompts(engine.tokenizer, 4)
    comps = _sample(engine, prompts, run)
    assert engine.version == 8 and [c.version for c in comps] == [8] * 4
    assert measure_agreement(old, prompts, comps).max_abs_diff < 1e-3  # the session put everything back


def test_a_stream_that_fails_midway_marks_the_engine_broken(engine, tiny_llama_path, chat_prompts, event_loop_runner) -> None:
    """Runs last in this module: the engine serves a mixture afterwards and refuses to go on."""
    run = event_loop_runner.run_until_complete
    with pytest.raises(ValueError, match="weight bucket 2 disagrees with its manifest"):
        run(engine.update_weights(_stream_with_a_bad_bucket(_perturbed(tiny_llama_path, seed=5), 2), version=10))
    assert engine.version == 8
    with pytest.raises(RuntimeError, match="mixture of two weight versions: a weight update to version 10"):
        run(engine.generate(chat_prompts(engine.tokenizer, 1)[0], SamplingConfig(max_tokens=4)))
