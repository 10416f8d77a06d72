"""Baselines, trust regions and aggregations: hand-computed values and the registry contract."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch

from flashrl.algorithms.flash_reinforce.components import (
    AGGREGATIONS,
    BASELINES,
    TRUST_REGIONS,
    bernoulli_kl,
)
from flashrl.algorithms.flash_reinforce.loss import flash_reinforce_loss

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.5])


def test_registered_names():
    assert BASELINES.names() == ["batch_mean", "group_mean", "leave_one_out", "none"]
    assert TRUST_REGIONS.names() == ["bernoulli_kl", "none"]
    assert AGGREGATIONS.names() == ["sample_mean", "token_mean"]


def test_batch_mean_baseline():
    # mean = 2/4 = 0.5
    torch.testing.assert_close(BASELINES.build("batch_mean")(REWARDS), torch.full((4,), 0.5))


def test_leave_one_out_baseline():
    # sum = 2; b_i = (2 - R_i) / 3 -> [1/3, 2/3, 1/2, 1/2]
    torch.testing.assert_close(BASELINES.build("leave_one_out")(REWARDS), torch.tensor([1 / 3, 2 / 3, 0.5, 0.5]))
    assert BASELINES.build("leave_one_out")(torch.tensor([3.0])).tolist() == [0.0]


def test_group_mean_baseline():
    # groups: {0: [1.0, 0.0] -> 0.5}, {7: [0.5, 0.5] -> 0.5}; use uneven rewards to see the split
    rewards = torch.tensor([1.0, 0.0, 0.9, 0.3, 0.0])
    groups = torch.tensor([0, 0, 7, 7, 3])
    # group 0 mean 0.5, group 7 mean 0.6, group 3 mean 0.0
    torch.testing.assert_close(
        BASELINES.build("group_mean")(rewards, group_ids=groups), torch.tensor([0.5, 0.5, 0.6, 0.6, 0.0])
    )
    with pytest.raises(ValueError, match="needs group_ids"):
        BASELINES.build("group_mean")(rewards)


def test_none_baseline():
    assert BASELINES.build("none")(REWARDS).tolist() == [0.0] * 4


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match=r"Unknown baseline 'median'; expected one of \['batch_mean'"):
        flash_reinforce_loss(torch.zeros(1, 1) - 1, torch.zeros(1, 1) - 1, torch.ones(1), torch.ones(1, 1, dtype=torch.bool), delta=0.1, baseline="median")


def test_custom_baseline_object_in_a_few_lines():
    class ConstantBaseline:
        def __call__(self, rewards, *, group_ids=None):
            return torch.full_like(rewards, 0.25)

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
