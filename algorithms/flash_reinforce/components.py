"""Pluggable pieces of the FlashREINFORCE loss: baselines, trust regions, aggregations.

Each piece is a small callable object, registered under a name. The loss takes either a name or an
object, so an ablation is a config string and a new idea is a few lines::

    class MedianBaseline:
        def __call__(self, rewards, *, group_ids=None):
            return rewards.median().expand_as(rewards)

    flash_reinforce_loss(..., baseline=MedianBaseline())
    BASELINES.register("median")(MedianBaseline)   # now also reachable as baseline="median"
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> factory of a component kind; unknown names list the known ones."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[[], T]] = {}

    def register(self, name: str) -> Callable[[Callable[[], T]], Callable[[], T]]:
        def decorator(factory: Callable[[], T]) -> Callable[[], T]:
            if name in self._factories:
                raise ValueError(f"A {self.kind} named {name!r} is already registered.")
            self._factories[name] = factory
            return factory

        return decorator

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def build(self, name: str) -> T:
        if name not in self._factories:
            raise ValueError(
                f"Unknown {self.kind} {name!r}; expected one of {self.names()}. Register your own with "
                f"@{self.kind.upper()}S.register('name') or pass an object instead of a name."
            )
        return self._factories[name]()

    def resolve(self, value: str | T | None, default: str) -> T:
        """A name, an object (used as is) or None (the default)."""
        if value is None:
            return self.build(default)
        if isinstance(value, str):
            return self.build(value)
        if not callable(value):
            raise TypeError(f"A {self.kind} must be a registered name or a callable; got {type(value)!r}.")
        return value


# --------------------------------------------------------------------------------------------------
# Baselines: A_i = R_i - b_i.


class Baseline(Protocol):
    def __call__(self, rewards: torch.Tensor, *, group_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Return the baseline ``b`` [B] for rewards [B]."""


BASELINES: Registry[Baseline] = Registry("baseline")


@BASELINES.register("batch_mean")
class BatchMeanBaseline:
    """One-Batch REINFORCE: the mean reward of the batch (B independent prompts)."""

    def __call__(self, rewards: torch.Tensor, *, group_ids: torch.Tensor | None = None) -> torch.Tensor:
        return rewards.mean().expand_as(rewards)  # [B]


@BASELINES.register("none")
class NoBaseline:
    """Plain REINFORCE: advantages are the raw rewards (ablation)."""

    def __call__(self, rewards: torch.Tensor, *, group_ids: torch.Tensor | None = None) -> torch.Tensor:
        return torch.zeros_like(rewards)


@BASELINES.register("leave_one_out")
class LeaveOneOutBaseline:
    """Mean reward of the *other* B - 1 trajectories (RLOO over the batch); 0 when B = 1."""

    def __call__(self, rewards: torch.Tensor, *, group_ids: torch.Tensor | None = None) -> torch.Tensor:
        b = rewards.shape[0]
        if b == 1:
            return torch.zeros_like(rewards)
        return (rewards.sum() - rewards) / (b - 1)  # [B]


@BASELINES.register("group_mean")
class GroupMeanBaseline:
    """GRPO-style: mean reward of the rollouts that share a prompt (needs ``group_ids``).

    Only for the synchronous comparison baseline: FlashREINFORCE itself has one rollout per prompt.
    """

    def __call__(self, rewards: torch.Tensor, *, group_ids: torch.Tensor | None = None) -> torch.Tensor:
        if group_ids is None:
            raise ValueError(
                "baseline='group_mean' needs group_ids [B] (which prompt each rollout answers); got None. "
                "Use the sync_group mode, or baseline='batch_mean' for one rollout per prompt."
            )
        if group_ids.shape != rewards.shape:
            raise ValueError(f"group_ids must have shape {tuple(rewards.shape)}; got {tuple(group_ids.shape)}.")
        _, inverse = torch.unique(group_ids, return_inverse=True)  # [B]
        num_groups = int(inverse.max()) + 1
        sums = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, rewards)
        counts = torch.bincount(inverse, minlength=num_groups).to(rewards.dtype)
        return (sums / counts)[inverse]  # [B]


# --------------------------------------------------------------------------------------------------
# Trust regions: one accept/reject decision per whole trajectory.


@dataclass(frozen=True)
class TrustDecision:
    drift: torch.Tensor
    """[B] mean per-token drift over the trajectory's valid tokens (0 where it has none)."""
    trust_mask: torch.Tensor
    """[B] bool: True when the trajectory may contribute to the loss."""


class TrustRegion(Protocol):
    def __call__(
        self,
        logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        loss_mask: torch.Tensor,
        *,
        delta: float,
    ) -> TrustDecision:
        """Decide per trajectory from current and behavior log-probs [B, T] and the mask [B, T]."""


TRUST_REGIONS: Registry[TrustRegion] = Registry("trust_region")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, accurate at both ends (Maechler, 2012)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def bernoulli_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Bernoulli KL ``p log(p/q) + (1-p) log((1-p)/(1-q))`` from log-probabilities, elementwise.

    Works in log space so that it stays finite and accurate when p or q is close to 1. Log-probs are
    capped at ``-eps/2`` of their dtype (float32: -6e-8): a log-softmax in that precision returns
    exactly 0 for any probability above 1 - 6e-8, so ``1 - p`` is only known to be below that bound and
    the cap keeps ``log(1 - p)`` finite at the dtype's own resolution instead of at an arbitrary
    tiny number (which would inflate the drift of a confident token).
    """
    ceiling = -torch.finfo(logp.dtype).eps / 2
    logp = logp.clamp(max=ceiling)
    logq = logq.clamp(max=ceiling)
    p = torch.exp(logp)
    one_minus_p = -torch.expm1(logp)
    return p * (logp - logq) + one_minus_p * (log1mexp(logp) - log1mexp(logq))


@TRUST_REGIONS.register("bernoulli_kl")
class BernoulliKLSequenceTrustRegion:
    """Sequence Trust Region: accept iff the mean per-token Bernoulli KL of sampled tokens <= delta.

    A trajectory with no valid token is rejected (there is nothing to measure or learn from).
    """

    def __call__(self, logprobs, behavior_logprobs, loss_mask, *, delta: float) -> TrustDecision:
        with torch.no_grad():
            d = bernoulli_kl(behavior_logprobs, logprobs)  # [B, T]  (p = behavior, q = current)
            d = torch.where(loss_mask, d, torch.zeros_like(d)).clamp(min=0.0)  # KL >= 0; drop rounding
            counts = loss_mask.sum(-1)  # [B]
            drift = d.sum(-1) / counts.clamp(min=1)  # [B]
            trust = (drift <= delta) & (counts > 0)  # [B]
        return TrustDecision(drift=drift, trust_mask=trust)


@TRUST_REGIONS.register("none")
class NoTrustRegion:
    """Ablation: every trajectory with at least one valid token is accepted; drift is still reported."""

    def __call__(self, logprobs, behavior_logprobs, loss_mask, *, delta: float) -> TrustDecision:
        decision = BernoulliKLSequenceTrustRegion()(logprobs, behavior_logprobs, loss_mask, delta=math.inf)
        return TrustDecision(drift=decision.drift, trust_mask=loss_mask.any(-1))


# --------------------------------------------------------------------------------------------------
# Aggregations: how per-token terms become one scalar objective.


class Aggregation(Protocol):
    def __call__(
        self,
        token_terms: torch.Tensor,
        valid_counts: torch.Tensor,
        *,
        num_trajectories: int,
    ) -> torch.Tensor:
        """Reduce ``token_terms`` [B, T] (already zero where a token does not contribute) to a scalar.

        ``valid_counts`` [B] is each trajectory's number of valid tokens ``T_i``; ``num_trajectories``
        is the B of the normaliser (the whole batch, rejected trajectories included).
        """


AGGREGATIONS: Registry[Aggregation] = Registry("aggregation")


@AGGREGATIONS.register("sample_mean")
class SampleMean:
    """Sample-Mean Optimization: mean over each trajectory's T_i tokens, then mean over B."""

    def __call__(self, token_terms, valid_counts, *, num_trajectories: int) -> torch.Tensor:
        per_traj = token_terms.sum(-1) / valid_counts.clamp(min=1).to(token_terms.dtype)  # [B]
        return per_traj.sum() / num_trajectories


@AGGREGATIONS.register("token_mean")
class TokenMean:
    """Ablation: one mean over all valid tokens of the batch (long trajectories weigh more).

    The normaliser counts the valid tokens of every trajectory, rejected ones included, mirroring
    ``sample_mean``'s B. With data parallelism pass the global count as ``num_tokens``.
    """

    def __init__(self, num_tokens: int | None = None) -> None:
        self.num_tokens = num_tokens

    def __call__(self, token_terms, valid_counts, *, num_trajectories: int) -> torch.Tensor:
        total = self.num_tokens if self.num_tokens is not None else int(valid_counts.sum())
        return token_terms.sum() / max(total, 1)
