"""FlashREINFORCE's part of a learner update: the loss hook the generic ``flashrl.learners.Learner`` calls.

The learner runs the forward and backward passes, micro-batch by micro-batch, on any number of
data-parallel ranks, and takes one optimizer step per batch. This module supplies what is
FlashREINFORCE's own (``docs/design.md`` §1):

- ``prepare``: once per update, on the WHOLE batch (every rank alike), the baseline's advantages
  ``A_i = R_i - mean_j R_j`` and the global normalisers (B for ``sample_mean`` and
  ``constant_length``, the valid-token count for ``token_mean``).
- ``compute_loss``: a micro-batch's share of the global loss, ``-(1/B) sum_{i in micro-batch} ...``,
  with those global values. The trust region and the failure-token entropy filter decide per whole
  trajectory, and a trajectory is never split over micro-batches, so the shares add up exactly to the
  loss of the whole batch, and their gradients to its gradient.

Metrics are returned as sums over global counts, maxima and minima (``flashrl.learners.LossMetrics``),
so the learner's combination over micro-batches and ranks gives the metrics of the whole batch:
``accepted_fraction``, ``num_rejected``, ``drift_mean``, ``drift_max``, ``ratio_mean``, ``ratio_min``,
``ratio_max`` (current/behavior ratios of the sampled tokens, whatever ``importance_sampling`` says: a
diagnostic of the policy lag), ``entropy_mean``, ``tokens_valid``, ``tokens_kept``, ``advantage_mean``,
``advantage_std``, ``reward_mean`` and the per-trajectory ``drift_values``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from flashrl.algorithms.flash_reinforce.components import (
    AGGREGATIONS,
    BASELINES,
    IMPORTANCE_SAMPLINGS,
    TRUST_REGIONS,
)
from flashrl.algorithms.flash_reinforce.loss import flash_reinforce_loss
from flashrl.learners.batch import TrainBatch
from flashrl.learners.loss import BatchContext, Loss, LossMetrics, MicroBatch

__all__ = ["FlashReinforceContext", "FlashReinforceLoss"]


@dataclass(frozen=True)
class FlashReinforceContext(BatchContext):
    """The batch-global quantities of one FlashREINFORCE update."""

    advantages: torch.Tensor | None = None
    """[B] the baseline's advantages over the whole batch."""
    failures: torch.Tensor | None = None
    """[B] bool failure labels (only with the entropy filter on)."""
    num_trajectories: int = 0
    """B of the 1/B normaliser (the whole batch, rejected trajectories included)."""
    num_tokens: int = 0
    """Valid (sampled) tokens of the whole batch: token_mean's normaliser."""


@dataclass
class FlashReinforceLoss(Loss):
    """The FlashREINFORCE loss settings (the config fields of the same names) and the learner hook."""

    delta: float = 0.01
    """Sequence Trust Region threshold: a trajectory is used iff its mean token drift <= delta (inf: all)."""
    baseline: str = "batch_mean"
    """Name in BASELINES: batch_mean (One-Batch REINFORCE), none, leave_one_out, group_mean, group_norm."""
    importance_sampling: str = "token"
    """Name in IMPORTANCE_SAMPLINGS: token (rho = q / p) or none (rho = 1, the reference's no_is)."""
    trust_region: str = "bernoulli_kl"
    """Name in TRUST_REGIONS: bernoulli_kl (clamped, as published), bernoulli_kl_exact, tv or none."""
    aggregation: str = "sample_mean"
    """Name in AGGREGATIONS: sample_mean (each trajectory weighs 1/B), token_mean or constant_length."""
    constant_length_normalizer: int | None = None
    """The L of aggregation="constant_length" (token sum / (B x L)), e.g. 6144."""
    negative_token_fraction: float = 1.0
    """q: a failed episode trains on its ceil(q * T_i) highest-entropy tokens; 1 = off (needs success labels)."""

    needs_entropy = True  # the entropy filter and the entropy_mean metric

    def __post_init__(self) -> None:
        _check(self.delta >= 0 and not math.isnan(self.delta), "delta", "a number >= 0 (inf = no trust region)",
               self.delta)
        _check(0.0 <= self.negative_token_fraction <= 1.0, "negative_token_fraction",
               "a number in [0, 1] (1 = no filter)", self.negative_token_fraction)
        _check(
            self.constant_length_normalizer is None or (
                isinstance(self.constant_length_normalizer, int) and self.constant_length_normalizer >= 1),
            "constant_length_normalizer", "None or an integer >= 1", self.constant_length_normalizer,
        )
        _check(
            self.aggregation != "constant_length" or self.constant_length_normalizer is not None,
            "constant_length_normalizer", 'an integer >= 1 with aggregation="constant_length" (e.g. 6144)',
            self.constant_length_normalizer,
        )
        for name, registry in (
            ("baseline", BASELINES), ("importance_sampling", IMPORTANCE_SAMPLINGS),
            ("trust_region", TRUST_REGIONS), ("aggregation", AGGREGATIONS),
        ):
            value = getattr(self, name)
            _check(value in registry, name, f"one of {registry.names()}", value)

    @classmethod
    def from_config(cls, config: Any) -> FlashReinforceLoss:
        """The loss of a ``FlashReinforceConfig``: its fields of the same names, the baseline resolved."""
        settings = {f.name: getattr(config, f.name) for f in fields(cls)}
        settings["baseline"] = config.effective_baseline
        return cls(**settings)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def filter_on(self) -> bool:
        return self.negative_token_fraction < 1.0

    # ------------------------------------------------------------------------------------------
    def prepare(self, batch: TrainBatch) -> FlashReinforceContext:
        rewards = batch.rewards.to(torch.float32)  # [B]
        advantages = BASELINES.build(self.baseline)(rewards, group_ids=batch.group_ids).detach()  # [B]
        return FlashReinforceContext(
            batch=batch,
            metrics={  # 0-d tensors: the learner reads them back with the update's other metrics
                "advantage_mean": advantages.mean(),
                "advantage_std": advantages.std(unbiased=False),
                "reward_mean": batch.rewards.mean(),
            },
            advantages=advantages,
            # [B] from the env's success labels; raises (on every rank alike) when the batch has none
            failures=batch.failures if self.filter_on else None,
            num_trajectories=batch.batch_size,
            num_tokens=batch.num_loss_tokens,
        )

    def compute_loss(
        self, micro_batch: MicroBatch, context: FlashReinforceContext
    ) -> tuple[torch.Tensor, LossMetrics]:
        rows = micro_batch.rows
        device = micro_batch.logprobs.device
        idx = micro_batch.indices.to(context.advantages.device)  # [b]  no copy when both are on one device
        out = flash_reinforce_loss(
            micro_batch.logprobs,
            rows.behavior_logprobs,
            rows.rewards,
            rows.loss_mask,
            delta=self.delta,
            entropy=micro_batch.entropy,
            failures=context.failures[idx].to(device) if self.filter_on else None,  # [b]
            negative_token_fraction=self.negative_token_fraction,
            importance_sampling=self.importance_sampling,
            trust_region=self.trust_region,
            aggregation=self.aggregation,
            advantages=context.advantages[idx].to(device),  # [b] slice of the WHOLE batch's advantages
            num_trajectories=context.num_trajectories,  # the global B of the 1/B normaliser
            num_tokens=context.num_tokens,  # the global valid-token count of token_mean
            constant_length_normalizer=self.constant_length_normalizer,
            # The learner checked the batch's rewards and behavior log-probs (TrainBatch.non_finite_reason)
            # and checks its recomputed log-probs and entropies on the device: no host sync here.
            check_values=False,
        )
        # The loss's means are shares of the global normalisers passed above, so they add up over
        # micro-batches and ranks. Its advantage and reward metrics are this micro-batch's own (not
        # shares): the whole batch's come from prepare.
        m = out.metric_tensors
        return out.loss, LossMetrics(
            sums={key: m[key] for key in _SUMMED},
            maxes={key: m[key] for key in ("drift_max", "ratio_max")},
            mins={"ratio_min": m["ratio_min"]},
            rows={"drift_values": out.drift.detach()},  # [b]
        )


_SUMMED = ("accepted_fraction", "num_rejected", "drift_mean", "ratio_mean", "entropy_mean", "tokens_valid",
           "tokens_kept")
"""The loss's metrics that add up over micro-batches (``flash_reinforce_loss``'s ``METRIC_NAMES``)."""


def _check(ok: bool, name: str, expected: str, actual: Any) -> None:
    if not ok:
        raise ValueError(f"FlashReinforceLoss.{name}: expected {expected}; got {actual!r}.")
