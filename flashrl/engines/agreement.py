"""Train/inference agreement: an engine's recorded log-probs vs the learner's recomputation.

The learner recomputes every sampled token's log-prob with plain transformers
(``flashrl.models.compute_token_logprobs``) and compares it with what the engine recorded at
sampling time: mean and max absolute difference, and the Bernoulli-KL drift that FlashREINFORCE's
trust region uses (``d = p log(p/q) + (1-p) log((1-p)/(1-q))`` with ``p`` the behavior and ``q``
the recomputed probability of the token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashrl.engines.types import Completion

__all__ = ["AgreementReport", "bernoulli_kl", "measure_agreement"]


_LOG_ONE_MINUS_EPS = -1.1920929e-07  # log(1 - 2^-23), float32 resolution below 1


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, accurate on both sides of ``-log 2``."""
    x = x.clamp(max=0.0)
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def bernoulli_kl(behavior_logprobs: torch.Tensor, current_logprobs: torch.Tensor) -> torch.Tensor:
    """Elementwise ``KL(Bernoulli(p) || Bernoulli(q))`` from log-probs, computed in log space.

    Log-probs are capped at ``log(1 - 2^-23)``: a float32 log-prob of 0 means "1 within float32
    resolution", and without the cap a token the learner scores as exactly certain would give an
    infinite drift against any behavior probability below 1.
    """
    a = behavior_logprobs.double().clamp(max=_LOG_ONE_MINUS_EPS)
    b = current_logprobs.double().clamp(max=_LOG_ONE_MINUS_EPS)
    p = a.exp()
    first = p * (a - b)
    rest = (1.0 - p) * (_log1mexp(a) - _log1mexp(b))
    return (first + rest).clamp_min(0.0).to(behavior_logprobs.dtype)


@dataclass(frozen=True)
class AgreementReport:
    """How closely an engine's recorded log-probs match the learner's recomputation."""

    num_tokens: int
    """Sampled tokens compared."""
    mean_abs_diff: float
    """Mean |recorded - recomputed| log-prob over tokens."""
    max_abs_diff: float
    """Largest |recorded - recomputed| log-prob."""
    mean_drift: float
    """Mean over completions of the mean per-token Bernoulli-KL drift (``drift_i`` of docs/design.md §1)."""
    max_drift: float
    """Largest per-completion drift."""


@torch.no_grad()
def measure_agreement(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Completion],
    *,
    temperature: float = 1.0,
) -> AgreementReport:
    """Recompute each completion's token log-probs with ``model`` and compare with the recorded ones.

    ``temperature`` must be the sampling temperature; sampling with top-k / top-p truncation is not
    comparable (the learner scores the untruncated distribution).
    """
    from flashrl.models.logprobs import compute_token_logprobs

    if len(prompts) != len(completions):
        raise ValueError(f"got {len(prompts)} prompts but {len(completions)} completions.")
    diffs: list[torch.Tensor] = []
    drifts: list[float] = []
    device = next(model.parameters()).device
    for prompt, completion in zip(prompts, completions):
        if not completion.token_ids:
            continue
        ids = torch.tensor([list(prompt) + list(completion.token_ids)], device=device)  # [1, T]
        current, _ = compute_token_logprobs(
            model, ids, torch.ones_like(ids), temperature=temperature, with_entropy=False
        )
        current = current[0, len(prompt) :].double().cpu()  # [n]
        recorded = torch.tensor(completion.logprobs, dtype=torch.float64)  # [n]
        diffs.append((recorded - current).abs())
        drifts.append(float(bernoulli_kl(recorded, current).mean()))
    if not diffs:
        raise ValueError("no completion has tokens; nothing to compare.")
    all_diffs = torch.cat(diffs)
    return AgreementReport(
        num_tokens=int(all_diffs.numel()),
        mean_abs_diff=float(all_diffs.mean()),
        max_abs_diff=float(all_diffs.max()),
        mean_drift=sum(drifts) / len(drifts),
        max_drift=max(drifts),
    )
