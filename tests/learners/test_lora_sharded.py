"""Sharded LoRA learners: 2 FSDP2 ranks (gloo, Ray actors) train the adapter exactly as one learner does.

Pinned here, against a single learner given the same adapter (float64):
- the sharded learners start from the single learner's adapter (the same seed gives the same init);
- one AdamW update moves the adapter to the single learner's values, and the frozen base not at all;
- the state, the push and the checkpoint hold the adapter only (the checkpoint one file, ``single_file``);
- a checkpoint of two sharded learners resumes on one learner and on two, with the same next update;
- the exported policy is a PEFT adapter that peft loads with the single learner's log-probs;
- a bfloat16 run keeps its frozen base in bfloat16 and the adapter (and its optimizer) in float32, with
  activation checkpointing and offloaded shards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from flashrl.checkpoints import read_checkpoint, write_checkpoint
from flashrl.learners import Learner, LearnerGroup
from flashrl.models import compute_token_logprobs
from flashrl.models.lora import is_adapter_name
from flashrl.weight_sync.lora import PutAdapter

from .test_lora import _lora, _nonzero_b

pytestmark = pytest.mark.ray

OPTIONS = {"optimizer": "adamw", "lr": 1e-2, "delta": 0.012}


def _group(spec) -> LearnerGroup:
    return LearnerGroup(spec, num_learners=2, num_cpus_per_learner=0.5, timeout_s=300.0)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        torch.testing.assert_close(tensor, b[name], rtol=0, atol=atol, msg=name)


def test_two_sharded_lora_learners_take_the_single_learners_step_and_checkpoint_the_adapter(
    ray_cluster, make_spec, tiny_llama_path, batch, next_batch, tmp_path
):
    spec = _lora(make_spec, dtype="float64", **OPTIONS)
    fresh = Learner(spec).get_state()["model"]
    single = Learner(spec)
    _nonzero_b(single)  # at peft's init (B = 0) lora_A has no gradient
    start = single.get_state()
    group = _group(spec)
    try:
        state = group.get_state()
        assert set(state["model"]) == set(fresh) and all(is_adapter_name(n) for n in fresh)
        _assert_same(state["model"], fresh, atol=0)  # the same seed, the same initial adapter
        base_before = {n: t for n, t in group.get_weights().items() if not is_adapter_name(n)}

        group.set_state(start)
        metrics, expected = group.update(batch), single.update(batch)
        assert metrics["applied"] == expected["applied"] == 1.0
        assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-10, abs=1e-12)
        assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-9)
        after = group.get_state()
        _assert_same(after["model"], single.get_state()["model"], atol=1e-10)
        moved = [n for n in after["model"] if not torch.equal(after["model"][n], start["model"][n])]
        assert len(moved) == len(after["model"])  # every adapter tensor took the step
        assert set(after["optimizer"]["state"]) == set(after["model"])  # AdamW moments of the adapter only
        weights = group.get_weights()
        for name, tensor in base_before.items():
            assert torch.equal(weights[name], tensor), name  # the frozen base never moves

        # The push: the adapter's tensors only, as the single learner sends them.
        pushed = group.sync_weights(PutAdapter(bucket_bytes=2**16))
        sent = {n: t for ref in pushed.buckets for n, t in ray_cluster.get(ref).items()}
        _assert_same(sent, after["model"], atol=0)

        # The checkpoint: one state file of the adapter (no DCP shards, no base weight) and a PEFT folder.
        path = write_checkpoint(tmp_path / "ckpt", config={}, learner_group=group, algorithm_state={"iteration": 1})
        checkpoint = read_checkpoint(path)
        assert checkpoint.manifest["learner_layout"] == "single_file"
        saved = torch.load(f"{checkpoint.learner_path}/learner_state.pt", weights_only=True)
        assert set(saved["model"]) == set(after["model"])
        policy = Path(checkpoint.path) / "policy"
        assert {"policy/adapter_config.json", "policy/adapter_model.safetensors"} <= set(checkpoint.manifest["files"])
        assert not (policy / "config.json").exists() and not (policy / "model.safetensors").exists()
        # The merged export (rank 0 loads the base once): a plain Hugging Face folder, no adapter files.
        merged = Path(group.save_policy(tmp_path / "merged", merged=True))
        assert (merged / "config.json").exists() and not (merged / "adapter_config.json").exists()
        next_expected = group.update(next_batch)
        group.load_state(checkpoint.learner_path, layout=checkpoint.learner_layout)  # 2 -> 2
        assert group.version == 1
        again = group.update(next_batch)
        assert again["loss"] == next_expected["loss"] and again["grad_norm"] == next_expected["grad_norm"]
        # A full-training run's DCP shards are refused before anything loads (the group stops: last).
        with pytest.raises(ValueError, match="expected a LoRA adapter's state .* got DCP shards"):
            group.load_state(tmp_path / "full_training_state", layout="dcp")
    finally:
        group.shutdown()

    one = Learner(spec)  # 2 -> 1
    one.load_state(checkpoint.learner_path, layout=checkpoint.learner_layout)
    assert one.version == 1
    resumed = one.update(next_batch)
    assert resumed["loss"] == pytest.approx(next_expected["loss"], rel=1e-10, abs=1e-12)

    # The exported adapter: peft loads it over the base with the single learner's log-probs.
    from peft import PeftModel

    exported = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float64)
    loaded = PeftModel.from_pretrained(exported, str(policy)).eval()
    with torch.no_grad():
        theirs, _ = compute_token_logprobs(loaded.get_base_model(), batch.token_ids, batch.attention_mask)
        mine, _ = compute_token_logprobs(single.model, batch.token_ids, batch.attention_mask)
    mask = batch.attention_mask
    torch.testing.assert_close(theirs[mask], mine[mask], rtol=0, atol=1e-9)
    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float64).eval()  # the merged export
    with torch.no_grad():
        merged_logprobs, _ = compute_token_logprobs(plain, batch.token_ids, batch.attention_mask)
    torch.testing.assert_close(merged_logprobs[mask], mine[mask], rtol=0, atol=1e-9)


def _dtypes(actor) -> dict[str, list[str]]:
    """In a learner actor: the dtypes of its sharded parameters, of the base and of the adapter."""
    learner = actor._learner
    out: dict[str, set[str]] = {"base": set(), "adapter": set(), "moments": set()}
    for name, p in learner.model.named_parameters():
        out["adapter" if is_adapter_name(name) else "base"].add(str(p.dtype))
    for entry in learner.optimizer.state.values():
        out["moments"].update(str(v.dtype) for k, v in entry.items() if k != "step")
    return {k: sorted(v) for k, v in out.items()}


def test_a_bfloat16_sharded_lora_learner_keeps_its_base_in_bfloat16_and_its_adapter_in_float32(
    ray_cluster, make_spec, batch
):
    # with activation checkpointing (wrapped layers rename the parameters) and the shards offloaded to the host
    spec = _lora(make_spec, dtype="bfloat16", gradient_checkpointing=True, optimizer_offload=True, **OPTIONS)
    group = _group(spec)
    try:
        group.set_state({**group.get_state(), "model": _b_nonzero(group.get_state()["model"])})
        metrics = group.update(batch)
        assert metrics["applied"] == 1.0 and torch.isfinite(torch.tensor(metrics["loss"]))
        dtypes = ray_cluster.get(group._actors[1].__ray_call__.remote(_dtypes))
        assert dtypes == {"adapter": ["torch.float32"], "base": ["torch.bfloat16"], "moments": ["torch.float32"]}
    finally:
        group.shutdown()


def _b_nonzero(adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {n: 0.05 * torch.randn(t.shape, generator=gen, dtype=t.dtype) if ".lora_B." in n else t
            for n, t in adapter.items()}
