"""Baselines, importance sampling, trust regions and aggregations: hand-computed values, the registries."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch

from flashrl.algorithms.flash_reinforce.components import (
    AGGREGATIONS,
    BASELINES,
    IMPORTANCE_SAMPLINGS,
    TRUST_REGIONS,
    bernoulli_kl,
    bernoulli_kl_clamped,
)
from flashrl.algorithms.flash_reinforce.loss import flash_reinforce_loss

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.5])


def _builtin(registry) -> list[str]:
    """The names flashrl registers itself (other test modules register their own at import)."""
    return [n for n in registry.names() if registry._factories[n].__module__.startswith("flashrl.")]


def test_registered_names():
    assert _builtin(BASELINES) == ["batch_mean", "group_mean", "group_norm", "leave_one_out", "none"]
    assert _builtin(IMPORTANCE_SAMPLINGS) == ["none", "token"]
    assert _builtin(TRUST_REGIONS) == ["bernoulli_kl", "bernoulli_kl_exact", "none", "tv"]
    assert _builtin(AGGREGATIONS) == ["constant_length", "sample_mean", "token_mean"]


# Baselines return the advantages A [B].


def test_batch_mean_baseline():
    # mean = 2/4 = 0.5 -> A = [0.5, -0.5, 0, 0]
    torch.testing.assert_close(BASELINES.build("batch_mean")(REWARDS), torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_leave_one_out_baseline():
    # sum = 2; b_i = (2 - R_i) / 3 -> [1/3, 2/3, 1/2, 1/2]; A = R - b
    torch.testing.assert_close(BASELINES.build("leave_one_out")(REWARDS), torch.tensor([2 / 3, -2 / 3, 0.0, 0.0]))
    assert BASELINES.build("leave_one_out")(torch.tensor([3.0])).tolist() == [3.0]


def test_group_mean_baseline():
    rewards = torch.tensor([1.0, 0.0, 0.9, 0.3, 0.0])
    groups = torch.tensor([0, 0, 7, 7, 3])
    # group 0 mean 0.5, group 7 mean 0.6, group 3 mean 0.0
    torch.testing.assert_close(
        BASELINES.build("group_mean")(rewards, group_ids=groups), torch.tensor([0.5, -0.5, 0.3, -0.3, 0.0])
    )
    with pytest.raises(ValueError, match="needs group_ids"):
        BASELINES.build("group_mean")(rewards)


def test_group_norm_baseline_is_grpo_with_the_sample_std():
    # Group 5: [1, 0, 0], mean 1/3, centred [2/3, -1/3, -1/3], SAMPLE variance (4/9 + 1/9 + 1/9) / 2 = 1/3,
    #   std 0.5773503 -> A = [1.1547005, -0.5773503, -0.5773503] (the population std would give 1.4142136).
    # Group 2: [0.9, 0.3], mean 0.6, std sqrt(0.18) = 0.4242641 -> A = [0.7071068, -0.7071068].
    # Group 9: one rollout, std 0 -> A = 0 / (0 + 1e-9) = 0.   (eps 1e-9: Molt's grpo estimator)
    rewards = torch.tensor([1.0, 0.9, 0.0, 0.3, 0.0, 4.0], dtype=torch.float64)
    groups = torch.tensor([5, 2, 5, 2, 5, 9])
    got = BASELINES.build("group_norm")(rewards, group_ids=groups)
    expected = torch.tensor([1.1547005, 0.7071068, -0.5773503, -0.7071068, -0.5773503, 0.0], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)
    # A group whose rewards are all equal has no signal: 0 / (0 + eps).
    same = BASELINES.build("group_norm")(torch.tensor([1.0, 1.0]), group_ids=torch.tensor([0, 0]))
    assert same.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="baseline='group_norm' needs group_ids"):
        BASELINES.build("group_norm")(rewards)


def test_none_baseline():
    assert BASELINES.build("none")(REWARDS).tolist() == REWARDS.tolist()


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match=r"Unknown baseline 'no_such_baseline'; expected one of \['batch_mean'"):
        flash_reinforce_loss(torch.zeros(1, 1) - 1, torch.zeros(1, 1) - 1, torch.ones(1), torch.ones(1, 1, dtype=torch.bool), delta=0.1, baseline="no_such_baseline")


def test_custom_baseline_object_in_a_few_lines():
    class ConstantBaseline:
        def __call__(self, rewards, *, group_ids=None):
            return rewards - 0.25  # the advantages

    logq = torch.tensor([[-1.0], [-2.0]])
    out = flash_reinforce_loss(logq, logq, torch.tensor([1.0, 0.0]), torch.ones(2, 1, dtype=torch.bool), delta=0.1, baseline=ConstantBaseline())
    assert out.advantages.tolist() == [0.75, -0.25]
    # loss = -(1/2)[0.75 * (-1) + (-0.25)(-2)] = -(1/2)(-0.25) = 0.125
    assert out.loss.item() == pytest.approx(0.125)


def test_no_trust_region_accepts_everything_with_tokens():
    logq = torch.tensor([[-0.1, -0.1], [-5.0, -5.0]])
    logp = torch.tensor([[-5.0, -5.0], [-0.1, -0.1]])
    mask = torch.tensor([[True, True], [False, False]])
    out = flash_reinforce_loss(logq, logp, torch.tensor([1.0, 0.0]), mask, delta=0.0, trust_region="none")
    assert out.trust_mask.tolist() == [True, False]
    assert out.drift[0] > 1.0  # still reported


def test_token_mean_aggregation():
    # rows: 1 valid token with lq = -1, 3 valid tokens with lq = -2; p = q; A = [0.5, -0.5]
    # token_mean: -(0.5 * -1 + (-0.5) * 3 * -2) / 4 = -(-0.5 + 3) / 4 = -0.625
    # sample_mean: -(1/2)(0.5 * -1 + (-0.5) * -2) = -(1/2)(0.5) = -0.25
    logq = torch.tensor([[-1.0, 0.0, 0.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[True, False, False], [True, True, True]])
    rewards = torch.tensor([1.0, 0.0])
    token = flash_reinforce_loss(logq, logq, rewards, mask, delta=0.1, aggregation="token_mean")
    sample = flash_reinforce_loss(logq, logq, rewards, mask, delta=0.1)
    assert token.loss.item() == pytest.approx(-0.625)
    assert sample.loss.item() == pytest.approx(-0.25)
    # A global token count (data parallelism) replaces this batch's: -(2.5) / 10 = -0.25
    wider = flash_reinforce_loss(logq, logq, rewards, mask, delta=0.1, aggregation="token_mean", num_tokens=10)
    assert wider.loss.item() == pytest.approx(-0.25)


def test_constant_length_aggregation_divides_by_b_times_l():
    # Same rows: token sum 0.5 * -1 + (-0.5) * 3 * -2 = 2.5; L = 4, B = 2: loss = -2.5 / 8 = -0.3125
    logq = torch.tensor([[-1.0, 0.0, 0.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[True, False, False], [True, True, True]])
    out = flash_reinforce_loss(logq, logq, torch.tensor([1.0, 0.0]), mask, delta=0.1,
                               aggregation="constant_length", constant_length_normalizer=4)
    assert out.loss.item() == pytest.approx(-0.3125)
    # A rejected trajectory stays in B: the same batch with one more (rejected) row divides by 3 x 4.
    logq3 = torch.cat([logq, torch.tensor([[-0.1, -0.1, -0.1]])])
    logp3 = torch.cat([logq, torch.tensor([[-5.0, -5.0, -5.0]])])
    mask3 = torch.cat([mask, torch.ones(1, 3, dtype=torch.bool)])
    out3 = flash_reinforce_loss(logq3, logp3, torch.tensor([1.0, 0.0, 0.5]), mask3, delta=0.1,
                                aggregation="constant_length", constant_length_normalizer=4)
    assert out3.trust_mask.tolist() == [True, True, False]
    # A = [0.5, -0.5, 0]: -2.5 / 12
    assert out3.loss.item() == pytest.approx(-2.5 / 12)
    with pytest.raises(ValueError, match="needs constant_length_normalizer"):
        flash_reinforce_loss(logq, logq, torch.tensor([1.0, 0.0]), mask, delta=0.1, aggregation="constant_length")


# Importance sampling.


def test_no_importance_sampling_uses_ratio_one_and_disables_the_gate():
    # Row 0 was sampled by a very different policy (p = e^-3, q = e^-0.5): the token ratio is e^2.5 and
    # the KL gate rejects it at delta = 1e-3. Without behavior correction (the reference's no_is) the
    # denominator is the current policy: ratio 1, drift 0, accepted.
    logq = torch.tensor([[-0.5], [-1.0]], requires_grad=True)
    logp = torch.tensor([[-3.0], [-1.0]])
    mask = torch.ones(2, 1, dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0])
    gated = flash_reinforce_loss(logq, logp, rewards, mask, delta=1e-3)
    assert gated.trust_mask.tolist() == [False, True]
    out = flash_reinforce_loss(logq, logp, rewards, mask, delta=1e-3, importance_sampling="none")
    assert out.trust_mask.tolist() == [True, True]
    assert out.drift.tolist() == [0.0, 0.0]
    # The loss's ratio is 1 (the gradient below); the ratio metrics still report q/p, the policy lag.
    assert out.metrics["ratio_max"] == pytest.approx(math.exp(2.5))
    assert out.metrics["ratio_min"] == 1.0 and out.metrics["accepted_fraction"] == 1.0
    out.loss.backward()
    # A = [0.5, -0.5]: d loss / d log q = -(1/2) A_i * 1
    torch.testing.assert_close(logq.grad, torch.tensor([[-0.25], [0.25]]))


def test_grpo_as_components():
    # The reference's grpo variant: group-normalised advantages, no behavior correction, no trust region,
    # token mean. Groups {0: rewards [1, 0]} and {1: [1, 1]}; lengths [1, 2, 1, 1]; log q = -1 everywhere;
    # stale behavior log-probs are ignored.
    # A = [0.5, -0.5] / sqrt(0.5) = [0.7071068, -0.7071068] and [0, 0]. Token sum: 0.7071068 * -1 +
    # (-0.7071068) * 2 * -1 = 0.7071068 over 5 tokens: loss = -0.1414214.
    logq = torch.tensor([[-1.0, 0.0], [-1.0, -1.0], [-1.0, 0.0], [-1.0, 0.0]], requires_grad=True)
    logp = torch.tensor([[-6.0, 0.0], [-0.1, -0.2], [-1.0, 0.0], [-3.0, 0.0]])
    mask = torch.tensor([[True, False], [True, True], [True, False], [True, False]])
    out = flash_reinforce_loss(
        logq, logp, torch.tensor([1.0, 0.0, 1.0, 1.0]), mask, delta=1e-3, baseline="group_norm",
        group_ids=torch.tensor([0, 0, 1, 1]), importance_sampling="none", trust_region="none",
        aggregation="token_mean",
    )
    assert out.loss.item() == pytest.approx(-0.1414214, abs=1e-6)
    out.loss.backward()
    a = 0.5 / math.sqrt(0.5)
    torch.testing.assert_close(
        logq.grad, torch.tensor([[-a / 5, 0.0], [a / 5, a / 5], [0.0, 0.0], [0.0, 0.0]]), rtol=0, atol=1e-6
    )


# Trust regions.


def test_tv_trust_region_is_the_mean_absolute_probability_difference():
    # Row 0: tokens (p, q) = (0.2, 0.4) and (0.5, 0.5): |p - q| = [0.2, 0] -> drift 0.1.
    # Row 1: one token (0.9, 0.6): drift 0.3.
    logp = torch.log(torch.tensor([[0.2, 0.5], [0.9, 1.0]], dtype=torch.float64))
    logq = torch.log(torch.tensor([[0.4, 0.5], [0.6, 1.0]], dtype=torch.float64))
    mask = torch.tensor([[True, True], [True, False]])
    decision = TRUST_REGIONS.build("tv")(logq, logp, mask, delta=0.1)
    torch.testing.assert_close(decision.drift, torch.tensor([0.1, 0.3], dtype=torch.float64))
    assert decision.trust_mask.tolist() == [True, False]  # 0.1 <= 0.1 accepted at the boundary
    assert TRUST_REGIONS.build("tv")(logq, logp, mask, delta=0.0999).trust_mask.tolist() == [False, False]


def test_clamped_and_exact_bernoulli_kl_gates():
    # Both probabilities below 1e-6 are clamped to 1e-6: the published gate sees no drift at all, the
    # exact form sees p log(p/q) + (1-p) log((1-p)/(1-q)) with p = 1e-8, q = 1e-7.
    logp = torch.tensor([[math.log(1e-8)]], dtype=torch.float64)
    logq = torch.tensor([[math.log(1e-7)]], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    exact = 1e-8 * math.log(0.1) + (1 - 1e-8) * math.log((1 - 1e-8) / (1 - 1e-7))
    assert TRUST_REGIONS.build("bernoulli_kl")(logq, logp, mask, delta=0.0).drift.item() == 0.0
    got = TRUST_REGIONS.build("bernoulli_kl_exact")(logq, logp, mask, delta=0.0).drift.item()
    assert got == pytest.approx(exact, rel=1e-9)
    # p = 1 - 1e-9 is clamped to 1 - 1e-6 against q = 0.5.
    e = 1e-6
    clamped = (1 - e) * math.log((1 - e) / 0.5) + e * math.log(e / 0.5)
    value = bernoulli_kl_clamped(torch.tensor(math.log1p(-1e-9), dtype=torch.float64),
                                 torch.tensor(math.log(0.5), dtype=torch.float64))
    assert float(value) == pytest.approx(clamped, rel=1e-12)


def test_infinite_delta_accepts_every_trajectory_with_tokens():
    logq = torch.tensor([[-0.1, -0.1], [-5.0, -5.0], [-1.0, -1.0]])
    logp = torch.tensor([[-5.0, -5.0], [-0.1, -0.1], [-1.0, -1.0]])
    mask = torch.tensor([[True, True], [True, True], [False, False]])
    rewards = torch.tensor([1.0, 0.0, 0.5])
    for name in ("bernoulli_kl", "bernoulli_kl_exact", "tv"):
        out = flash_reinforce_loss(logq, logp, rewards, mask, delta=math.inf, trust_region=name)
        assert out.trust_mask.tolist() == [True, True, False], name
        none = flash_reinforce_loss(logq, logp, rewards, mask, delta=0.0, trust_region="none")
        assert out.loss.item() == none.loss.item()


def _kl_exact(lp: float, lq: float) -> float:
    mpmath.mp.dps = 60
    p, q = mpmath.exp(mpmath.mpf(lp)), mpmath.exp(mpmath.mpf(lq))
    return float(p * mpmath.log(p / q) + (1 - p) * mpmath.log((1 - p) / (1 - q)))


LOGS = [-1e-12, -1e-8, -1e-6, -1e-4, -1e-2, -0.5, -3.0, -20.0]


@pytest.mark.parametrize("lp", LOGS)
@pytest.mark.parametrize("lq", LOGS)
def test_bernoulli_kl_is_finite_and_accurate_near_one(lp, lq):
    for dtype, rtol in ((torch.float64, 1e-9), (torch.float32, 1e-4)):
        if dtype == torch.float32 and max(lp, lq) > -1e-7:
            continue  # below float32's resolution of 1 - p; see the capped test below
        lp_t, lq_t = torch.tensor(lp, dtype=dtype), torch.tensor(lq, dtype=dtype)
        got = float(bernoulli_kl(lp_t, lq_t))
        exact = _kl_exact(float(lp_t), float(lq_t))  # of the values as stored in that dtype
        assert math.isfinite(got)
        assert got == pytest.approx(exact, rel=rtol, abs=1e-30)


def test_bernoulli_kl_at_probability_one_is_finite():
    zero = torch.tensor(0.0)
    assert float(bernoulli_kl(zero, zero)) == 0.0
    # p = 1, q = 0.5: KL = ln 2
    assert float(bernoulli_kl(zero, torch.tensor(math.log(0.5)))) == pytest.approx(math.log(2), rel=1e-5)  # cap: 1e-6 off
    # p = 0.5, q -> 1 in float: large but finite
    assert math.isfinite(float(bernoulli_kl(torch.tensor(math.log(0.5)), zero)))


def test_bernoulli_kl_caps_log_probs_at_the_dtype_resolution():
    # float32 log q = 0 means 1 - q < 2**-24; with p = 0.999 the cap gives
    # 0.999 ln(0.999 / (1 - 2**-24)) + 0.001 ln(0.001 / 2**-24) = -0.0009995 + 0.0097304 = 0.0087309
    got = float(bernoulli_kl(torch.tensor(math.log(0.999)), torch.tensor(0.0)))
    assert got == pytest.approx(0.0087309, rel=1e-3)
