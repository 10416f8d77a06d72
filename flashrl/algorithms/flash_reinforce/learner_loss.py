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

The components (baseline, importance sampling, trust region, aggregation, token mask) may be names,
``"module:name"`` paths or objects; the loss travels to the learner actors with each component's factory
pickled by value (``flashrl.user_code``), so a user's component works where its module does not import,
and each process builds its components once.

Metrics are returned as sums over global counts, maxima and minima (``flashrl.learners.LossMetrics``),
so the learner's combination over micro-batches and ranks gives the metrics of the whole batch:
``accepted_fraction``, ``num_rejected``, ``drift_mean``, ``drift_max``, ``ratio_mean``, ``ratio_min``,
``ratio_max`` (current/behavior ratios of the sampled tokens, whatever ``importance_sampling`` says: a
diagnostic of the policy lag), ``entropy_mean``, ``tokens_valid``, ``tokens_kept``, ``advantage_mean``,
``advantage_std``, ``reward_mean`` and the per-trajectory ``drift_values`` and ``accepted_values``
(1.0 inside the trust region, 0.0 rejected), in the batch's order.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Any

import torch

from flashrl.algorithms.flash_reinforce.components import (
    AGGREGATIONS,
    BASELINES,
    IMPORTANCE_SAMPLINGS,
    TOKEN_MASKS,
    TRUST_REGIONS,
    Registry,
)
from flashrl.algorithms.flash_reinforce.loss import flash_reinforce_loss
from flashrl.learners.batch import TrainBatch
from flashrl.learners.loss import BatchContext, Loss, LossMetrics, MicroBatch
from flashrl.user_code import Shipped, describe
from flashrl.validation import Checks, is_number, setting

COMPONENTS: dict[str, tuple[Registry, str | None]] = {
    "baseline": (BASELINES, "batch_mean"),
    "importance_sampling": (IMPORTANCE_SAMPLINGS, "token"),
    "trust_region": (TRUST_REGIONS, "bernoulli_kl"),
    "aggregation": (AGGREGATIONS, "sample_mean"),
    "token_mask": (TOKEN_MASKS, None),
}
"""The loss's pluggable settings: each a registered name, a ``"module:name"`` path or an object
(``components.py``), with the default a None stands for (token_mask None: the failure filter of
negative_token_fraction, or every token)."""

__all__ = ["FlashReinforceContext", "FlashReinforceLossSpec"]


@dataclass(frozen=True)
class FlashReinforceContext(BatchContext):
    """The batch-global quantities of one FlashREINFORCE update."""

    advantages: torch.Tensor | None = None
    """[B] the baseline's advantages over the whole batch."""
    failures: torch.Tensor | None = None
    """[B] bool failure labels (None when the batch has none; the entropy filter then raises in prepare)."""
    num_trajectories: int = 0
    """B of the 1/B normaliser (the whole batch, rejected trajectories included)."""
    num_tokens: int = 0
    """Valid (sampled) tokens of the whole batch: token_mean's normaliser."""


@dataclass
class FlashReinforceLossSpec(Loss):
    """The FlashREINFORCE loss settings (each declared and checked only here) and the learner hook.

    A ``Spec`` like the config's other parts (``EnvRunnerSpec``, ``LearnerSpec``,
    ``FlashReinforceAlgorithmSpec``): one part's typed settings, checked when built. It is also the
    ``flashrl.learners.Loss`` the learner calls, so the settings travel with the code that reads them.
    """

    delta: float = setting(0.01, ge=0, finite=False, note="math.inf = no trust region",
                           fix="e.g. 3e-3, or math.inf")
    """Sequence trust region: a trajectory whose mean token drift exceeds it is dropped; inf = no trust region."""
    baseline: str | Any | None = setting(None, code="path")
    """Advantage baseline: batch_mean, none, leave_one_out, group_mean, group_norm (GRPO), a 'module:name' path
    or a Baseline object; None = batch_mean, or group_mean with rollout_mode='sync_group' (the config resolves it)."""
    importance_sampling: str | Any = setting("token", code="path")
    """'token' (rho = q / p, the behavior correction), 'none' (rho = 1: the reference's no_is), a path or an object."""
    trust_region: str | Any = setting("bernoulli_kl", code="path")
    """'bernoulli_kl' (p, q clamped to [1e-6, 1 - 1e-6], as published), 'bernoulli_kl_exact', 'tv', 'none', a path
    or an object."""
    aggregation: str | Any = setting("sample_mean", code="path")
    """'sample_mean' (every trajectory weighs 1/B), 'token_mean', 'constant_length' (sum / (B x L)), a path or an
    object."""
    token_mask: str | Any | None = setting(None, code="path")
    """Which valid tokens keep their term: 'all', a path or a TokenMask object; None = the failure filter of
    negative_token_fraction (off at 1.0)."""
    constant_length_normalizer: int | None = setting(None, integer=True, ge=1, optional=True,
                                                     fix="e.g. 6144 (the reference's L)")
    """The L of aggregation='constant_length' (the reference: 6144)."""
    negative_token_fraction: float = setting(1.0, ge=0, le=1, fix="e.g. 0.9, or 1.0 for no filter")
    """q: a failed episode (env info['success'] False) trains on its ceil(q * T_i) highest-entropy tokens; 1 = off."""

    needs_entropy = True  # the entropy filter and the entropy_mean metric

    def __post_init__(self) -> None:
        check = Checks("FlashReinforceLossSpec")
        check.fields(self)
        q = self.negative_token_fraction
        if self.aggregation == "constant_length" and self.constant_length_normalizer is None:
            check.expect(False, "constant_length_normalizer", "an integer >= 1 with aggregation='constant_length'",
                         None, "set constant_length_normalizer, e.g. 6144 as the reference does")
        for name, (registry, _) in COMPONENTS.items():
            value = getattr(self, name)
            if value is not None or name not in ("baseline", "token_mask"):
                problem = registry.problem(value)
                if problem:
                    check.expect(False, name, *problem)
        if self.token_mask is not None and is_number(q) and q < 1:
            check.expect(False, "token_mask", f"None with negative_token_fraction={q} (the failure filter is the token "
                         "mask)", describe(self.token_mask), "set negative_token_fraction=1.0, or token_mask=None")
        check.done()
        self._factories = {name: registry.factory(default if getattr(self, name) is None else getattr(self, name))
                           for name, (registry, default) in COMPONENTS.items()
                           if getattr(self, name) is not None or default is not None}
        self._built: dict[str, Any] = {}

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain data: a component object as ``"<object module:qualname>"``."""
        return {f.name: describe(getattr(self, f.name)) if f.name in COMPONENTS else getattr(self, f.name)
                for f in fields(self)}

    # Shipping: the learner actors get each component's factory by value (``flashrl.user_code``), so a
    # component (or a registered name) defined in the user's own module works where that module does not
    # import; each process constructs its components once, on first use.
    def __getstate__(self) -> dict[str, Any]:
        state = {key: value for key, value in self.__dict__.items() if key != "_built"}
        for name in COMPONENTS:
            if not isinstance(state[name], str) and state[name] is not None:
                state[name] = Shipped(state[name])
        state["_factories"] = {name: Shipped(factory) for name, factory in self._factories.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _built={})

    def __copy__(self) -> FlashReinforceLossSpec:
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__, _built={})
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> FlashReinforceLossSpec:
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "_built"}, memo), _built={})
        return new

    def component(self, name: str) -> Any:
        """The component ``name`` (a key of ``COMPONENTS``) built in this process, or None (token_mask unset)."""
        if name not in self._built:
            factory = self._factories.get(name)
            self._built[name] = None if factory is None else factory()
        return self._built[name]

    @property
    def filter_on(self) -> bool:
        return self.negative_token_fraction < 1.0

    # ------------------------------------------------------------------------------------------
    def prepare(self, batch: TrainBatch) -> FlashReinforceContext:
        rewards = batch.rewards.to(torch.float32)  # [B]
        advantages = self.component("baseline")(rewards, group_ids=batch.group_ids).detach()  # [B]
        return FlashReinforceContext(
            batch=batch,
            metrics={  # 0-d tensors: the learner reads them back with the update's other metrics
                "advantage_mean": advantages.mean(),
                "advantage_std": advantages.std(unbiased=False),
                "reward_mean": batch.rewards.mean(),
            },
            advantages=advantages,
            # [B] from the env's success labels; raises (on every rank alike) when the batch has none
            failures=batch.failures if self.filter_on else None if batch.success is None else ~batch.success,
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
            failures=None if context.failures is None else context.failures[idx].to(device),  # [b]
            negative_token_fraction=self.negative_token_fraction,
            importance_sampling=self.component("importance_sampling"),
            trust_region=self.component("trust_region"),
            aggregation=self.component("aggregation"),
            token_mask=self.component("token_mask"),
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
            # [b] per trajectory: its drift, and 1.0 where the trust region accepted it
            rows={"drift_values": out.drift.detach(), "accepted_values": out.trust_mask.detach().double()},
        )


_SUMMED = ("accepted_fraction", "num_rejected", "drift_mean", "ratio_mean", "entropy_mean", "tokens_valid",
           "tokens_kept")
"""The loss's metrics that add up over micro-batches (``flash_reinforce_loss``'s ``METRIC_NAMES``)."""

