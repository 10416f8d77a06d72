"""Tests of the FlashREINFORCE reference loss against hand-computed numbers and a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashrl.algorithms.flash_reinforce.loss import flash_reinforce_loss

LOG_HALF = math.log(0.5)
LOG_QUARTER = math.log(0.25)


def bernoulli_kl_scalar(logp: float, logq: float) -> float:
    # p and q clamped to [1e-6, 1 - 1e-6], as the reference (flashreinforce/loss.py) and Molt do.
    p, q = (min(max(math.exp(x), 1e-6), 1 - 1e-6) for x in (logp, logq))
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def reference_objective(logq, logp, rewards, mask, delta, entropy=None, fraction=1.0, failures=None):
    """Returns (objective, surrogate, advantages, drifts, accepted); float64 loops.

    ``objective`` is differentiable (undetached ratio); ``surrogate`` is the value of the practical
    loss -(1/B) sum_i trust_i A_i / T_i sum_t sg(rho_it) log q_it, as a float.
    """
    b = logq.shape[0]
    mean_r = sum(float(r) for r in rewards) / b
    objective = (logq * 0).sum()  # keeps the graph when nothing is accepted
    surrogate = 0.0
    advantages, drifts, accepted = [], [], []
    for i in range(b):
        a = float(rewards[i]) - mean_r
        idx = [t for t in range(logq.shape[1]) if bool(mask[i, t])]
        n = len(idx)
        drift = sum(bernoulli_kl_scalar(float(logp[i, t]), float(logq[i, t].detach())) for t in idx) / n if n else 0.0
        ok = n > 0 and drift <= delta
        advantages.append(a)
        drifts.append(drift)
        accepted.append(ok)
        if not ok:
            continue
        kept = idx
        if fraction < 1 and bool(failures[i]):
            # the ceil(q * T_i) highest-entropy tokens, earlier position first among equals
            kept = sorted(idx, key=lambda t: (-float(entropy[i, t]), t))[: math.ceil(fraction * n)]
        term = sum(torch.exp(logq[i, t] - logp[i, t]) for t in kept) if kept else torch.zeros((), dtype=torch.float64)
        objective = objective + a / n * term
        surrogate -= a / n * sum(math.exp(float(logq[i, t].detach()) - float(logp[i, t])) * float(logq[i, t].detach()) for t in kept)
    return objective / b, surrogate / b, advantages, drifts, accepted


def _mask(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


# --------------------------------------------------------------------------------------------------
# A small example computed by hand.
#
# Three trajectories, T = 2 columns:
#   0: reward 1, two valid tokens, p = q = 0.5                    -> ratio 1, drift 0
#   1: reward 0, one valid token (column 1 is padding), p = q = 0.25 -> ratio 1, drift 0
#   2: reward 1, two valid tokens, p = 0.9, q = 0.5
#      drift = 0.9 ln(0.9/0.5) + 0.1 ln(0.1/0.5) = 0.9 * 0.5877867 + 0.1 * (-1.6094379) = 0.3680642
#      > delta = 0.1 -> rejected
# mean reward = 2/3, A = [1/3, -2/3, 1/3]
# loss = -(1/3) [ (1/3)/2 * (ln .5 + ln .5) + (-2/3)/1 * ln .25 ]
#      = -(1/3) [ (1/3) ln .5 - (4/3) ln .5 ] = (1/3) ln .5 = -0.2310491
# d loss / d log q:  row 0: -(1/3)(1/3)/2 = -1/18;  row 1 col 0: -(1/3)(-2/3) = 2/9;  row 2: 0 (rejected);
#                    padding: 0.


def _hand_batch():
    logq = torch.tensor([[LOG_HALF, LOG_HALF], [LOG_QUARTER, -3.0], [LOG_HALF, LOG_HALF]], requires_grad=True)
    logp = torch.tensor([[LOG_HALF, LOG_HALF], [LOG_QUARTER, -9.0], [math.log(0.9), math.log(0.9)]])
    rewards = torch.tensor([1.0, 0.0, 1.0])
    mask = _mask([[1, 1], [1, 0], [1, 1]])
    return logq, logp, rewards, mask


def test_hand_computed_example():
    logq, logp, rewards, mask = _hand_batch()
    out = flash_reinforce_loss(logq, logp, rewards, mask, delta=0.1)
    assert out.loss.item() == pytest.approx(math.log(0.5) / 3, abs=1e-6)
    torch.testing.assert_close(out.advantages, torch.tensor([1 / 3, -2 / 3, 1 / 3]))
    torch.testing.assert_close(out.drift, torch.tensor([0.0, 0.0, 0.3680642]))
    assert out.trust_mask.tolist() == [True, True, False]
    out.loss.backward()
    expected = torch.tensor([[-1 / 18, -1 / 18], [2 / 9, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(logq.grad, expected)
    assert out.metrics["accepted_fraction"] == pytest.approx(2 / 3)
    assert out.metrics["tokens_valid"] == 5
    assert out.metrics["tokens_kept"] == 3
    assert out.metrics["drift_max"] == pytest.approx(0.3680642, abs=1e-6)


def test_hand_computed_metrics():
    # Ratios q/p: rows 0 and 1 are 1 at their 3 valid tokens, row 2 is 0.5/0.9 = 5/9 at both of its.
    # A = [1/3, -2/3, 1/3]: mean 0, population variance (1/9 + 4/9 + 1/9) / 3 = 2/9.
    logq, logp, rewards, mask = _hand_batch()
    out = flash_reinforce_loss(logq, logp, rewards, mask, delta=0.1)
    assert all(v.dim() == 0 and v.dtype == torch.float64 and not v.requires_grad for v in out.metric_tensors.values())
    expected = {
        "accepted_fraction": 2 / 3, "num_rejected": 1.0, "drift_mean": 0.3680642 / 3, "drift_max": 0.3680642,
        "ratio_mean": (3 + 2 * 5 / 9) / 5, "ratio_max": 1.0, "ratio_min": 5 / 9, "advantage_mean": 0.0,
        "advantage_std": math.sqrt(2 / 9), "reward_mean": 2 / 3, "tokens_valid": 5.0, "tokens_kept": 3.0,
    }
    assert out.metrics == pytest.approx(expected, abs=1e-6)  # no entropy given: no entropy_mean
    entropy = torch.tensor([[0.5, 1.0], [2.0, 9.0], [0.0, 1.5]])  # column 1 of row 1 is padding
    with_entropy = flash_reinforce_loss(logq, logp, rewards, mask, delta=0.1, entropy=entropy).metrics
    assert with_entropy["entropy_mean"] == pytest.approx(5.0 / 5)


def test_metrics_of_row_shares_add_up_to_the_whole_batch():
    # With the global normalisers, the means of a part are its shares: a learner adds them up.
    logq, logp, rewards, mask = _hand_batch()
    whole = flash_reinforce_loss(logq, logp, rewards, mask, delta=0.1)
    parts = [
        flash_reinforce_loss(logq[rows], logp[rows], rewards[rows], mask[rows], delta=0.1,
                             advantages=whole.advantages[rows], num_trajectories=3, num_tokens=5).metrics
        for rows in ([0, 1], [2])
    ]
    for key in ("accepted_fraction", "num_rejected", "drift_mean", "ratio_mean", "tokens_valid", "tokens_kept"):
        assert parts[0][key] + parts[1][key] == pytest.approx(whole.metrics[key], abs=1e-12), key
    assert max(p["drift_max"] for p in parts) == whole.metrics["drift_max"]
    assert min(p["ratio_min"] for p in parts) == whole.metrics["ratio_min"]
    assert parts[1]["accepted_fraction"] == 0.0 and parts[0]["accepted_fraction"] == pytest.approx(2 / 3)


def test_a_batch_without_sampled_tokens_has_no_ratio_extremes():
    logq = torch.tensor([[-0.5, -1.0]])
    out = flash_reinforce_loss(logq, logq, torch.tensor([1.0]), _mask([[0, 0]]), delta=0.1)
    m = out.metrics
    assert (m["ratio_max"], m["ratio_min"], m["ratio_mean"], m["tokens_valid"]) == (-math.inf, math.inf, 0.0, 0.0)
    assert m["accepted_fraction"] == 0.0  # no valid token: rejected


def test_without_value_checks_the_loss_reads_nothing_back_to_the_host(monkeypatch):
    # What a learner calls per micro-batch: every value check off, the normalisers given. Every
    # conversion of a tensor to a Python value fails here, so a host sync anywhere in the loss is caught.
    logq, logp, rewards, mask = _hand_batch()
    entropy = torch.rand(3, 2)
    failures = torch.tensor([True, False, True])

    def refuse(*args, **kwargs):
        raise AssertionError("host sync inside the loss")

    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    out = flash_reinforce_loss(logq, logp, rewards, mask, delta=0.1, entropy=entropy, failures=failures,
                               negative_token_fraction=0.5, num_trajectories=3, num_tokens=5, check_values=False)
    out.loss.backward()
    monkeypatch.undo()
    # Row 0 (a failure, T = 2) keeps ceil(0.5 * 2) = 1 token, row 1 keeps its one, row 2 is rejected:
    # loss = -(1/3) [(1/3)/2 * ln .5 + (-2/3)/1 * ln .25] = (7/18) ln .5
    assert out.loss.item() == pytest.approx(7 / 18 * LOG_HALF, abs=1e-6)
    assert (out.metrics["tokens_valid"], out.metrics["tokens_kept"]) == (5.0, 2.0)


def test_without_value_checks_a_non_finite_input_gives_a_non_finite_loss_not_an_error():
    logq, logp, rewards, mask = _hand_batch()
    bad = logq.detach().clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="logprobs must be finite"):
        flash_reinforce_loss(bad, logp, rewards, mask, delta=0.1)
    out = flash_reinforce_loss(bad, logp, rewards, mask, delta=0.1, check_values=False)
    assert math.isnan(out.loss.item())
    with pytest.raises(ValueError, match="rewards must have shape"):  # shapes are checked either way
        flash_reinforce_loss(bad, logp, rewards[:2], mask, delta=0.1, check_values=False)


def test_importance_ratio_weights_the_gradient():
    # One trajectory pair; token of row 0 has p = 0.25, q = 0.5 -> rho = 2. delta large: accepted.
    # A = [0.5, -0.5]; d loss / d log q[0, 0] = -(1/2) * 0.5 / 1 * rho = -0.5.
    # Row 1: p = q = 0.5, rho = 1: -(1/2) * (-0.5) / 1 * 1 = 0.25.
    logq = torch.tensor([[LOG_HALF], [LOG_HALF]], requires_grad=True)
    logp = torch.tensor([[LOG_QUARTER], [LOG_HALF]])
    out = flash_reinforce_loss(logq, logp, torch.tensor([1.0, 0.0]), _mask([[1], [1]]), delta=10.0)
    out.loss.backward()
    torch.testing.assert_close(logq.grad, torch.tensor([[-0.5], [0.25]]))
    assert out.metrics["ratio_max"] == pytest.approx(2.0)
    # loss = -(1/2) [0.5 * 2 * ln .5 + (-0.5) * 1 * ln .5] = -(1/2)(0.5 ln .5) = 0.1732868
    assert out.loss.item() == pytest.approx(0.1732868, abs=1e-6)


# --------------------------------------------------------------------------------------------------
# Agreement with the independent float64 reference (values, gradients, masks).


def _random_batch(seed: int, b: int, t: int, drift_scale: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4 - 1e-3
    logq = (logp + drift_scale * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    start = torch.randint(0, 3, (b,), generator=g)
    cols = torch.arange(t)
    mask = (cols >= start[:, None]) & (cols < (start + lengths)[:, None])
    rewards = torch.randint(0, 2, (b,), generator=g).to(torch.float64) + 0.1 * torch.randn(b, generator=g, dtype=torch.float64)
    entropy = torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    return logq, logp, rewards, mask, entropy


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("fraction", [1.0, 0.4, 0.0])
def test_matches_float64_reference(seed, fraction):
    logq, logp, rewards, mask, entropy = _random_batch(seed, b=6, t=9)
    entropy = entropy.round(decimals=0)  # ties: broken by position
    failures = torch.arange(6) % 2 == 0  # explicit labels, unrelated to the advantages' signs
    delta = 0.05
    q1 = logq.clone().requires_grad_()
    out = flash_reinforce_loss(q1, logp, rewards, mask, delta=delta, entropy=entropy, failures=failures,
                               negative_token_fraction=fraction)
    out.loss.backward()

    q2 = logq.clone().requires_grad_()
    objective, surrogate, adv, drift, accepted = reference_objective(
        q2, logp, rewards, mask, delta, entropy, fraction, failures
    )
    (-objective).backward()

    assert out.loss.dtype == torch.float64
    assert out.loss.item() == pytest.approx(surrogate, abs=1e-6)
    torch.testing.assert_close(q1.grad, q2.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.advantages, torch.tensor(adv, dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(out.drift, torch.tensor(drift, dtype=torch.float64), rtol=0, atol=1e-6)
    assert out.trust_mask.tolist() == accepted


def test_float64_gradient_equals_finite_differences_of_objective():
    # The practical loss (detached ratio) must have the gradient of -objective (undetached ratio).
    # Check ours against central finite differences of the reference objective in float64. delta is
    # large so that no trust decision flips under the perturbation.
    logq, logp, rewards, mask, _ = _random_batch(3, b=4, t=5, drift_scale=0.05)
    q = logq.clone().requires_grad_()
    flash_reinforce_loss(q, logp, rewards, mask, delta=1.0).loss.backward()

    eps = 1e-6
    numeric = torch.zeros_like(logq)
    for i in range(logq.shape[0]):
        for t in range(logq.shape[1]):
            plus, minus = logq.clone(), logq.clone()
            plus[i, t] += eps
            minus[i, t] -= eps
            f_plus = -reference_objective(plus, logp, rewards, mask, 1.0)[0].item()
            f_minus = -reference_objective(minus, logp, rewards, mask, 1.0)[0].item()
            numeric[i, t] = (f_plus - f_minus) / (2 * eps)
    assert numeric.abs().max() > 1e-3, "the batch should carry a learning signal"
    torch.testing.assert_close(q.grad, numeric, rtol=0, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# Properties of the method.


def test_length_invariance():
    # A trajectory weighs 1/B whatever its length: the same per-token values repeated 3 or 30 times
    # give the same loss and the same total gradient on that trajectory.
    def run(length):
        t = 30
        logq = torch.full((2, t), -1.2, dtype=torch.float64)
        logq[1] = -0.7
        logp = logq.clone()
        mask = torch.zeros(2, t, dtype=torch.bool)
        mask[0, :length] = True
        mask[1, :4] = True
        q = logq.clone().requires_grad_()
        out = flash_reinforce_loss(q, logp, torch.tensor([1.0, 0.0], dtype=torch.float64), mask, delta=0.1)
        out.loss.backward()
        return out.loss.item(), q.grad[0].sum().item(), q.grad[1].sum().item()

    short, long = run(3), run(30)
    assert short == pytest.approx(long, abs=1e-12)
    # loss = -(1/2) [0.5 * (-1.2) + (-0.5) * (-0.7)] = -(1/2)(-0.6 + 0.35) = 0.125
    assert short[0] == pytest.approx(0.125, abs=1e-12)


def test_rejected_trajectories_get_exactly_zero_gradient():
    logq, logp, rewards, mask, _ = _random_batch(7, b=5, t=6, drift_scale=1.0)
    q = logq.clone().requires_grad_()
    out = flash_reinforce_loss(q, logp, rewards, mask, delta=0.2)
    out.loss.backward()
    rejected = ~out.trust_mask
    assert rejected.any() and out.trust_mask.any(), "the batch should mix accepted and rejected"
    assert torch.equal(q.grad[rejected], torch.zeros_like(q.grad[rejected]))
    # Every accepted trajectory with a token and a non-zero advantage gets a gradient.
    live = out.trust_mask & mask.any(-1) & (out.advantages != 0)
    assert live.any()
    assert (q.grad[live].abs().sum(-1) > 0).all()


def test_trajectory_without_valid_tokens_is_rejected_but_counts_in_b():
    logq = torch.tensor([[LOG_HALF, LOG_HALF], [LOG_HALF, LOG_HALF]], requires_grad=True)
    mask = _mask([[1, 1], [0, 0]])
    out = flash_reinforce_loss(logq, logq.detach(), torch.tensor([1.0, 0.0]), mask, delta=0.1)
    assert out.trust_mask.tolist() == [True, False]
    # A = [0.5, -0.5]; loss = -(1/2) * 0.5 / 2 * 2 ln .5 = -0.25 ln .5 = 0.1732868 (B = 2, not 1)
    assert out.loss.item() == pytest.approx(-0.25 * math.log(0.5), abs=1e-6)


def test_all_rejected_batch_gives_zero_loss_that_backpropagates():
    logq, logp, rewards, mask, _ = _random_batch(1, b=4, t=5, drift_scale=2.0)
    q = logq.clone().requires_grad_()
    out = flash_reinforce_loss(q, logp, rewards, mask, delta=0.0)
    assert not out.trust_mask.any()
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert q.grad is not None and torch.equal(q.grad, torch.zeros_like(q))
    assert out.metrics["accepted_fraction"] == 0.0 and out.metrics["tokens_kept"] == 0


def test_batch_of_one():
    # B = 1 with the batch-mean baseline: A = 0, so no learning signal and a zero (finite) loss.
    logq = torch.tensor([[-0.3, -1.0]], requires_grad=True)
    out = flash_reinforce_loss(logq, logq.detach(), torch.tensor([1.0]), _mask([[1, 1]]), delta=0.1)
    assert out.advantages.tolist() == [0.0]
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert torch.equal(logq.grad, torch.zeros_like(logq))
    # with no baseline the single reward drives the update: loss = -(1/1)(1/2)(-0.3 - 1.0) = 0.65
    out = flash_reinforce_loss(logq, logq.detach(), torch.tensor([1.0]), _mask([[1, 1]]), delta=0.1, baseline="none")
    assert out.loss.item() == pytest.approx(0.65, abs=1e-6)


def test_entropy_filter_semantics():
    # Row 0 is labelled a failure: entropies [0.1, 0.5, 0.9, 0.3], q = 0.5 -> ceil(0.5 * 4) = 2 tokens
    # kept, the two of highest entropy (columns 2 and 1); T_0 stays 4.
    # Row 1 succeeded: every token keeps its term despite low entropy.
    logq = torch.full((2, 4), LOG_HALF, requires_grad=True)
    entropy = torch.tensor([[0.1, 0.5, 0.9, 0.3], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.ones(2, 4, dtype=torch.bool)
    out = flash_reinforce_loss(
        logq, logq.detach(), torch.tensor([0.0, 1.0]), mask, delta=0.1, entropy=entropy,
        failures=torch.tensor([True, False]), negative_token_fraction=0.5,
    )
    out.loss.backward()
    # A = [-0.5, 0.5]; kept failure tokens: -(1/2)(-0.5)/4 = 1/16; success tokens: -(1/2)(0.5)/4 = -1/16
    expected = torch.tensor([[0.0, 1 / 16, 1 / 16, 0.0], [-1 / 16] * 4])
    torch.testing.assert_close(logq.grad, expected)
    assert out.metrics["tokens_kept"] == 6
    assert out.keep_mask.tolist() == [[False, True, True, False], [True] * 4]
    # loss = -(1/2)[(-0.5)/4 * 2 ln .5 + 0.5/4 * 4 ln .5] = -(1/2)(0.25 ln .5) = -0.125 ln .5
    assert out.loss.item() == pytest.approx(-0.125 * math.log(0.5), abs=1e-6)


def test_entropy_filter_ties_go_to_the_earlier_token_and_padding_never_counts():
    # A failed row of T_0 = 5 valid tokens (column 5 is padding with a huge entropy), entropies
    # [1, 2, 2, 2, 0]: q = 0.5 keeps ceil(2.5) = 3 tokens, 2, 2 and 2 (columns 1, 2, 3); q = 0.3 keeps
    # ceil(1.5) = 2: columns 1 and 2 (column 3 ties with them but comes later); q = 0.2 keeps ceil(1.0) = 1.
    entropy = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, 99.0]])
    mask = _mask([[1, 1, 1, 1, 1, 0]])
    failures = torch.tensor([True])
    from flashrl.algorithms.flash_reinforce.loss import failure_token_keep_mask

    def kept(q):
        return torch.nonzero(failure_token_keep_mask(entropy, mask, failures, q)[0]).flatten().tolist()

    assert kept(0.5) == [1, 2, 3]
    assert kept(0.3) == [1, 2]
    assert kept(0.2) == [1]
    assert kept(0.0) == []
    assert kept(1.0) == [0, 1, 2, 3, 4]
    assert failure_token_keep_mask(entropy, mask, ~failures, 0.0).tolist() == mask.tolist()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 6), t=st.integers(1, 9), fraction=st.floats(0.0, 1.0))
def test_property_entropy_filter_keeps_ceil_q_t_of_the_highest_entropies(seed, b, t, fraction):
    from flashrl.algorithms.flash_reinforce.loss import failure_token_keep_mask

    _, _, _, mask, entropy = _random_batch(seed, b, t)
    failures = torch.rand(b, generator=torch.Generator().manual_seed(seed)) < 0.5
    keep = failure_token_keep_mask(entropy, mask, failures, fraction)
    assert not (keep & ~mask).any()
    for i in range(b):
        n = int(mask[i].sum())
        if not failures[i]:
            assert torch.equal(keep[i], mask[i])
            continue
        assert int(keep[i].sum()) == math.ceil(fraction * n)
        if keep[i].any() and (mask[i] & ~keep[i]).any():
            assert entropy[i][keep[i]].min() >= entropy[i][mask[i] & ~keep[i]].max()


def test_bfloat16_inputs_are_computed_in_float32():
    logq, logp, rewards, mask, _ = _random_batch(5, b=4, t=6, drift_scale=0.05)
    q16 = logq.to(torch.bfloat16).requires_grad_()
    out16 = flash_reinforce_loss(q16, logp.to(torch.bfloat16), rewards.float(), mask, delta=0.1)
    assert out16.loss.dtype == torch.float32
    out32 = flash_reinforce_loss(
        q16.detach().float(), logp.to(torch.bfloat16).float(), rewards.float(), mask, delta=0.1
    )
    assert out16.loss.item() == out32.loss.item()
    out16.loss.backward()
    assert q16.grad.dtype == torch.bfloat16


def test_inputs_are_not_modified():
    logq, logp, rewards, mask, entropy = _random_batch(2, b=3, t=4)
    copies = [x.clone() for x in (logq, logp, rewards, mask, entropy)]
    flash_reinforce_loss(logq, logp, rewards, mask, delta=0.1, entropy=entropy,
                         failures=torch.tensor([True, False, True]), negative_token_fraction=0.5)
    for before, after in zip(copies, (logq, logp, rewards, mask, entropy)):
        assert torch.equal(before, after)


# --------------------------------------------------------------------------------------------------
# Property tests.

batches = st.builds(
    lambda seed, b, t, scale: _random_batch(seed, b, t, scale),
    st.integers(0, 10_000),
    st.integers(1, 7),
    st.integers(1, 10),
    st.sampled_from([0.0, 0.05, 0.5, 2.0]),
)


@settings(max_examples=60, deadline=None)
@given(batch=batches, delta=st.sampled_from([0.0, 0.01, 0.1, 1.0]))
def test_property_matches_reference_and_masks_agree(batch, delta):
    logq, logp, rewards, mask, _ = batch
    q1 = logq.clone().requires_grad_()
    out = flash_reinforce_loss(q1, logp, rewards, mask, delta=delta)
    out.loss.backward()
    q2 = logq.clone().requires_grad_()
    objective, surrogate, _, _drift, accepted = reference_objective(q2, logp, rewards, mask, delta)
    (-objective).backward()
    assert out.loss.item() == pytest.approx(surrogate, abs=1e-6)
    torch.testing.assert_close(q1.grad, q2.grad, rtol=0, atol=1e-6)
    assert out.trust_mask.tolist() == accepted
    assert (out.drift >= -1e-12).all()
    assert torch.equal(out.trust_mask, (out.drift <= delta) & mask.any(-1))


@settings(max_examples=40, deadline=None)
@given(batch=batches, shift=st.floats(-5, 5), perm_seed=st.integers(0, 100))
def test_property_reward_shift_and_permutation_invariance(batch, shift, perm_seed):
    logq, logp, rewards, mask, _ = batch
    base = flash_reinforce_loss(logq, logp, rewards, mask, delta=0.1).loss.item()
    shifted = flash_reinforce_loss(logq, logp, rewards + shift, mask, delta=0.1).loss.item()
    perm = torch.randperm(logq.shape[0], generator=torch.Generator().manual_seed(perm_seed))
    permuted = flash_reinforce_loss(logq[perm], logp[perm], rewards[perm], mask[perm], delta=0.1).loss.item()
    assert shifted == pytest.approx(base, abs=1e-9)
    assert permuted == pytest.approx(base, abs=1e-9)


# --------------------------------------------------------------------------------------------------
# Bad inputs name what was wrong.


def _ok():
    logq = torch.tensor([[-0.5, -1.0], [-0.2, -0.1]])
    return logq, logq.clone(), torch.tensor([1.0, 0.0]), torch.ones(2, 2, dtype=torch.bool)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: (a[0], a[1][:, :1], a[2], a[3]), "behavior_logprobs must have the shape"),
        (lambda a: (a[0], a[1], a[2][:1], a[3]), r"rewards must have shape \[B\] = \[2\]"),
        (lambda a: (a[0], a[1], a[2], a[3][:, :1]), "loss_mask must have the shape"),
        (lambda a: (a[0][0], a[1][0], a[2], a[3][0]), r"logprobs must be \[B, T\]"),
        (lambda a: (a[0], a[1], torch.tensor([float("nan"), 0.0]), a[3]), r"rewards must be finite; trajectories \[0\]"),
        (lambda a: (a[0], a[1], torch.tensor([1.0, float("inf")]), a[3]), r"trajectories \[1\]"),
        (lambda a: (torch.tensor([[-0.5, float("nan")], [-0.2, -0.1]]), a[1], a[2], a[3]), r"logprobs must be finite .* \[0\]"),
        (lambda a: (a[0], torch.tensor([[-0.5, -1.0], [-float("inf"), -0.1]]), a[2], a[3]), r"behavior_logprobs must be finite .* \[1\]"),
        (lambda a: (a[0] + 2.0, a[1], a[2], a[3]), "must be <= 0"),
        (lambda a: (a[0], a[1], a[2], a[3].float()), "loss_mask must be a bool tensor"),
        (lambda a: (a[0][:0], a[1][:0], a[2][:0], a[3][:0]), "Empty batch"),
    ],
)
def test_bad_inputs_raise_naming_the_problem(mutate, message):
    with pytest.raises(ValueError, match=message):
        flash_reinforce_loss(*mutate(_ok()), delta=0.1)


@pytest.mark.parametrize("delta", [-0.1, float("nan"), "0.1", True])
def test_bad_delta(delta):
    with pytest.raises(ValueError, match="delta must be a number >= 0"):
        flash_reinforce_loss(*_ok(), delta=delta)


def test_non_finite_values_outside_the_mask_are_ignored():
    logq, logp, rewards, _ = _ok()
    logq[1, 1] = float("nan")
    logp[1, 1] = float("-inf")
    mask = _mask([[1, 1], [1, 0]])
    out = flash_reinforce_loss(logq, logp, rewards, mask, delta=0.1)
    assert math.isfinite(out.loss.item())


def test_entropy_filter_needs_entropy_and_explicit_failures():
    with pytest.raises(ValueError, match="entropy and failures is None"):
        flash_reinforce_loss(*_ok(), delta=0.1, negative_token_fraction=0.5)
    with pytest.raises(ValueError, match="failures is None"):
        flash_reinforce_loss(*_ok(), delta=0.1, entropy=torch.zeros(2, 2), negative_token_fraction=0.5)
    with pytest.raises(ValueError, match=r"failures must be a bool tensor of shape \[2\]"):
        flash_reinforce_loss(*_ok(), delta=0.1, entropy=torch.zeros(2, 2), failures=torch.tensor([1.0, 0.0]),
                             negative_token_fraction=0.5)
    with pytest.raises(ValueError, match=r"negative_token_fraction must be a number in \[0, 1\]"):
        flash_reinforce_loss(*_ok(), delta=0.1, entropy=torch.zeros(2, 2), failures=torch.tensor([True, False]),
                             negative_token_fraction=1.5)
    # q = 1 is the base method: nothing else is needed.
    flash_reinforce_loss(*_ok(), delta=0.1, negative_token_fraction=1.0)
