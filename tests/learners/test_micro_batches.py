"""Micro-batching with gradient accumulation, and packing, give the single-pass update exactly (float64).

The learner computes the advantages and normalisers on the whole batch and each micro-batch's loss
with them, so the accumulated gradient must equal the one-pass gradient up to summation order; in
float64 that is about 1e-15 relative, far below the 1e-10 asserted here (docs/design.md §1 step 6).
"""

from __future__ import annotations

import pytest
import torch

from flashrl.learners import Learner, TrainBatch

BUDGET = 20  # tokens per micro-batch: the 6 episodes (8 to 14 tokens) need 4 or more passes
TIME_KEYS = {"update_time_s", "logprob_time_s"}
OPTIONS = {
    "sample_mean": {},
    "token_mean": {"aggregation": "token_mean"},
    "constant_length": {"aggregation": "constant_length", "constant_length_normalizer": 16},
    "entropy_filter": {"negative_token_fraction": 0.5, "baseline": "leave_one_out"},
}


def _update(make_spec, batch: TrainBatch, **options) -> tuple[dict[str, float], list[torch.Tensor], Learner]:
    """One SGD update; returns its metrics, the gradient the optimizer stepped on, and the learner."""
    learner = Learner(make_spec(dtype="float64", optimizer="sgd", lr=1e-3, delta=0.012, **options))
    grads: list[torch.Tensor] = []

    def capture(optimizer, args, kwargs) -> None:
        grads.extend(p.grad.detach().clone() for group in optimizer.param_groups for p in group["params"])

    learner.optimizer.register_step_pre_hook(capture)
    metrics = learner.update(batch)
    assert metrics["applied"] == 1.0
    return metrics, grads, learner


def _assert_same_update(actual, expected, *, rel: float = 1e-10) -> None:
    (m_a, g_a, _), (m_e, g_e, _) = actual, expected
    assert len(g_a) == len(g_e) > 0
    for a, e in zip(g_a, g_e):
        scale = float(e.abs().max())
        assert scale > 0
        assert float((a - e).abs().max()) <= rel * scale
    keys = set(m_e) - TIME_KEYS - {"num_micro_batches"}
    assert keys == set(m_a) - TIME_KEYS - {"num_micro_batches"}
    for key in sorted(keys):  # drift_values: a list per trajectory, in the batch's order
        assert m_a[key] == pytest.approx(m_e[key], rel=rel, abs=1e-15), key


@pytest.mark.parametrize("name", list(OPTIONS))
def test_micro_batched_and_packed_updates_equal_the_single_pass(make_spec, batch, name):
    options = OPTIONS[name]
    single = _update(make_spec, batch, pack_sequences=False, **options)
    assert single[0]["num_micro_batches"] == 1.0
    assert 0 < single[0]["accepted_fraction"] < 1  # rejected and accepted trajectories both present
    if name == "entropy_filter":
        assert single[0]["tokens_kept"] < single[0]["tokens_valid"]  # the filter dropped tokens

    micro = _update(make_spec, batch, pack_sequences=False, max_tokens_per_micro_batch=BUDGET, **options)
    assert micro[0]["num_micro_batches"] >= 4
    _assert_same_update(micro, single)

    packed = _update(make_spec, batch, pack_sequences=True, max_tokens_per_micro_batch=BUDGET, **options)
    assert packed[2].pack_sequences and packed[0]["num_micro_batches"] >= 4
    _assert_same_update(packed, single)


def test_one_optimizer_step_however_many_micro_batches(make_spec, batch):
    learner = Learner(make_spec(max_tokens_per_micro_batch=BUDGET, optimizer="adamw", lr=1e-4))
    steps = []
    learner.optimizer.register_step_post_hook(lambda optimizer, args, kwargs: steps.append(1))
    metrics = learner.update(batch)
    assert metrics["num_micro_batches"] >= 4 and len(steps) == 1 and learner.version == 1


def test_a_trajectory_over_the_budget_runs_alone_and_still_trains(make_spec, batch):
    # A budget below every episode's length: each episode is its own (over-budget) micro-batch.
    metrics, grads, _ = _update(make_spec, batch, max_tokens_per_micro_batch=1)
    assert metrics["num_micro_batches"] == batch.batch_size
    _assert_same_update((metrics, grads, None), _update(make_spec, batch))


def test_the_micro_batch_budget_is_checked(make_spec):
    with pytest.raises(ValueError, match=r"Invalid LearnerSpec:\n  - max_tokens_per_micro_batch: expected None .+, got 0\. Fix:"):
        make_spec(max_tokens_per_micro_batch=0)


def test_the_learner_probes_with_its_compute_dtypes_tolerance(make_spec, monkeypatch) -> None:
    """FSDP2 keeps float32 parameters under bfloat16 compute: the tolerance comes from the spec's dtype."""
    import flashrl.models

    seen: list[float] = []
    monkeypatch.setattr(flashrl.models, "verify_packed_attention",
                        lambda model, *, atol=None: seen.append(atol) or 0.0)
    for dtype in ("float32", "bfloat16"):
        Learner(make_spec(dtype=dtype, pack_sequences=True))
    assert seen == [1e-4, 0.2]


def test_a_packing_learner_switches_to_its_pack_attention(make_spec, monkeypatch) -> None:
    """The learner runs its packed passes with the attention ``pack_attention`` resolves to (flex on CUDA)."""
    import flashrl.models

    seen: list[tuple] = []

    def choose(choice, device, loaded, *, supports_flex=False, training=True) -> str:
        seen.append((choice, device.type, loaded, supports_flex, training))
        return "eager"  # another implementation than the loaded one: the switch is visible on CPU

    monkeypatch.setattr(flashrl.models, "packed_attention_implementation", choose)
    learner = Learner(make_spec(pack_sequences=True, pack_attention="sdpa_mask"))
    assert seen == [("sdpa_mask", "cpu", "sdpa", True, True)]
    assert learner.model.config._attn_implementation == "eager"
    padded = Learner(make_spec(pack_sequences=False, pack_attention="sdpa_mask"))
    assert padded.model.config._attn_implementation == "sdpa" and len(seen) == 1  # only packing learners switch


def test_flex_packing_is_refused_on_cpu_and_unknown_choices_by_the_spec(make_spec) -> None:
    with pytest.raises(ValueError, match="FlexAttention in torch .* has no backward on CPU"):
        Learner(make_spec(pack_sequences=True, pack_attention="flex"))
    with pytest.raises(ValueError, match=r"pack_attention: expected None \(auto\) or one of flex, sdpa_mask, "
                                         r"flash_varlen, got 'varlen'\. Fix: use None"):
        make_spec(pack_attention="varlen")
