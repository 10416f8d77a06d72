"""The Bernoulli-KL drift used to report train/inference agreement, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from flashrl.engines.agreement import bernoulli_kl


def _kl(p: float, q: float) -> float:
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


@pytest.mark.parametrize(("p", "q"), [(0.5, 0.6), (0.9, 0.2), (1e-6, 1e-5), (0.999, 0.99), (0.3, 0.3)])
def test_matches_the_definition(p: float, q: float) -> None:
    got = bernoulli_kl(
        torch.tensor([math.log(p)], dtype=torch.float64), torch.tensor([math.log(q)], dtype=torch.float64)
    )
    assert got.item() == pytest.approx(_kl(p, q), rel=1e-9, abs=1e-15)


def test_certain_tokens_stay_finite() -> None:
    behavior = torch.tensor([0.0, -1e-9, -1e-3])
    current = torch.tensor([-1e-9, 0.0, 0.0])
    got = bernoulli_kl(behavior, current)
    assert torch.isfinite(got).all()
    assert got[0].item() == pytest.approx(0.0, abs=1e-6) and got[1].item() == pytest.approx(0.0, abs=1e-6)
    # p = 1 - 1e-3 against q = 1 (float32 resolution): about p log(p/q) + (1-p) log((1-p)/2^-23)
    assert got[2].item() == pytest.approx(_kl(1 - 1e-3, 1 - 2**-23), rel=1e-3)
