"""Sharded checkpoints of 2 gloo learners (Ray actors): no gather, exact restores on 2 and on 1 learner.

The model is a tiny Llama with a small vocabulary and 8 layers, so that no single tensor dominates:
a rank that gathered the state would hold several times what one bucket of the export holds. Rank
1's peak memory (``VmHWM``, reset through ``/proc/self/clear_refs`` just before, after ``malloc_trim``)
is measured in its actor around a whole checkpoint save, and around the gathering ``get_state`` for
comparison (Linux only, as the CI machines).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flashrl.checkpoints import read_checkpoint, write_checkpoint
from flashrl.learners import LearnerGroup, TrainBatch

pytestmark = pytest.mark.ray

OPTIONS = {"optimizer": "adamw", "lr": 1e-3, "grad_clip": 0.5, "delta": 0.012,
           "max_tokens_per_micro_batch": 16, "pack_sequences": True}
TIME_KEYS = ("update_time_s", "logprob_time_s")
SLACK = 16 << 20
"""What a save may add on rank 1 beyond tensors: DCP's and gloo's buffers, a thread's malloc arena."""


@pytest.fixture(scope="module")
def layered_model(tmp_path_factory, smollm2_path: str) -> str:
    from flashrl.models import build_tiny_llama

    out = Path(tmp_path_factory.mktemp("layered")) / "model"
    return build_tiny_llama(out, seed=0, tokenizer_source=smollm2_path, vocab_size=512, num_hidden_layers=8,
                            hidden_size=256, intermediate_size=1024)


@pytest.fixture(scope="module")
def batches(layered_model: str, episode_maker) -> tuple[TrainBatch, TrainBatch]:
    return (TrainBatch.from_episodes(episode_maker(layered_model, num=6, seed=1, behavior_noise=0.02), pad_token_id=0),
            TrainBatch.from_episodes(episode_maker(layered_model, num=5, seed=2), pad_token_id=0))


def _reset_peak(actor) -> None:
    """Run in the actor: free heap pages go back to the OS (so that RSS is what is in use, and a later
    allocation shows as growth), then the peak RSS becomes the current RSS."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_and_rss(actor) -> tuple[int, int]:
    status = Path("/proc/self/status").read_text()
    return tuple(int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) * 1024 for key in ("VmHWM", "VmRSS"))


def _peak_increase(ray, actor, call) -> tuple[int, object]:
    """Bytes rank 1's process grew to above its RSS just before ``call()`` ran, and what ``call`` returned."""
    ray.get(actor.__ray_call__.remote(_reset_peak))
    _, before = ray.get(actor.__ray_call__.remote(_peak_and_rss))
    result = call()
    peak, _ = ray.get(actor.__ray_call__.remote(_peak_and_rss))
    return peak - before, result


def _same(a: dict, b: dict) -> dict:
    return {k: a[k] for k in a if k not in TIME_KEYS} == {k: b[k] for k in b if k not in TIME_KEYS}


def test_two_learners_save_shards_without_gathering_and_restore_on_two_and_one(
    ray_cluster, make_spec, layered_model, batches, tmp_path
):
    batch, next_batch = batches
    spec = replace(make_spec(**OPTIONS), model=layered_model)
    group = LearnerGroup(spec, num_learners=2, num_cpus_per_learner=0.5, timeout_s=300.0)
    try:
        group.update(batch)  # AdamW moments exist
        rank1 = group._actors[1]
        grown_save, path = _peak_increase(ray_cluster, rank1, lambda: write_checkpoint(
            tmp_path / "ckpt", config={}, learner_group=group, algorithm_state={"iteration": 1}))
        grown_gather, full = _peak_increase(ray_cluster, rank1, group.get_state)
        expected = group.update(next_batch)
        expected_weights = group.get_weights()

        # The folder: one DCP shard file per rank, no gathered state file, everything in the manifest.
        checkpoint = read_checkpoint(path)
        learner = Path(checkpoint.learner_path)
        assert sorted(p.name for p in learner.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        assert not (learner / "learner_state.pt").exists()
        assert checkpoint.manifest["learner_layout"] == "dcp" and checkpoint.manifest["num_learners"] == 2
        assert {"learner/.metadata", "learner/__1_0.distcp", "policy/model.safetensors"} <= set(
            checkpoint.manifest["files"])

        # Rank 1's memory: its shards were resident before; the save added at most two full tensors (the
        # largest one it joins the export's gather of, and DCP's host copy of one shard tensor) and some
        # runtime buffers, far less than gathering the state does (half of all of it, at least: both
        # AdamW moments, in full).
        weights = {t.data_ptr(): t for t in full["model"].values()}.values()  # tied: one tensor
        moments = [v for entry in full["optimizer"]["state"].values() for v in entry.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0]
        state_bytes = sum(t.numel() * t.element_size() for t in [*weights, *moments])
        largest = max(t.numel() * t.element_size() for t in weights)
        bound = 2 * largest + SLACK
        print(f"rank 1 grew by {grown_save} B during the save, {grown_gather} B during get_state; bound {bound} B, "
              f"state {state_bytes} B")
        assert grown_save <= bound, (grown_save, largest)
        assert grown_gather > state_bytes / 2 > bound, (grown_gather, state_bytes)  # the measure sees a gather

        # The HF export (streamed to rank 0) is the policy of the save.
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(Path(path) / "policy", dtype=torch.float32).state_dict()
        for name, tensor in full["model"].items():
            assert torch.equal(exported[name], tensor), name

        # 2 -> 2: the same next update, bit for bit (after the group moved on, load_state rewinds it).
        group.update(batch)
        group.load_state(checkpoint.learner_path)
        assert group.version == 1
        again = group.update(next_batch)
        assert _same(again, expected)
        for name, tensor in group.get_weights().items():
            assert torch.equal(tensor, expected_weights[name]), name
    finally:
        group.shutdown()

    # 2 -> 1: one learner reads every shard (DCP in full) and continues exactly as one learner given the
    # gathered state does; its loss is the two learners' (same weights; the step differs by float32
    # summation order only).
    one, reference = LearnerGroup(spec, local=True), LearnerGroup(spec, local=True)
    one.load_state(checkpoint.learner_path)
    reference.set_state(full)
    assert one.version == reference.version == 1
    metrics = one.update(next_batch)
    assert _same(metrics, reference.update(next_batch))
    assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    reference_weights = reference.get_weights()
    for name, tensor in one.get_weights().items():
        assert torch.equal(tensor, reference_weights[name]), name


def test_the_hf_export_streams_whole_layers_per_file(tmp_path, layered_model):
    """Without a process group: small buckets give several files, an index, no layer split over two."""
    import json

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from flashrl.checkpoints.export import export_hf
    from flashrl.learners import fsdp

    model = AutoModelForCausalLM.from_pretrained(layered_model, dtype=torch.float32)
    layer_bytes = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    folder = Path(export_hf(model, tmp_path / "hf", tensors=fsdp.unique_state_items(model), gather=fsdp.gather_full,
                            bucket_bytes=2 * layer_bytes))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 4 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    layer_files: dict[str, set[str]] = {}
    for name, file in index["weight_map"].items():
        if m := re.match(r"model\.layers\.(\d+)\.", name):
            layer_files.setdefault(m.group(1), set()).add(file)
        with safe_open(str(folder / file), "pt") as f:
            assert name in f.keys()  # noqa: SIM118 (safe_open has no __contains__)
    assert all(len(f) == 1 for f in layer_files.values()), layer_files
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def _disk_full_in(actor_function: str):
    """Run in a learner actor: ``actor_function`` (``module:name``) raises ENOSPC from now on; the original
    is kept so that ``_disk_back`` restores it."""

    def patch(actor) -> None:
        import errno
        import importlib

        module_name, name = actor_function.split(":")
        module = importlib.import_module(module_name)
        original = getattr(module, name)

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device", "shard")

        full.original = original
        setattr(module, name, full)

    return patch


def _disk_back(actor_function: str):
    def restore(actor) -> None:
        import importlib

        module_name, name = actor_function.split(":")
        module = importlib.import_module(module_name)
        setattr(module, name, getattr(module, name).original)

    return restore


def test_a_save_the_disk_refuses_on_one_rank_leaves_the_learners_usable_and_a_later_save_works(
    ray_cluster, make_spec, layered_model, batches, tmp_path
):
    """Before, the failing rank's error stopped the group (its actors killed), so the run that logged the
    failed save and went on to retry at the next interval stopped at the next update instead."""
    from flashrl.checkpoints.save_failure import CheckpointSaveError

    batch, next_batch = batches
    spec = replace(make_spec(**OPTIONS), model=layered_model)
    group = LearnerGroup(spec, num_learners=2, num_cpus_per_learner=0.5, timeout_s=300.0)
    shard_write = "torch.distributed.checkpoint.filesystem:_write_item"
    export_write = "safetensors.torch:save_file"
    try:
        group.update(batch)
        # rank 1's shard write fails (DCP gathers it to both ranks); then rank 0's export write fails
        for rank, function, export in ((1, shard_write, False), (0, export_write, True)):
            actor = group._actors[rank]
            ray_cluster.get(actor.__ray_call__.remote(_disk_full_in(function)))
            path = tmp_path / f"ckpt_{rank}"
            with pytest.raises(CheckpointSaveError, match=r"No space left on device.*Free space on its disk"):
                write_checkpoint(path, config={}, learner_group=group, algorithm_state={"iteration": 1},
                                 export_policy=export)
            assert group.failure is None, group.failure
            assert not path.exists() and not Path(f"{path}.tmp").exists()
            ray_cluster.get(actor.__ray_call__.remote(_disk_back(function)))
        assert group.update(next_batch)["version"] == 2  # training goes on
        path = write_checkpoint(tmp_path / "ckpt", config={}, learner_group=group, algorithm_state={"iteration": 2})
        assert read_checkpoint(path).manifest["learner_layout"] == "dcp"
    finally:
        group.shutdown()
