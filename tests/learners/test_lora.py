"""LoRA learner: the step follows the adapter's gradient (float64 reference), the base is frozen, only the
adapter is sent and saved, a resume with other adapter settings is refused, the export loads in peft."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from flashrl.algorithms.flash_reinforce.loss import flash_reinforce_loss
from flashrl.learners import Learner, LearnerSpec, TrainBatch
from flashrl.models import compute_token_logprobs
from flashrl.models.lora import is_adapter_name
from flashrl.validation import SpecError
from flashrl.weight_sync.lora import PutAdapter
from flashrl.weight_sync.messages import PutBuckets

RANK, ALPHA = 8, 16.0


def _lora(make_spec, **overrides) -> LearnerSpec:
    return make_spec(lora_rank=RANK, lora_alpha=ALPHA, **overrides)


def _nonzero_b(learner: Learner, seed: int = 3) -> None:
    """Give every lora_B a random value: at peft's init (B = 0) lora_A has no gradient to check."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))


def _adapter(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters() if is_adapter_name(n)}


def _reference(model_path: str, batch: TrainBatch, adapter: dict[str, torch.Tensor], **loss_kwargs):
    """Loss and adapter gradients in float64 without peft: every adapted weight is W + (alpha / r) * B @ A."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval()
    leaves = {n: t.to(torch.float64).clone().requires_grad_(True) for n, t in adapter.items()}
    params = dict(model.named_parameters())
    merged = {}
    for name, a in leaves.items():
        if ".lora_A." not in name:
            continue
        module = name.split(".lora_A.")[0]  # ...q_proj
        weight = f"{module}.weight"
        b_name = name.replace(".lora_A.", ".lora_B.")
        merged[weight] = params[weight].detach() + (ALPHA / RANK) * leaves[b_name] @ a
    assert merged, "the adapter adapts no weight"

    def logprobs_of(ids, mask):
        with torch.nn.utils.stateless._reparametrize_module(model, merged):
            return compute_token_logprobs(model, ids, mask)

    logprobs, entropy = logprobs_of(batch.token_ids, batch.attention_mask)
    out = flash_reinforce_loss(logprobs, batch.behavior_logprobs, batch.rewards, batch.loss_mask,
                               entropy=entropy, **loss_kwargs)
    out.loss.backward()
    return out, {n: t.grad for n, t in leaves.items()}


def test_lora_step_is_one_sgd_step_along_minus_the_adapter_gradient_in_float64(make_spec, tiny_llama_path, batch):
    learner = Learner(_lora(make_spec, dtype="float64", optimizer="sgd", lr=1e-2, delta=0.012))
    _nonzero_b(learner)
    before = _adapter(learner)
    base_before = {n: p.detach().clone() for n, p in learner.model.named_parameters() if not is_adapter_name(n)}
    metrics = learner.update(batch)

    ref, grads = _reference(tiny_llama_path, batch, before, delta=0.012)
    assert 0 < ref.metrics["accepted_fraction"] < 1
    after = _adapter(learner)
    assert after.keys() == grads.keys() and len(grads) == 2 * 7 * 2  # A and B of 7 linear layers x 2 layers
    # 1e-6: the batch's recorded log-probs and rewards are float32, which the learner's loss path meets in
    # float32 arithmetic; a full-weight float64 learner agrees with its float64 reference to the same ~1e-7.
    for name, grad in grads.items():
        torch.testing.assert_close((before[name] - after[name]) / 1e-2, grad, rtol=0, atol=1e-6 * float(grad.abs().max()))
    assert all(float(g.abs().max()) > 0 for g in grads.values())
    assert metrics["loss"] == pytest.approx(float(ref.loss.detach()), rel=1e-6)
    assert metrics["grad_norm"] == pytest.approx(math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values())),
                                                 rel=1e-6)
    # The base is frozen: no gradient, no optimizer state, unchanged.
    for name, p in learner.model.named_parameters():
        if not is_adapter_name(name):
            assert not p.requires_grad and torch.equal(p.detach(), base_before[name]), name
    assert set(learner.policy.names) == set(grads)


def test_lora_adamw_keeps_optimizer_state_for_the_adapter_only_and_packing_changes_nothing(make_spec, batch):
    spec = _lora(make_spec, optimizer="adamw", lr=1e-3)
    padded, packed = Learner(spec), Learner(replace(spec, pack_sequences=True, max_tokens_per_micro_batch=24))
    for one in (padded, packed):
        _nonzero_b(one)
        assert one.update(batch)["applied"] == 1.0
    _, optimizer = padded.policy.train_state()
    assert optimizer["state"] and all(is_adapter_name(n) for n in optimizer["state"])
    for (name, a), b in zip(_adapter(padded).items(), _adapter(packed).values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_only_adapter_tensors_cross_a_push(make_spec, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "put", lambda bucket: bucket)  # the buckets themselves, no cluster
    lora, full = Learner(_lora(make_spec)), Learner(make_spec())

    def sent(learner: Learner, message) -> dict[str, torch.Tensor]:
        return {n: t for bucket in learner.sync_weights(message).buckets for n, t in bucket.items()}

    adapter = sent(lora, PutAdapter(bucket_bytes=2**16))
    assert adapter.keys() == set(lora.policy.names) and all(is_adapter_name(n) for n in adapter)
    assert sent(lora, PutBuckets(bucket_bytes=2**16)).keys() == adapter.keys()  # a restore's stream too
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    full_bytes = sum(t.numel() * t.element_size() for t in sent(full, PutBuckets(bucket_bytes=2**20)).values())
    assert adapter_bytes < full_bytes / 10
    with pytest.raises(ValueError, match="expected the learner to send only its LoRA adapter"):
        full.sync_weights(PutAdapter())
    # a bfloat16 learner's adapter is float32 (peft upcasts it) and is sent so unless weight_sync_dtype says otherwise
    bf16 = Learner(_lora(make_spec, dtype="bfloat16"))
    assert {t.dtype for t in sent(bf16, PutAdapter()).values()} == {torch.float32}
    assert {p.dtype for n, p in bf16.model.named_parameters() if not is_adapter_name(n)} == {torch.bfloat16}


def test_lora_checkpoint_holds_the_adapter_resumes_exactly_and_refuses_other_settings(make_spec, batch, next_batch,
                                                                                     tmp_path):
    spec = _lora(make_spec, optimizer="adamw", lr=1e-3)
    first = Learner(spec)
    first.update(batch)
    folder = first.save_state(tmp_path / "state")
    state = first.get_state()
    assert set(state["model"]) == set(first.policy.names)  # the adapter, not the base
    expected = first.update(next_batch)
    second = Learner(spec)
    second.load_state(folder)
    assert second.version == 1
    metrics = second.update(next_batch)
    assert metrics["loss"] == expected["loss"] and metrics["grad_norm"] == expected["grad_norm"]
    for (name, a), b in zip(_adapter(first).items(), _adapter(second).values()):
        assert torch.equal(a, b), name
    for other in ({"lora_rank": 16}, {"lora_alpha": 8.0}, {"lora_target_modules": "q_proj,v_proj"}):
        learner = Learner(replace(spec, **other))
        key = next(iter(other))
        with pytest.raises(ValueError, match=rf"expected the adapter settings.*differs in \['{key}'\].*Fix:"):
            learner.load_state(folder)
    with pytest.raises(ValueError, match="differs in \\['lora_rank'\\]"):
        Learner(make_spec(optimizer="adamw", lr=1e-3)).load_state(folder)  # full training from an adapter


def test_exported_adapter_loads_in_peft_with_the_learners_log_probs(make_spec, tiny_llama_path, batch, tmp_path):
    from peft import PeftModel

    learner = Learner(_lora(make_spec, optimizer="adamw", lr=1e-2))
    _nonzero_b(learner)
    learner.update(batch)
    with torch.no_grad():
        mine, _ = compute_token_logprobs(learner.model, batch.token_ids, batch.attention_mask)
    path = learner.save_policy(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, path).eval()
    merged_path = learner.save_policy(tmp_path / "merged", merged=True)
    merged = AutoModelForCausalLM.from_pretrained(merged_path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs, _ = compute_token_logprobs(loaded.get_base_model(), batch.token_ids, batch.attention_mask)
        merged_lp, _ = compute_token_logprobs(merged, batch.token_ids, batch.attention_mask)
        base_lp, _ = compute_token_logprobs(
            AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval(), batch.token_ids,
            batch.attention_mask)
    mask = batch.attention_mask
    assert torch.equal(mine[mask], theirs[mask])
    torch.testing.assert_close(merged_lp[mask], mine[mask], rtol=0, atol=1e-4)
    assert float((base_lp[mask] - mine[mask]).abs().max()) > 1e-3  # the adapter moved the policy


def test_torch_engine_serves_the_pushed_adapter_with_the_learners_log_probs(make_spec, tiny_llama_path, batch,
                                                                           monkeypatch):
    import ray

    from flashrl.engines.torch_engine import TorchEngine, TorchEngineOptions
    from flashrl.engines.types import SamplingConfig

    monkeypatch.setattr(ray, "put", lambda bucket: bucket)
    spec = _lora(make_spec, optimizer="adamw", lr=1e-2)
    learner = Learner(spec)
    _nonzero_b(learner)
    learner.update(batch)
    engine = TorchEngine(tiny_llama_path, seed=0, options=TorchEngineOptions(lora=spec.lora.to_dict()))
    assert engine.weight_sync == "lora"
    adapter = learner.sync_weights(PutAdapter(bucket_bytes=2**14))
    assert len(adapter.manifest) > 1  # several buckets
    asyncio.run(engine.update_weights(adapter, learner.version))
    prompt = batch.token_ids[0, :4].tolist()
    completion = asyncio.run(engine.generate(prompt, SamplingConfig(max_tokens=6, temperature=1.0, seed=5)))
    assert completion.version == learner.version == 1
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logprobs, _ = compute_token_logprobs(learner.model, ids, torch.ones_like(ids, dtype=torch.bool))
    torch.testing.assert_close(torch.tensor(completion.logprobs), logprobs[0, 4:], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="full state_dict"):  # a full model is not an adapter
        asyncio.run(engine.update_weights(learner.get_weights(), 2))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lora_rank": 0}, "lora_rank: expected None \\(full training\\) or an integer >= 1, got 0"),
        ({"lora_rank": 2.5}, "lora_rank: expected None \\(full training\\) or an integer >= 1, got 2.5"),
        ({"lora_rank": 8, "lora_alpha": 0}, "lora_alpha: expected a finite number > 0, got 0"),
        ({"lora_rank": 8, "lora_dropout": 1.0}, "lora_dropout: expected a number in \\[0, 1\\), got 1.0"),
        ({"lora_rank": 8, "lora_target_modules": "qkv"},
         ("'qkv' matches no layer. Fix: name some of the model's linear layers \\(down_proj, gate_proj, k_proj, "
          "lm_head, o_proj, q_proj, up_proj, v_proj\\)")),
    ],
)
def test_bad_lora_settings_fail_with_expected_actual_and_fix(make_spec, settings, message):
    with pytest.raises(SpecError, match=message):
        make_spec(**settings)


def test_lora_on_fused_moe_experts_is_refused(tmp_path):
    from flashrl.models.lora import lora_target_problem
    from flashrl.models.tiny import build_tiny_qwen3_moe

    path = build_tiny_qwen3_moe(tmp_path / "moe")
    problem = lora_target_problem(path, "experts")
    assert problem is not None and "MoE expert weights" in problem and "Fix:" in problem
    assert lora_target_problem(path, "q_proj,v_proj") is None
