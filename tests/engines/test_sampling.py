"""The sampling transform: hand-computed top-k / top-p supports, exact log-probs, sampling frequencies."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashrl.engines import RequestError, SamplingConfig
from flashrl.engines.sampling import processed_logprobs, sample_tokens

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]])  # softmax: 0.6439, 0.2369, 0.0871, 0.0321


def _run(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    b = logits.shape[0]
    return processed_logprobs(
        logits, torch.full((b,), temperature), torch.full((b,), top_k), torch.full((b,), top_p)
    )


def test_plain_and_temperature() -> None:
    torch.testing.assert_close(_run(LOGITS), LOGITS.log_softmax(-1))
    torch.testing.assert_close(_run(LOGITS, temperature=0.5), (LOGITS / 0.5).log_softmax(-1))
    torch.testing.assert_close(_run(LOGITS, temperature=0.0), LOGITS.log_softmax(-1))  # greedy: T = 1


def test_top_k_renormalises_over_the_k_best() -> None:
    lp = _run(LOGITS, top_k=2)[0]
    z = math.log(math.exp(2.0) + math.exp(1.0))
    assert lp[0].item() == pytest.approx(2.0 - z) and lp[1].item() == pytest.approx(1.0 - z)
    assert lp[2] == -math.inf and lp[3] == -math.inf


def test_top_k_keeps_ties() -> None:
    lp = _run(torch.tensor([[1.0, 1.0, 1.0, 0.0]]), top_k=2)[0]
    torch.testing.assert_close(lp[:3], torch.full((3,), -math.log(3.0)))
    assert lp[3] == -math.inf


def test_top_p_drops_tail_whose_mass_fits_in_one_minus_p() -> None:
    # ascending mass: 0.0321, 0.1192 (cum), 0.3561, 1.0
    lp = _run(LOGITS, top_p=0.85)[0]  # drop cum <= 0.15: the two least likely
    z = math.log(math.exp(2.0) + math.exp(1.0))
    assert lp[0].item() == pytest.approx(2.0 - z) and lp[2] == -math.inf and lp[3] == -math.inf
    lp = _run(LOGITS, top_p=0.9)[0]  # drop cum <= 0.1: only the least likely
    assert torch.isfinite(lp[:3]).all() and lp[3] == -math.inf
    lp = _run(LOGITS, top_p=0.01)[0]  # the most likely token always stays
    assert lp[0].item() == 0.0 and torch.isinf(lp[1:]).all()


def test_rows_use_their_own_settings() -> None:
    logits = LOGITS.repeat(2, 1)
    lp = processed_logprobs(logits, torch.tensor([1.0, 0.5]), torch.tensor([0, 1]), torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(lp[0], LOGITS[0].log_softmax(-1))
    assert lp[1, 0].item() == 0.0 and torch.isinf(lp[1, 1:]).all()


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    temperature=st.floats(0.1, 3.0),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.05, 1.0),
)
def test_processed_distribution_is_normalised_and_keeps_the_argmax(
    seed: int, temperature: float, top_k: int, top_p: float
) -> None:
    logits = torch.randn((3, 10), generator=torch.Generator().manual_seed(seed)) * 3
    lp = _run(logits, temperature, top_k, top_p)
    finite = torch.where(torch.isfinite(lp), lp, torch.full_like(lp, -1e30))
    torch.testing.assert_close(finite.logsumexp(-1), torch.zeros(3), atol=1e-5, rtol=0)
    assert torch.isfinite(lp.gather(-1, logits.argmax(-1, keepdim=True))).all()
    kept = torch.isfinite(lp).sum(-1)  # [3] continuous random logits: no ties
    if 0 < top_k < 10:
        assert (kept <= top_k).all()


def test_sampling_frequencies_follow_the_processed_distribution() -> None:
    lp = _run(LOGITS.repeat(4000, 1), top_k=3)  # [4000, 4]
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    tokens = sample_tokens(lp, torch.zeros(4000, dtype=torch.bool), gens)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    expected = lp[0].exp()
    assert freq[3] == 0.0  # outside the top-3 support: never drawn
    # binomial standard error at n=4000 is <= 0.008; allow 4 of them
    torch.testing.assert_close(freq, expected, atol=0.032, rtol=0)


def test_greedy_rows_take_the_argmax_and_seeds_reproduce() -> None:
    lp = _run(torch.randn((5, 50), generator=torch.Generator().manual_seed(0)))
    greedy = torch.tensor([True, False, False, True, False])
    a = sample_tokens(lp, greedy, [torch.Generator().manual_seed(i) for i in range(5)])
    b = sample_tokens(lp, greedy, [torch.Generator().manual_seed(i) for i in range(5)])
    assert torch.equal(a, b)
    assert a[0] == lp[0].argmax() and a[3] == lp[3].argmax()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "finite"),
        ({"max_tokens": 0}, "max_tokens must be an int >= 1"),
        ({"top_p": 0.0}, r"top_p must lie in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must lie in \(0, 1\]"),
        ({"top_k": -3}, "top_k must be an int >= 0"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ],
)
def test_invalid_sampling_values_say_what_is_wrong(kwargs: dict, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        SamplingConfig(**kwargs).validate()


def test_truncation_warns_about_support(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="flashrl.engines"):
        SamplingConfig(top_p=0.93).validate()
        SamplingConfig(top_p=1.0, top_k=0).validate()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "support" in messages[0] and "top_p=0.93" in messages[0]
