"""The FlashREINFORCE reference loss (DESIGN §1), as one pure function.

Per batch of B finished trajectories, one per prompt:

1. One-Batch REINFORCE:  A_i = R_i - mean_j R_j                         (pluggable baseline)
2. Token importance ratio:  rho_it = exp(log q_it - log p_it)           (p: behavior, q: current)
3. Sequence Trust Region:  drift_i = mean_t KL_Bern(p_it || q_it);  trust_i = drift_i <= delta
4. Sample-Mean Optimization:
       loss = -(1/B) sum_i trust_i * A_i / T_i * sum_t sg(rho_it) * log q_it
   whose gradient equals that of -objective, objective = (1/B) sum_i trust_i A_i / T_i sum_t rho_it.
5. Optional failure-token entropy filter: for A_i < 0 keep only tokens whose entropy is at least the
   f-quantile of the trajectory's token entropies; T_i stays the trajectory's valid-token count.

No clipping, no critic, no reference model. The caller takes exactly one optimizer step on ``.loss``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashrl.algorithms.flash_reinforce.components import (
    AGGREGATIONS,
    BASELINES,
    TRUST_REGIONS,
    Aggregation,
    Baseline,
    TrustRegion,
)

__all__ = ["FlashReinforceLossOutput", "flash_reinforce_loss", "failure_entropy_keep_mask"]

# A sampled token's log-probability must be <= 0. Engines and float rounding give tiny positive
# values (about 1e-7); those are clamped to 0. Anything larger means the caller passed something else
# (logits, probabilities, or log-probs of the wrong sign) and is an error.
_LOGPROB_POSITIVE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class FlashReinforceLossOutput:
    loss: torch.Tensor
    """Scalar to backpropagate (the detached-ratio practical surrogate)."""
    advantages: torch.Tensor
    """[B] A_i = R_i - baseline_i (float32, detached)."""
    drift: torch.Tensor
    """[B] mean per-token Bernoulli-KL drift over valid tokens (0 for a trajectory with none)."""
    trust_mask: torch.Tensor
    """[B] bool: the trajectory contributes to the loss."""
    metrics: dict[str, float]
    """accepted_fraction, drift_mean/max, ratio_mean/max, advantage_mean/std, tokens_valid/kept, ..."""


def failure_entropy_keep_mask(
    entropy: torch.Tensor,
    loss_mask: torch.Tensor,
    advantages: torch.Tensor,
    quantile: float,
) -> torch.Tensor:
    """Which valid tokens keep their loss term under the failure-token entropy filter.

    For trajectories with ``A_i < 0`` a token is kept iff its entropy is >= the ``quantile`` of that
    trajectory's valid-token entropies (torch.quantile, linear interpolation). Other trajectories keep
    every valid token. Returns a bool [B, T] mask (a subset of ``loss_mask``).
    """
    keep = loss_mask.clone()  # [B, T]
    for i in torch.nonzero(advantages < 0).flatten().tolist():
        valid = loss_mask[i]
        if not bool(valid.any()):
            continue
        threshold = torch.quantile(entropy[i][valid], quantile)
        keep[i] = valid & (entropy[i] >= threshold)
    return keep


def _check_inputs(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    delta: float,
    entropy: torch.Tensor | None,
    failure_entropy_quantile: float | None,
) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T]; got shape {tuple(logprobs.shape)}.")
    b, t = logprobs.shape
    if b == 0:
        raise ValueError("Empty batch: logprobs has B = 0 trajectories; a batch needs at least one.")
    for name, tensor in (("behavior_logprobs", behavior_logprobs), ("loss_mask", loss_mask)):
        if tensor.shape != logprobs.shape:
            raise ValueError(
                f"{name} must have the shape of logprobs {tuple(logprobs.shape)}; got {tuple(tensor.shape)}."
            )
    if rewards.shape != (b,):
        raise ValueError(f"rewards must have shape [B] = [{b}]; got {tuple(rewards.shape)}.")
    if loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be a bool tensor; got {loss_mask.dtype}. Use mask.bool().")
    if not (isinstance(delta, (int, float)) and delta >= 0 and not math.isnan(delta)):
        raise ValueError(f"delta must be a number >= 0 (the drift threshold); got {delta!r}.")
    if not bool(torch.isfinite(rewards).all()):
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
        raise ValueError(f"rewards must be finite; trajectories {bad} have {rewards[bad].tolist()}.")
    for name, tensor in (("logprobs", logprobs), ("behavior_logprobs", behavior_logprobs)):
        valid_values = tensor.detach()[loss_mask]
        if not bool(torch.isfinite(valid_values).all()):
            rows = torch.nonzero(loss_mask & ~torch.isfinite(tensor.detach()))[:, 0].unique().tolist()
            raise ValueError(
                f"{name} must be finite at every valid (loss_mask) token; trajectories {rows} contain "
                "NaN or inf. Skip such trajectories before building the batch."
            )
        if valid_values.numel() and float(valid_values.max()) > _LOGPROB_POSITIVE_TOLERANCE:
            raise ValueError(
                f"{name} are log-probabilities and must be <= 0; got a maximum of "
                f"{float(valid_values.max()):.4g}. Did you pass logits or probabilities?"
            )
    if failure_entropy_quantile is not None:
        if not 0.0 <= failure_entropy_quantile <= 1.0:
            raise ValueError(f"failure_entropy_quantile must be in [0, 1]; got {failure_entropy_quantile}.")
        if entropy is None:
            raise ValueError("failure_entropy_quantile is set but entropy is None; pass the [B, T] token entropies.")
    if entropy is not None and entropy.shape != logprobs.shape:
        raise ValueError(f"entropy must have shape {tuple(logprobs.shape)}; got {tuple(entropy.shape)}.")


def flash_reinforce_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    delta: float,
    entropy: torch.Tensor | None = None,
    failure_entropy_quantile: float | None = None,
    baseline: str | Baseline | None = None,
    trust_region: str | TrustRegion | None = None,
    aggregation: str | Aggregation | None = None,
    group_ids: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    num_trajectories: int | None = None,
) -> FlashReinforceLossOutput:
    """FlashREINFORCE loss for one batch (see the module docstring for the math).

    Args:
        logprobs: [B, T] current-policy log-probs of the sampled tokens (differentiable).
        behavior_logprobs: [B, T] log-probs recorded by the inference engine at sampling time.
        rewards: [B] scalar returns.
        loss_mask: [B, T] bool, True at tokens the policy sampled.
        delta: Sequence Trust Region threshold on the mean per-token Bernoulli KL.
        entropy: [B, T] current-policy token entropies (needed by the entropy filter only).
        failure_entropy_quantile: f in [0, 1] enables the failure-token entropy filter.
        baseline: name in ``BASELINES`` or a callable; default ``"batch_mean"``.
        trust_region: name in ``TRUST_REGIONS`` or a callable; default ``"bernoulli_kl"``.
        aggregation: name in ``AGGREGATIONS`` or a callable; default ``"sample_mean"``.
        group_ids: [B] prompt ids for ``baseline="group_mean"``.
        advantages: [B] precomputed advantages (data-parallel shards compute them on the global batch);
            when given, ``rewards`` and ``baseline`` are only used for metrics.
        num_trajectories: the B of the 1/B normaliser (the global batch size under data parallelism);
            default: this batch's B.

    Inputs in float32 or bfloat16 are computed in float32; float64 stays float64.
    """
    _check_inputs(logprobs, behavior_logprobs, rewards, loss_mask, delta, entropy, failure_entropy_quantile)
    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    b = logprobs.shape[0]
    num_trajectories = b if num_trajectories is None else num_trajectories
    if num_trajectories < b:
        raise ValueError(f"num_trajectories (the global B) must be >= this batch's B = {b}; got {num_trajectories}.")

    zeros = torch.zeros((), dtype=dtype, device=logprobs.device)
    logq = torch.where(loss_mask, logprobs.to(dtype), zeros)  # [B, T]  differentiable
    logq_now = logq.detach().clamp(max=0.0)  # [B, T]
    logp = torch.where(loss_mask, behavior_logprobs.to(dtype), zeros).clamp(max=0.0).detach()  # [B, T]
    rewards = rewards.to(dtype).detach()  # [B]

    # 1. One-Batch REINFORCE advantages (computed outside the gradient path).
    if advantages is None:
        base = BASELINES.resolve(baseline, "batch_mean")(rewards, group_ids=group_ids)  # [B]
        advantages = (rewards - base).detach()  # [B]
    else:
        if advantages.shape != (b,):
            raise ValueError(f"advantages must have shape [{b}]; got {tuple(advantages.shape)}.")
        advantages = advantages.to(dtype).detach()

    # 2. Token importance ratios, detached: the gradient flows through log q only.
    ratio = torch.exp(logq_now - logp)  # [B, T]

    # 3. Sequence Trust Region: one decision per whole trajectory.
    decision = TRUST_REGIONS.resolve(trust_region, "bernoulli_kl")(logq_now, logp, loss_mask, delta=delta)
    trust = decision.trust_mask  # [B] bool

    # 5. Optional failure-token entropy filter (T_i below stays the full valid count).
    keep = loss_mask  # [B, T]
    if failure_entropy_quantile is not None:
        keep = failure_entropy_keep_mask(entropy.detach().to(dtype), loss_mask, advantages, failure_entropy_quantile)
    contributes = keep & trust.unsqueeze(-1)  # [B, T]

    # 4. Sample-Mean Optimization of the detached-ratio surrogate.
    weights = torch.where(contributes, advantages.unsqueeze(-1) * ratio, zeros)  # [B, T]
    token_terms = weights * logq  # [B, T]
    valid_counts = loss_mask.sum(-1)  # [B]  T_i
    objective = AGGREGATIONS.resolve(aggregation, "sample_mean")(
        token_terms, valid_counts, num_trajectories=num_trajectories
    )
    loss = -objective

    metrics = _metrics(ratio, loss_mask, contributes, decision.drift, trust, advantages, rewards)
    return FlashReinforceLossOutput(
        loss=loss,
        advantages=advantages,
        drift=decision.drift,
        trust_mask=trust,
        metrics=metrics,
    )


def _metrics(ratio, loss_mask, contributes, drift, trust, advantages, rewards) -> dict[str, float]:
    with torch.no_grad():
        valid_ratio = ratio[loss_mask]
        has_tokens = valid_ratio.numel() > 0
        return {
            "accepted_fraction": float(trust.float().mean()),
            "num_rejected": float((~trust).sum()),
            "drift_mean": float(drift.mean()),
            "drift_max": float(drift.max()),
            "ratio_mean": float(valid_ratio.mean()) if has_tokens else 1.0,
            "ratio_max": float(valid_ratio.max()) if has_tokens else 1.0,
            "ratio_min": float(valid_ratio.min()) if has_tokens else 1.0,
            "advantage_mean": float(advantages.mean()),
            "advantage_std": float(advantages.std(unbiased=False)),
            "reward_mean": float(rewards.mean()),
            "tokens_valid": float(loss_mask.sum()),
            "tokens_kept": float(contributes.sum()),
        }
