"""The cases of the method's public reference tests, on flashrl's loss.

Each test here is one case of ``tests/test_loss.py`` in repository ``yifanzhang-pro/FlashREINFORCE``
(the reference ``flashreinforce/loss.py``), rewritten for ``flash_reinforce_loss``: the same inputs,
the same expected numbers. The reference's default ``delta`` is 3e-3 (its ``flashreinforce/loss.py``);
flashrl's loss has no default, so the cases that rely on it pass it. One case differs on purpose and
says so: a trajectory without policy tokens is rejected by flashrl, where the reference raises.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashrl.algorithms.flash_reinforce.loss import flash_reinforce_loss

REFERENCE_DELTA = 3e-3
"""The reference loss's default delta (``flashreinforce/loss.py``)."""


def _ones(b: int, t: int) -> torch.Tensor:
    return torch.ones(b, t, dtype=torch.bool)


def test_gradient_matches_the_paper_and_behavior_and_rewards_get_none():
    # Row 0 has one policy token, row 1 three; behavior = current - 0.1 -> every ratio is e^0.1.
    # A = [0.5, -0.5]; d loss / d log q_it = -(1/B) A_i rho / T_i.
    current = torch.tensor([[-1.0, -2.0, -3.0], [-2.0, -1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    behavior = (current.detach() - 0.1).requires_grad_()
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    out = flash_reinforce_loss(current, behavior, rewards, mask, delta=math.inf)
    out.loss.backward()
    rho = math.exp(0.1)
    expected = torch.tensor(
        [[-0.5 * rho / 1 / 2, 0.0, 0.0], [0.5 * rho / 3 / 2] * 3], dtype=torch.float64
    )
    torch.testing.assert_close(current.grad, expected, rtol=1e-6, atol=1e-8)
    assert behavior.grad is None and rewards.grad is None
    assert not out.advantages.requires_grad and not out.drift.requires_grad and not out.trust_mask.requires_grad


def test_sequence_gate_removes_the_whole_row_and_keeps_the_original_batch_denominator():
    # Row 0's first token: p = e^-4, q = e^-1, a drift far above 3e-3 -> rejected. Row 1 is on-policy.
    # A = [0.5, -0.5]; row 1's gradient is -(1/2)(-0.5)/2 = 0.125 per token (B = 2, not 1).
    current = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], requires_grad=True)
    behavior = torch.tensor([[-4.0, -1.0], [-1.0, -1.0]])
    out = flash_reinforce_loss(current, behavior, torch.tensor([1.0, 0.0]), _ones(2, 2), delta=REFERENCE_DELTA)
    assert out.trust_mask.tolist() == [False, True]
    out.loss.backward()
    torch.testing.assert_close(current.grad, torch.tensor([[0.0, 0.0], [0.125, 0.125]]))


def test_masked_nan_and_inf_do_not_reach_the_loss_or_the_gradient():
    current = torch.tensor([[-1.0, float("nan")], [-1.0, float("inf")]], requires_grad=True)
    behavior = torch.tensor([[-1.0, float("inf")], [-1.0, float("nan")]])
    mask = torch.tensor([[True, False], [True, False]])
    out = flash_reinforce_loss(current, behavior, torch.tensor([1.0, 0.0]), mask, delta=REFERENCE_DELTA)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(current.grad).all()
    assert current.grad[:, 1].eq(0).all()


@pytest.mark.parametrize(("fraction", "expected_count"), [(0.0, 0), (0.2, 1), (0.9, 3), (1.0, 3)])
def test_negative_filter_keeps_ceil_q_t_and_divides_by_the_original_length(fraction, expected_count):
    # Three policy tokens per row (column 3 is padding with entropy 99, which must never be kept).
    # Row 1 failed: ceil(q * 3) tokens of highest entropy survive; T_1 stays 3, so a kept token's
    # gradient is -(1/2)(-0.5)/3 = 1/12 and row 0's is -(1/2)(0.5)/3 = -1/12.
    current = torch.full((2, 4), -1.0, requires_grad=True)
    mask = torch.tensor([[True, True, True, False], [True, True, True, False]])
    out = flash_reinforce_loss(
        current, current.detach(), torch.tensor([1.0, 0.0]), mask, delta=REFERENCE_DELTA,
        negative_token_fraction=fraction, failures=torch.tensor([False, True]),
        entropy=torch.tensor([[1.0, 2.0, 3.0, 99.0], [1.0, 2.0, 3.0, 99.0]]),
    )
    out.loss.backward()
    assert out.keep_mask.sum(-1).tolist() == [3, expected_count]
    assert current.grad[1, 3] == 0
    if expected_count:
        assert current.grad[1, 2].item() == pytest.approx(1 / 12)
    assert current.grad[0, 0].item() == pytest.approx(-1 / 12)


@pytest.mark.parametrize("all_rejected", [False, True])
def test_zero_gradient_for_constant_rewards_or_when_all_are_rejected(all_rejected):
    current = torch.full((2, 3), -1.0, requires_grad=True)
    behavior = torch.full((2, 3), -4.0 if all_rejected else -1.0)
    rewards = torch.tensor([1.0, 0.0] if all_rejected else [1.0, 1.0])
    out = flash_reinforce_loss(current, behavior, rewards, _ones(2, 3), delta=REFERENCE_DELTA)
    out.loss.backward()
    assert out.loss.item() == 0 and current.grad.eq(0).all()


def test_binary_kl_direction_and_boundary():
    # KL(p || q) with p = behavior = 0.2 and q = current = 0.4, not the reverse; drift == delta is admitted.
    p, q = 0.2, 0.4
    current = torch.tensor([[math.log(q)], [math.log(q)]], dtype=torch.float64)
    behavior = torch.full_like(current, math.log(p))
    args = (current, behavior, torch.tensor([1.0, 0.0]), _ones(2, 1))
    out = flash_reinforce_loss(*args, delta=math.inf)
    expected = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
    assert out.drift[0].item() == pytest.approx(expected)
    boundary = flash_reinforce_loss(*args, delta=out.drift[0].item())
    assert boundary.trust_mask.all()


@pytest.mark.parametrize("invalid", ["nan", "positive", "fraction", "delta", "filter"])
def test_invalid_inputs(invalid):
    current = torch.full((2, 3), -1.0)
    kwargs = {"delta": REFERENCE_DELTA}
    if invalid == "nan":
        current[0, 0] = float("nan")
    if invalid == "positive":
        current[0, 0] = 0.1
    if invalid == "fraction":
        kwargs["negative_token_fraction"] = 1.1
    if invalid == "delta":
        kwargs["delta"] = -1
    if invalid == "filter":  # a fraction below 1 without entropies and failure labels
        kwargs["negative_token_fraction"] = 0.2
    with pytest.raises(ValueError):
        flash_reinforce_loss(current, current.clone(), torch.tensor([1.0, 0.0]), _ones(2, 3), **kwargs)


def test_a_row_without_policy_tokens_is_rejected_not_an_error():
    # flashrl's choice (docs/design.md §1.3): the reference raises for an empty row; flashrl rejects the
    # trajectory and keeps it in B. A = [0.5, -0.5]; row 1: -(1/2)(-0.5)/3 = 1/12 per token.
    current = torch.full((2, 3), -1.0, requires_grad=True)
    mask = _ones(2, 3)
    mask[0] = False
    out = flash_reinforce_loss(current, current.detach(), torch.tensor([1.0, 0.0]), mask, delta=REFERENCE_DELTA)
    assert out.trust_mask.tolist() == [False, True]
    out.loss.backward()
    torch.testing.assert_close(current.grad, torch.tensor([[0.0] * 3, [1 / 12] * 3]))


def test_sample_mean_keeps_the_total_gradient_when_a_trajectory_is_longer():
    totals = []
    for length in (1, 9):
        current = torch.full((2, length), -1.0, requires_grad=True)
        mask = _ones(2, length)
        mask[0, 1:] = False
        out = flash_reinforce_loss(current, current.detach(), torch.tensor([2.0, -1.0]), mask, delta=REFERENCE_DELTA)
        out.loss.backward()
        totals.append(current.grad.sum(-1))
    torch.testing.assert_close(totals[0], totals[1])


def test_the_filter_follows_explicit_failures_not_the_advantage_sign():
    # Row 0 has the negative advantage (rewards [1, 2]) but succeeded; row 1 is labelled the failure and
    # loses every token at q = 0.
    current = torch.full((2, 2), -1.0, requires_grad=True)
    out = flash_reinforce_loss(
        current, current.detach(), torch.tensor([1.0, 2.0]), _ones(2, 2), delta=REFERENCE_DELTA,
        negative_token_fraction=0.0, failures=torch.tensor([False, True]), entropy=torch.ones(2, 2),
    )
    assert out.advantages[0] < 0
    assert out.keep_mask.sum(-1).tolist() == [2, 0]
    out.loss.backward()
    assert current.grad[0].ne(0).all() and current.grad[1].eq(0).all()


def test_bfloat16_probabilities_are_promoted_before_the_gate():
    # log q = 0 (p = q = 1, clamped to 1 - 1e-6): the gate admits, the loss is float32.
    current = torch.zeros(2, 2, dtype=torch.bfloat16, requires_grad=True)
    out = flash_reinforce_loss(current, current.detach(), torch.tensor([1.0, 0.0]), _ones(2, 2), delta=REFERENCE_DELTA)
    out.loss.backward()
    assert out.loss.dtype == torch.float32
    assert out.trust_mask.all() and torch.isfinite(current.grad).all()
