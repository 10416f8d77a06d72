"""Learner with FlashREINFORCE's loss: the update follows the loss, one step, skips, state round-trip, saved policy."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flashrl.algorithms.flash_reinforce.loss import flash_reinforce_loss
from flashrl.checkpoints import CheckpointError
from flashrl.learners import Learner, TrainBatch
from flashrl.models import compute_token_logprobs
from flashrl.weight_sync.messages import PutBuckets

TIME_KEYS = {"update_time_s", "logprob_time_s"}


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _reference(model_path: str, batch: TrainBatch, **loss_kwargs):
    """Loss and gradients computed directly with transformers + the loss function, no Learner."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    logprobs, entropy = compute_token_logprobs(model, batch.token_ids, batch.attention_mask)  # [B, T]
    if loss_kwargs.get("negative_token_fraction", 1.0) < 1.0:
        loss_kwargs["failures"] = batch.failures
    out = flash_reinforce_loss(
        logprobs, batch.behavior_logprobs, batch.rewards, batch.loss_mask, entropy=entropy, **loss_kwargs
    )
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters()}, logprobs.detach()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"aggregation": "token_mean"},
        {"negative_token_fraction": 0.5, "baseline": "leave_one_out"},
        {"aggregation": "constant_length", "constant_length_normalizer": 16, "importance_sampling": "none"},
        {"trust_region": "tv", "delta": 0.02},
    ],
    ids=["sample_mean", "token_mean", "entropy_filter_loo", "constant_length_no_is", "tv"],
)
def test_update_is_one_sgd_step_along_minus_the_loss_gradient(make_spec, tiny_llama_path, batch, options):
    options = {"delta": 0.012, **options}  # 0.012 rejects some drifting trajectories, accepts others
    learner = Learner(make_spec(optimizer="sgd", lr=1e-3, **options))
    before = _weights(learner.model)
    metrics = learner.update(batch)

    ref, grads, _ = _reference(tiny_llama_path, batch, **options)
    if options.get("importance_sampling") == "none":  # no behavior correction: nothing is rejected
        assert ref.metrics["accepted_fraction"] == 1
    else:
        assert 0 < ref.metrics["accepted_fraction"] < 1  # both accepted and rejected trajectories present
    after = _weights(learner.model)
    for name, grad in grads.items():
        torch.testing.assert_close(after[name], before[name] - 1e-3 * grad, rtol=1e-5, atol=1e-7)
    assert any(float(g.abs().max()) > 0 for g in grads.values())
    assert metrics["loss"] == pytest.approx(float(ref.loss.detach()), rel=1e-5)
    # The ratio metrics are current/behavior in both, whatever importance_sampling says.
    compared = ["accepted_fraction", "drift_mean", "drift_max", "advantage_mean", "advantage_std", "tokens_valid",
                "tokens_kept", "ratio_mean", "ratio_max", "ratio_min", "entropy_mean", "reward_mean"]
    for key in compared:
        assert metrics[key] == pytest.approx(ref.metrics[key], rel=1e-5, abs=1e-7), key
    assert metrics["grad_norm"] == pytest.approx(
        math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values())), rel=1e-5
    )
    assert (metrics["applied"], metrics["version"], learner.version) == (1.0, 1.0, 1)
    assert metrics["episodes"] == batch.batch_size and metrics["tokens_total"] == batch.num_tokens


def test_update_raises_the_surrogate_objective(make_spec, tiny_llama_path, batch):
    """After the step, accepted trajectories' log-probs moved the way their advantages say, on balance."""
    learner = Learner(make_spec(optimizer="sgd", lr=1e-3, delta=0.012))
    ref, _, logq_old = _reference(tiny_llama_path, batch, delta=0.012)
    learner.update(batch)
    with torch.no_grad():
        logq_new, _ = compute_token_logprobs(learner.model, batch.token_ids, batch.attention_mask)  # [B, T]
    mask = batch.loss_mask
    counts = mask.sum(-1).clamp(min=1)  # [B]
    ratio = torch.exp(logq_old - batch.behavior_logprobs)  # [B, T]  (fixed at the old policy)
    weights = (ref.trust_mask * ref.advantages / counts).unsqueeze(-1) * ratio * mask  # [B, T]
    objective_old = float((weights * logq_old).sum())
    objective_new = float((weights * logq_new).sum())
    assert objective_new > objective_old
    rejected = ~ref.trust_mask
    assert bool(rejected.any())


def test_exactly_one_optimizer_step_per_update(make_spec, batch, next_batch):
    learner = Learner(make_spec(optimizer="adamw", lr=1e-4, grad_clip=1.0))
    steps = []
    learner.optimizer.register_step_post_hook(lambda optimizer, args, kwargs: steps.append(1))
    learner.update(batch)
    assert len(steps) == 1
    learner.update(next_batch)
    assert len(steps) == 2 and learner.version == 2
    assert {int(s["step"]) for s in learner.optimizer.state.values()} == {2}


def _assert_unchanged(learner: Learner, before: dict[str, torch.Tensor]) -> None:
    for name, p in learner.model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0, equal_nan=True)
    # No optimizer step ever ran: AdamW creates its per-parameter state on the first step only.
    assert len(learner.optimizer.state) == 0


def test_non_finite_batches_are_skipped_counted_and_never_applied(make_spec, batch):
    learner = Learner(make_spec(optimizer="adamw", lr=1e-2))
    before = _weights(learner.model)

    rewards = batch.rewards.clone()
    rewards[2] = math.nan
    m = learner.update(replace(batch, rewards=rewards))
    assert (m["applied"], m["skipped/non_finite_rewards"], m["num_skipped_batches"]) == (0.0, 1.0, 1.0)

    logprobs = batch.behavior_logprobs.clone()
    logprobs[batch.loss_mask.nonzero()[0].tolist()] = -math.inf
    m = learner.update(replace(batch, behavior_logprobs=logprobs))
    assert m["skipped/non_finite_behavior_logprobs"] == 1.0 and m["num_skipped_batches"] == 2.0

    # A gradient that turns non-finite inside backward.
    handle = learner.model.get_output_embeddings().weight.register_hook(lambda g: g * math.inf)
    m = learner.update(batch)
    handle.remove()
    assert m["skipped/non_finite_gradients"] == 1.0 and m["num_skipped_batches"] == 3.0
    _assert_unchanged(learner, before)
    assert all(p.grad is None for p in learner.model.parameters())

    # Non-finite recomputed log-probs (a corrupted weight).
    with torch.no_grad():
        learner.model.model.norm.weight[0] = math.nan
    before = _weights(learner.model)
    m = learner.update(batch)
    assert m["skipped/non_finite_logprobs"] == 1.0 and m["num_skipped_batches"] == 4.0
    _assert_unchanged(learner, before)
    assert learner.version == 0
    assert dict(learner.skip_counts) == {
        "non_finite_rewards": 1, "non_finite_behavior_logprobs": 1, "non_finite_gradients": 1,
        "non_finite_logprobs": 1,
    }


def test_state_round_trip_reproduces_the_next_update_exactly(make_spec, batch, next_batch, tmp_path):
    spec = make_spec(optimizer="adamw", lr=1e-3, grad_clip=0.5)
    first = Learner(spec)
    first.update(batch)
    torch.save(first.get_state(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)  # plain tensors and Python values only
    expected_metrics = first.update(next_batch)
    expected = _weights(first.model)

    second = Learner(replace(spec, seed=123))
    second.set_state(state)
    assert second.version == 1
    metrics = second.update(next_batch)
    for name, p in second.model.named_parameters():
        assert torch.equal(p.detach(), expected[name]), name
    assert {k: v for k, v in metrics.items() if k not in TIME_KEYS} == {
        k: v for k, v in expected_metrics.items() if k not in TIME_KEYS
    }
    # Without the optimizer state the same update would differ: the round trip carried real information.
    third = Learner(spec)
    third.model.load_state_dict(state["model"])
    third.update(next_batch)
    assert not all(torch.equal(p.detach(), expected[n]) for n, p in third.model.named_parameters())

    with pytest.raises(ValueError, match="missing"):
        second.set_state({"model": state["model"]})


def test_save_state_folder_resumes_exactly_and_refuses_what_it_cannot_read(make_spec, batch, next_batch, tmp_path):
    spec = make_spec(optimizer="adamw", lr=1e-3, grad_clip=0.5)
    first = Learner(spec)
    first.update(batch)
    folder = first.save_state(tmp_path / "state")
    expected = first.update(next_batch)
    second = Learner(spec)
    second.load_state(folder)
    assert second.version == 1
    metrics = second.update(next_batch)
    assert {k: v for k, v in metrics.items() if k not in TIME_KEYS} == {
        k: v for k, v in expected.items() if k not in TIME_KEYS
    }
    for (name, a), b in zip(first.model.named_parameters(), second.model.parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(FileNotFoundError, match="not a learner state folder"):
        second.load_state(tmp_path)
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")  # a single learner reads DCP shards, safely
    with pytest.raises(CheckpointError, match=r"\.metadata is not readable DCP metadata"):
        second.load_state(tmp_path / "dcp")


def test_get_weights_are_cpu_copies_under_hf_names(make_spec):
    learner = Learner(make_spec())
    weights = learner.get_weights()
    state = learner.model.state_dict()
    assert list(weights) == list(state)
    for name, tensor in weights.items():
        assert tensor.device.type == "cpu" and torch.equal(tensor, state[name])
    weights["model.norm.weight"].add_(1.0)
    assert not torch.equal(weights["model.norm.weight"], learner.model.model.norm.weight)


def test_saved_policy_loads_with_transformers_and_gives_identical_logits(make_spec, batch, tmp_path):
    learner = Learner(make_spec(optimizer="sgd", lr=1e-2))
    learner.update(batch)
    path = Path(learner.save_policy(tmp_path / "policy"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in path.iterdir()
    }
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = learner.model(batch.token_ids, attention_mask=batch.attention_mask.long()).logits
        actual = loaded(batch.token_ids, attention_mask=batch.attention_mask.long()).logits
    assert torch.equal(actual, expected)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template and tokenizer.encode("2 + 3 =") == AutoTokenizer.from_pretrained(
        learner.spec.model
    ).encode("2 + 3 =")

    learner.update(batch)
    learner.save_policy(path)  # replacing a saved policy is allowed
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert torch.equal(reloaded.model.norm.weight, learner.model.model.norm.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]  # no temporary folders left behind

    other = tmp_path / "not_a_policy"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a Hugging Face model folder"):
        learner.save_policy(other)


def test_gradient_checkpointing_gives_the_same_update(make_spec, batch):
    plain = Learner(make_spec(optimizer="sgd"))
    checkpointed = Learner(make_spec(optimizer="sgd", gradient_checkpointing=True))
    assert all(
        layer.gradient_checkpointing and layer.training for layer in checkpointed.model.model.layers
    )
    assert not checkpointed.model.model.layers[0].self_attn.training  # no dropout
    plain.update(batch)
    checkpointed.update(batch)
    for (name, a), b in zip(plain.model.named_parameters(), checkpointed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


def test_bfloat16_trains_float32_master_weights(make_spec, batch, next_batch):
    learner = Learner(make_spec(dtype="bfloat16", optimizer="adamw", lr=1e-5))
    initial = [p.detach().clone() for p in learner.policy.master_params]
    assert {p.dtype for p in learner.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in learner.policy.master_params} == {torch.float32}
    metrics = learner.update(batch)
    assert metrics["applied"] == 1.0 and math.isfinite(metrics["loss"])
    # Steps of lr = 1e-5 are far below bf16's resolution (~0.4%) but accumulate in the masters.
    moved = [bool((m.detach() != i).any()) for m, i in zip(learner.policy.master_params, initial)]
    assert all(moved)
    for p, m in zip(learner.policy.params, learner.policy.master_params):
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))
    assert {t.dtype for t in learner.get_weights().values()} == {torch.bfloat16}

    state = learner.get_state()
    expected = learner.update(next_batch)
    other = Learner(make_spec(dtype="bfloat16", optimizer="adamw", lr=1e-5))
    other.set_state(state)
    assert other.update(next_batch)["loss"] == expected["loss"]
    for a, b in zip(other.policy.master_params, learner.policy.master_params):
        assert torch.equal(a, b)


def test_bfloat16_learner_syncs_its_float32_masters_when_asked(make_spec, batch, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "put", lambda bucket: bucket)  # the buckets themselves, no cluster

    def sent(learner: Learner) -> dict[str, torch.Tensor]:
        return {name: t for bucket in learner.sync_weights(PutBuckets(bucket_bytes=2**16)).buckets for name, t in bucket.items()}

    learner = Learner(make_spec(dtype="bfloat16", weight_sync_dtype="float32", optimizer="adamw", lr=1e-5))
    default = Learner(make_spec(dtype="bfloat16", optimizer="adamw", lr=1e-5))
    for one in (learner, default):
        assert one.update(batch)["applied"] == 1.0
    masters = dict(zip(learner.policy.names, learner.policy.master_params))
    weights = sent(learner)
    assert {t.dtype for t in weights.values()} == {torch.float32}
    assert masters.keys() <= weights.keys()
    for name, master in masters.items():
        assert torch.equal(weights[name], master.detach()), name
    # The step is below bf16's resolution for most entries: the masters moved where the bf16 model did not,
    # which is what the default (bf16) sync sends.
    model = dict(learner.policy.model.named_parameters())
    assert any(not torch.equal(weights[n], model[n].detach().float()) for n in masters)
    assert {t.dtype for t in sent(default).values()} == {torch.bfloat16}
    for name, tensor in sent(default).items():
        assert torch.equal(tensor, dict(default.policy.model.state_dict())[name]), name


def test_distributed_learner_needs_a_process_group(make_spec):
    with pytest.raises(RuntimeError, match="not initialised"):
        Learner(make_spec(), rank=0, world_size=2)
    with pytest.raises(FileNotFoundError, match="config.json"):
        Learner(replace(make_spec(), model="/nonexistent/model"))
