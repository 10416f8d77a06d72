"""The FlashREINFORCE reference loss (docs/design.md §1), as one pure function.

Per batch of B finished trajectories, one per prompt:

1. One-Batch REINFORCE:  A_i = R_i - mean_j R_j                         (pluggable baseline)
2. Token importance ratio:  rho_it = exp(log q_it - log p_it)           (p: behavior, q: current)
3. Sequence Trust Region:  drift_i = mean_t KL_Bern(p_it || q_it), p and q clamped to [1e-6, 1 - 1e-6];
   trust_i = drift_i <= delta                                            (delta = inf: no trust region)
4. Sample-Mean Optimization:
       loss = -(1/B) sum_i trust_i * A_i / T_i * sum_t keep_it * sg(rho_it) * log q_it
   whose gradient equals that of -objective, objective = (1/B) sum_i trust_i A_i / T_i sum_t keep_it rho_it.
5. Optional failure-token entropy filter: with negative_token_fraction = q < 1, a trajectory labelled a
   failure (explicit labels, not the sign of A_i) keeps (keep_it = 1) only its ceil(q * T_i) tokens of
   highest current-policy entropy, ties broken by position; T_i and B stay the original denominators.
   The filter is one token mask (``components.FailureTokenEntropyMask``); ``token_mask=`` plugs in another.

These are the semantics of the method's public reference loss (repository
``yifanzhang-pro/FlashREINFORCE``, ``flashreinforce/loss.py``), written anew. Where flashrl differs it
says so: a trajectory without valid tokens is rejected (the reference raises), and the components of
``components.py`` (baseline, importance sampling, trust region, aggregation, token mask) swap in the
ablations of the reference's experiment settings and the GRPO comparison, or a user's own (a name, a
``"module:name"`` path or an object; ``docs/extending.md``).

No clipping, no critic, no reference model. The caller takes exactly one optimizer step on ``.loss``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashrl.algorithms.flash_reinforce.components import (
    AGGREGATIONS,
    BASELINES,
    IMPORTANCE_SAMPLINGS,
    TOKEN_MASKS,
    TRUST_REGIONS,
    Aggregation,
    Baseline,
    ImportanceSampling,
    Normalizers,
    TokenMask,
    TrustRegion,
    failure_token_keep_mask,
)

__all__ = ["METRIC_NAMES", "FlashReinforceLossOutput", "failure_token_keep_mask", "flash_reinforce_loss"]

# A sampled token's log-probability must be <= 0. Engines and float rounding give tiny positive
# values (about 1e-7); those are clamped to 0. Anything larger means the caller passed something else
# (logits, probabilities, or log-probs of the wrong sign) and is an error.
_LOGPROB_POSITIVE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class FlashReinforceLossOutput:
    loss: torch.Tensor
    """Scalar to backpropagate (the detached-ratio practical surrogate)."""
    advantages: torch.Tensor
    """[B] the baseline's advantages (A_i = R_i - mean_j R_j by default), detached."""
    drift: torch.Tensor
    """[B] the trust region's mean per-token drift over valid tokens (0 for a trajectory with none)."""
    trust_mask: torch.Tensor
    """[B] bool: the trajectory contributes to the loss."""
    keep_mask: torch.Tensor
    """[B, T] bool: the tokens whose term is in the loss (trusted trajectory, kept by the filter)."""
    metric_tensors: dict[str, torch.Tensor]
    """The metrics as detached float64 0-d tensors on the inputs' device, computed without a host sync
    (``METRIC_NAMES`` says what each is; a learner combines them over micro-batches on the device)."""

    @property
    def metrics(self) -> dict[str, float]:
        """``metric_tensors`` as Python floats (one host transfer per access)."""
        names = list(self.metric_tensors)
        values = torch.stack([self.metric_tensors[k] for k in names]).tolist()  # the one transfer
        return dict(zip(names, values))


METRIC_NAMES = {
    "accepted_fraction": "share of the B trajectories (num_trajectories) inside the trust region",
    "num_rejected": "trajectories of this batch outside the trust region",
    "drift_mean": "sum of the trajectories' drift / num_trajectories",
    "drift_max": "largest trajectory drift of this batch",
    "ratio_mean": "sum of q/p over the sampled tokens / num_tokens (q/p whatever importance_sampling says: "
                  "a diagnostic of the policy lag)",
    "ratio_max": "largest q/p of a sampled token (-inf: this batch has none)",
    "ratio_min": "smallest q/p of a sampled token (inf: this batch has none)",
    "entropy_mean": "sum of the sampled tokens' entropies / num_tokens (only when entropy is given)",
    "advantage_mean": "mean advantage over this batch's rows",
    "advantage_std": "population standard deviation of this batch's advantages",
    "reward_mean": "mean reward over this batch's rows",
    "tokens_valid": "sampled (loss_mask) tokens of this batch",
    "tokens_kept": "tokens whose term is in the loss (trusted trajectory, kept by the entropy filter)",
}
"""What each entry of ``FlashReinforceLossOutput.metric_tensors`` is. The means are sums divided by
the global normalisers the loss itself uses (``num_trajectories``, ``num_tokens``): with those left at
their defaults they are this batch's plain means; a micro-batch's values are its shares of the whole
batch's means, which add up over micro-batches as the losses do."""


def _check_shapes(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    delta: float,
) -> None:
    """Shapes, dtypes and ``delta``: metadata only, no host sync (always checked)."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T]; got shape {tuple(logprobs.shape)}.")
    b = logprobs.shape[0]
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
    if not (isinstance(delta, (int, float)) and not isinstance(delta, bool) and delta >= 0
            and not math.isnan(delta)):
        raise ValueError(
            f"delta must be a number >= 0 (the drift threshold; math.inf = no trust region); got {delta!r}."
        )


def _check_values(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    entropy: torch.Tensor | None,
) -> None:
    """Finite rewards, finite log-probs <= 0 (and finite entropies) at valid tokens: host syncs."""
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
    if entropy is not None and not bool(torch.isfinite(entropy.detach()[loss_mask]).all()):
        raise ValueError("entropy must be finite at every valid (loss_mask) token.")


def _check_filter_inputs(
    fraction: float,
    entropy: torch.Tensor | None,
    failures: torch.Tensor | None,
    loss_mask: torch.Tensor,
) -> bool:
    """Validate the entropy filter's inputs; True when the filter is on (fraction < 1)."""
    if not (isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0.0 <= fraction <= 1.0):
        raise ValueError(f"negative_token_fraction must be a number in [0, 1] (1 = off); got {fraction!r}.")
    if fraction == 1.0:
        return False
    b = loss_mask.shape[0]
    if entropy is None or failures is None:
        missing = [name for name, v in (("entropy", entropy), ("failures", failures)) if v is None]
        raise ValueError(
            f"negative_token_fraction={fraction} filters failed trajectories but {' and '.join(missing)} "
            "is None; pass the [B, T] token entropies and the [B] bool failure labels (the env's success "
            "signal, not the sign of the advantage), or set negative_token_fraction=1.0."
        )
    if entropy.shape != loss_mask.shape:
        raise ValueError(f"entropy must have shape {tuple(loss_mask.shape)}; got {tuple(entropy.shape)}.")
    if failures.shape != (b,) or failures.dtype != torch.bool:
        raise ValueError(
            f"failures must be a bool tensor of shape [{b}]; got {failures.dtype} of shape "
            f"{tuple(failures.shape)}. Use e.g. ~success.bool()."
        )
    if not entropy.is_floating_point():
        raise ValueError(f"entropy must be a floating tensor; got {entropy.dtype}.")
    return True


def flash_reinforce_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    delta: float,
    entropy: torch.Tensor | None = None,
    failures: torch.Tensor | None = None,
    negative_token_fraction: float = 1.0,
    baseline: str | Baseline | None = None,
    importance_sampling: str | ImportanceSampling | None = None,
    trust_region: str | TrustRegion | None = None,
    aggregation: str | Aggregation | None = None,
    token_mask: str | TokenMask | None = None,
    group_ids: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    num_trajectories: int | None = None,
    num_tokens: int | None = None,
    constant_length_normalizer: int | None = None,
    check_values: bool = True,
) -> FlashReinforceLossOutput:
    """FlashREINFORCE loss for one batch (see the module docstring for the math).

    Args:
        logprobs: [B, T] current-policy log-probs of the sampled tokens (differentiable).
        behavior_logprobs: [B, T] log-probs recorded by the inference engine at sampling time.
        rewards: [B] scalar returns.
        loss_mask: [B, T] bool, True at tokens the policy sampled.
        delta: Sequence Trust Region threshold on the mean per-token drift; ``math.inf`` turns it off.
        entropy: [B, T] current-policy token entropies (the entropy filter only).
        failures: [B] bool, True for a failed trajectory (the entropy filter only).
        negative_token_fraction: q in [0, 1]; below 1 a failed trajectory keeps its ceil(q * T_i)
            highest-entropy tokens (the reference's ``negative_token_fraction``); 1 = off.
        baseline: name in ``BASELINES`` or a callable (rewards -> advantages); default ``"batch_mean"``.
        importance_sampling: name in ``IMPORTANCE_SAMPLINGS``: ``"token"`` (default) or ``"none"``
            (ratio 1, the reference's ``no_is``; the trust region then sees no drift).
        trust_region: name in ``TRUST_REGIONS`` or a callable; default ``"bernoulli_kl"``.
        aggregation: name in ``AGGREGATIONS`` or a callable; default ``"sample_mean"``.
        token_mask: name in ``TOKEN_MASKS``, a ``"module:name"`` path or a callable (``loss_mask``,
            ``entropy=``, ``failures=`` -> the bool [B, T] tokens that keep their term); default: the
            failure-token entropy filter when ``negative_token_fraction`` < 1, else every valid token.
            Give one or the other: a mask with ``negative_token_fraction`` < 1 is an error.
        group_ids: [B] prompt ids for the group baselines (``group_mean``, ``group_norm``).
        advantages: [B] precomputed advantages (data-parallel shards compute them on the global batch);
            when given, ``rewards`` and ``baseline`` are only used for metrics.
        num_trajectories: the B of the 1/B normaliser (the global batch size under data parallelism);
            default: this batch's B.
        num_tokens: the valid-token count of ``token_mean`` (global under data parallelism); default:
            this batch's.
        constant_length_normalizer: the L of ``constant_length`` (sum / (B x L)).
        check_values: raise ``ValueError`` for non-finite rewards, log-probs or entropies at valid
            tokens, and for log-probs > 0. These checks read values back to the host, so a caller that
            guarantees them passes False: ``flashrl.learners.Learner`` does, having checked the batch's
            rewards and behavior log-probs once (``TrainBatch.non_finite_reason``, a skip) and checking
            its own recomputed log-probs and entropies on the device (a skip too). Shapes, dtypes and
            ``delta`` are checked either way (metadata, no host sync). With False, a non-finite input
            gives a non-finite loss, never an error.

    Inputs in float32 or bfloat16 are computed in float32; float64 stays float64.
    """
    _check_shapes(logprobs, behavior_logprobs, rewards, loss_mask, delta)
    filter_on = _check_filter_inputs(negative_token_fraction, entropy, failures, loss_mask)
    if filter_on and token_mask is not None:
        raise ValueError(
            f"token_mask={token_mask!r} and negative_token_fraction={negative_token_fraction} both choose the "
            "kept tokens; give one: the filter is the mask FailureTokenEntropyMask(fraction)."
        )
    if check_values:
        _check_values(logprobs, behavior_logprobs, rewards, loss_mask, entropy)
    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    b = logprobs.shape[0]
    num_trajectories = b if num_trajectories is None else num_trajectories
    if num_trajectories < b:
        raise ValueError(f"num_trajectories (the global B) must be >= this batch's B = {b}; got {num_trajectories}.")
    num_tokens = int(loss_mask.sum()) if num_tokens is None else num_tokens

    zeros = torch.zeros((), dtype=dtype, device=logprobs.device)
    logq = torch.where(loss_mask, logprobs.to(dtype), zeros)  # [B, T]  differentiable
    logq_now = logq.detach().clamp(max=0.0)  # [B, T]
    logp = torch.where(loss_mask, behavior_logprobs.to(dtype), zeros).clamp(max=0.0).detach()  # [B, T]
    rewards = rewards.to(dtype).detach()  # [B]

    # 1. One-Batch REINFORCE advantages (computed outside the gradient path).
    if advantages is None:
        advantages = BASELINES.resolve(baseline, "batch_mean")(rewards, group_ids=group_ids).detach()  # [B]
    else:
        if advantages.shape != (b,):
            raise ValueError(f"advantages must have shape [{b}]; got {tuple(advantages.shape)}.")
        advantages = advantages.to(dtype).detach()

    # 2. Token importance ratios, detached: the gradient flows through log q only. The denominator is
    #    the behavior policy, or the current policy itself without behavior correction.
    compared_with = IMPORTANCE_SAMPLINGS.resolve(importance_sampling, "token")(logq_now, logp)  # [B, T]
    denominator = torch.where(loss_mask, compared_with.detach(), zeros)  # [B, T]
    ratio = torch.exp(logq_now - denominator)  # [B, T]
    # The ratio metrics are always q/p (the policy lag): the loss's own ratio when it compares with p.
    lag_ratio = ratio if compared_with is logp else torch.exp(logq_now - logp)  # [B, T]

    # 3. Sequence Trust Region: one decision per whole trajectory.
    decision = TRUST_REGIONS.resolve(trust_region, "bernoulli_kl")(logq_now, denominator, loss_mask, delta=delta)
    trust = decision.trust_mask  # [B] bool

    # 5. Optional failure-token entropy filter (T_i below stays the full valid count).
    keep = loss_mask  # [B, T]
    if filter_on:
        keep = failure_token_keep_mask(entropy.detach().to(dtype), loss_mask, failures, negative_token_fraction)
    elif token_mask is not None:
        mask = TOKEN_MASKS.resolve(token_mask, "all")
        chosen = mask(loss_mask, entropy=None if entropy is None else entropy.detach().to(dtype), failures=failures)
        if chosen.shape != loss_mask.shape or chosen.dtype != torch.bool:
            raise ValueError(f"token_mask must return a bool tensor of shape {tuple(loss_mask.shape)}; got "
                             f"{chosen.dtype} of shape {tuple(chosen.shape)}.")
        keep = chosen & loss_mask  # [B, T]  never a token the policy did not sample
    contributes = keep & trust.unsqueeze(-1)  # [B, T]

    # 4. Sample-Mean Optimization of the detached-ratio surrogate.
    weights = torch.where(contributes, advantages.unsqueeze(-1) * ratio, zeros)  # [B, T]
    token_terms = weights * logq  # [B, T]
    valid_counts = loss_mask.sum(-1)  # [B]  T_i
    norm = Normalizers(num_trajectories=num_trajectories, num_tokens=num_tokens,
                       constant_length=constant_length_normalizer)
    objective = AGGREGATIONS.resolve(aggregation, "sample_mean")(token_terms, valid_counts, norm)
    loss = -objective

    metrics = _metrics(lag_ratio, loss_mask, contributes, decision.drift, trust, advantages, rewards, entropy,
                       norm)
    return FlashReinforceLossOutput(
        loss=loss,
        advantages=advantages,
        drift=decision.drift,
        trust_mask=trust,
        keep_mask=contributes,
        metric_tensors=metrics,
    )


def _metrics(
    ratio: torch.Tensor,
    loss_mask: torch.Tensor,
    contributes: torch.Tensor,
    drift: torch.Tensor,
    trust: torch.Tensor,
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    entropy: torch.Tensor | None,
    norm: Normalizers,
) -> dict[str, torch.Tensor]:
    """``METRIC_NAMES`` as float64 0-d tensors: masked reductions only, no boolean indexing, no sync."""
    with torch.no_grad():
        f64 = torch.float64
        b, n = norm.num_trajectories, max(norm.num_tokens, 1)
        ratio = ratio.detach().to(f64)  # [B, T]
        drift = drift.detach().to(f64)  # [B]
        zero = torch.zeros((), dtype=f64, device=ratio.device)
        metrics = {
            "accepted_fraction": trust.sum().to(f64) / b,
            "num_rejected": (~trust).sum().to(f64),
            "drift_mean": drift.sum() / b,
            "drift_max": drift.max(),
            "ratio_mean": torch.where(loss_mask, ratio, zero).sum() / n,
            "ratio_max": _masked_extreme(ratio, loss_mask, torch.amax, -math.inf),
            "ratio_min": _masked_extreme(ratio, loss_mask, torch.amin, math.inf),
        }
        if entropy is not None:
            metrics["entropy_mean"] = torch.where(loss_mask, entropy.detach().to(f64), zero).sum() / n
        advantages = advantages.to(f64)  # [B]
        metrics.update(
            advantage_mean=advantages.mean(),
            advantage_std=advantages.std(unbiased=False),
            reward_mean=rewards.to(f64).mean(),
            tokens_valid=loss_mask.sum().to(f64),
            tokens_kept=contributes.sum().to(f64),
        )
        return metrics


def _masked_extreme(values: torch.Tensor, mask: torch.Tensor, reduce, identity: float) -> torch.Tensor:
    """``reduce`` (amax or amin) of ``values`` where ``mask``; ``identity`` (+-inf) where it has none."""
    if values.numel() == 0:  # T = 0: the reductions refuse empty inputs (shape metadata, no sync)
        return torch.tensor(identity, dtype=values.dtype, device=values.device)
    return reduce(values.masked_fill(~mask, identity))
