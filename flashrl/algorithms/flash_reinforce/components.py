"""Pluggable pieces of the FlashREINFORCE loss: baselines, importance sampling, trust regions, aggregations
and token masks.

Each piece is a small callable object, registered under a name. The loss takes a name, a
``"package.module:name"`` import path or an object, so an ablation is a config string and a new idea
is a few lines (``docs/extending.md``)::

    class MedianBaseline:
        def __call__(self, rewards, *, group_ids=None):
            return rewards - rewards.median()        # the advantages A [B]

    flash_reinforce_loss(..., baseline=MedianBaseline())
    BASELINES.register("median")(MedianBaseline)   # now also reachable as baseline="median"

``Registry.problem`` is the check ``validate()`` runs: the component shipped by value and unpacked as
the learner actors receive it (``flashrl.user_code``), constructed once, its signature compared with
the kind's.

Values taken from the method's public release are cited by their path in repository
``yifanzhang-pro/FlashREINFORCE`` (the reference loss) or in NVIDIA Molt (``molt-rl``, its GPU runtime).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from flashrl.user_code import UserCodeError, describe, import_path, is_description, is_path, roundtrip

T = TypeVar("T")

__all__ = [
    "AGGREGATIONS",
    "BASELINES",
    "BERNOULLI_KL_CLAMP",
    "GROUP_NORM_EPS",
    "IMPORTANCE_SAMPLINGS",
    "TOKEN_MASKS",
    "TRUST_REGIONS",
    "Aggregation",
    "Baseline",
    "ComponentFactory",
    "FailureTokenEntropyMask",
    "ImportanceSampling",
    "Normalizers",
    "Registry",
    "TokenMask",
    "TrustDecision",
    "TrustRegion",
    "bernoulli_kl",
    "bernoulli_kl_clamped",
    "failure_token_keep_mask",
]


class Registry(Generic[T]):
    """Name -> factory of a component kind; unknown names list the known ones.

    A component is given as a registered name, a ``"package.module:name"`` import path or an object.
    A path or an object that is a class is constructed with no arguments (as a registered factory is
    called); any other callable is the component itself. ``positional`` and ``keywords`` are the
    arguments every component of the kind is called with: an object whose signature does not take
    them is not a component of this kind (:meth:`problem`).
    """

    def __init__(self, kind: str, *, positional: int = 1, keywords: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self.positional = positional
        self.keywords = keywords
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
        return self.factory(name)()

    def factory(self, value: str | Any) -> ComponentFactory:
        """A zero-argument factory of the component ``value`` gives (name, path or object), picklable."""
        if isinstance(value, str) and not is_path(value):
            if value not in self._factories:
                raise ValueError(
                    f"Unknown {self.kind} {value!r}; expected one of {self.names()}. Register your own with "
                    f"@{self.kind.upper()}S.register('name'), or pass an object or a 'module:name' path."
                )
            return ComponentFactory(self._factories[value], construct=True)
        target = import_path(value) if isinstance(value, str) else value
        if not callable(target):
            raise TypeError(f"A {self.kind} must be a registered name, a 'module:name' path or a callable; got "
                            f"{describe(target)}.")
        return ComponentFactory(target, construct=isinstance(target, type))

    def resolve(self, value: str | T | None, default: str) -> T:
        """A name, a path, an object (a class is constructed) or None (the default)."""
        return self.factory(default if value is None else value)()

    def problem(self, value: Any) -> tuple[str, Any, str] | None:
        """Why ``value`` is not a usable component of this kind, as (expected, actual, fix); None if it is.

        Checks it where it will run: the factory is shipped by value and unpacked (as the actors
        receive it), then constructed once and its call signature compared with the kind's.
        """
        expected = f"one of {self.names()}, a 'module:name' path or a {self.kind} object"
        if isinstance(value, str) and not is_path(value) and value in self._factories:
            if getattr(self._factories[value], "__module__", "").startswith("flashrl."):
                return None  # flashrl's own: imported by name in the actors
        elif isinstance(value, str) and not is_path(value):
            fix = ("the object itself cannot be stored as text: pass it again (e.g. as an override of "
                   "from_checkpoint), or configure it by its 'module:name' path" if is_description(value) else
                   f"use a registered name, or register yours with @{self.kind.upper()}S.register('name')")
            return expected, value, fix
        try:
            factory = self.factory(value)
        except UserCodeError as err:
            return expected, describe(value), f"{err}; fix the path (the module must import in this process)"
        except TypeError:
            return expected, describe(value), (f"pass a callable {self.kind} ({self._call_text()}; its protocol is in "
                                               "flashrl.algorithms.flash_reinforce.components)")
        try:
            component = roundtrip(factory)()
        except UserCodeError as err:
            return ("an object that can be pickled (it is shipped to the actors by value)", describe(value),
                    (f"{err}; keep unpicklable state (locks, open files, CUDA tensors) out of it, or create it "
                     "lazily on first call"))
        except Exception as err:  # noqa: BLE001 - the user's constructor
            return (f"a {self.kind} class that constructs with no arguments", describe(value),
                    f"constructing it raised {type(err).__name__}: {err}; pass an instance instead")
        signature = self.signature_problem(component)
        if signature:
            return f"a {self.kind}: {self._call_text()}", describe(value), signature
        return None

    def signature_problem(self, component: Any) -> str | None:
        """Why ``component`` cannot be called as this kind's components are, or None."""
        if not callable(component):
            return f"it is not callable; give it a __call__({self._call_text()})"
        try:
            signature = inspect.signature(component)
        except (TypeError, ValueError):
            return None  # a builtin without a signature: it is tried when it runs
        try:
            signature.bind(*range(self.positional), **dict.fromkeys(self.keywords))
        except TypeError as err:
            return f"its signature {signature} does not take ({self._call_text()}): {err}"
        return None

    def _call_text(self) -> str:
        return ", ".join([f"<{self.positional} positional>"] + [f"{k}=" for k in self.keywords])


@dataclass(frozen=True)
class ComponentFactory:
    """Makes a component where it runs (picklable): calls ``target`` (a class or factory) or returns it."""

    target: Any
    construct: bool

    def __call__(self) -> Any:
        return self.target() if self.construct else self.target


# --------------------------------------------------------------------------------------------------
# Baselines: rewards [B] -> advantages A [B] (A_i = R_i - b_i for a subtractive baseline).


class Baseline(Protocol):
    def __call__(self, rewards: torch.Tensor, *, group_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Return the advantages ``A`` [B] of rewards [B] (``group_ids`` [B]: which prompt each answers)."""


BASELINES: Registry[Baseline] = Registry("baseline", positional=1, keywords=("group_ids",))


@BASELINES.register("batch_mean")
class BatchMeanBaseline:
    """One-Batch REINFORCE: ``A_i = R_i - mean_j R_j`` over the batch (B independent prompts)."""

    def __call__(self, rewards: torch.Tensor, *, group_ids: torch.Tensor | None = None) -> torch.Tensor:
        return rewards - rewards.mean()  # [B]


@BASELINES.register("none")
class NoBaseline:
    """Plain REINFORCE: advantages are the raw rewards (ablation)."""

    def __call__(self, rewards: torch.Tensor, *, group_ids: torch.Tensor | None = None) -> torch.Tensor:
        return rewards.clone()  # [B]


@BASELINES.register("leave_one_out")
class LeaveOneOutBaseline:
    """``A_i = R_i -`` the mean reward of the *other* B - 1 trajectories (RLOO over the batch); B = 1: R."""

    def __call__(self, rewards: torch.Tensor, *, group_ids: torch.Tensor | None = None) -> torch.Tensor:
        b = rewards.shape[0]
        if b == 1:
            return rewards.clone()
        return rewards - (rewards.sum() - rewards) / (b - 1)  # [B]


def _group_index(rewards: torch.Tensor, group_ids: torch.Tensor | None, name: str) -> tuple[torch.Tensor, int]:
    """Dense group index [B] in 0..G-1 and the number of groups (for the synchronous comparison only)."""
    if group_ids is None:
        raise ValueError(
            f"baseline={name!r} needs group_ids [B] (which prompt each rollout answers); got None. "
            "Use the sync_group mode, or baseline='batch_mean' for one rollout per prompt."
        )
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids must have shape {tuple(rewards.shape)}; got {tuple(group_ids.shape)}.")
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [B]
    return inverse, int(inverse.max()) + 1


def _group_sums(values: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)


@BASELINES.register("group_mean")
class GroupMeanBaseline:
    """Dr. GRPO-style: ``A_i = R_i -`` the mean reward of the rollouts that share its prompt.

    Only for the synchronous comparison: FlashREINFORCE itself has one rollout per prompt.
    """

    def __call__(self, rewards: torch.Tensor, *, group_ids: torch.Tensor | None = None) -> torch.Tensor:
        inverse, g = _group_index(rewards, group_ids, "group_mean")
        counts = torch.bincount(inverse, minlength=g).to(rewards.dtype)  # [G]
        return rewards - (_group_sums(rewards, inverse, g) / counts)[inverse]  # [B]


GROUP_NORM_EPS = 1e-9
"""The GRPO advantage's ``eps`` in ``(R - mean) / (std + eps)``: Molt's ``grpo`` estimator
(``molt/trainer/algorithm/advantage.py``), which the reference's ``grpo`` variants select."""


@BASELINES.register("group_norm")
class GroupNormBaseline:
    """GRPO: ``A_i = (R_i - mean_g) / (std_g + 1e-9)`` over the rollouts ``g`` that share a prompt.

    As Molt's ``grpo`` estimator (``molt/trainer/algorithm/advantage.py``), the one the reference's
    ``grpo`` variants select (``examples/settings/*.json``: ``algo.advantage.estimator = grpo``): the
    *sample* standard deviation (Bessel's correction, ``torch.std``'s default), and a group of one
    rollout has std 0 (so its advantage is 0). No batch whitening follows (that estimator returns
    the group-normalised values as they are). Only for the synchronous comparison (``sync_group``).
    """

    def __call__(self, rewards: torch.Tensor, *, group_ids: torch.Tensor | None = None) -> torch.Tensor:
        inverse, g = _group_index(rewards, group_ids, "group_norm")
        counts = torch.bincount(inverse, minlength=g).to(rewards.dtype)  # [G]
        mean = _group_sums(rewards, inverse, g) / counts  # [G]
        centred = rewards - mean[inverse]  # [B]
        squares = _group_sums(centred * centred, inverse, g)  # [G]
        std = torch.where(counts > 1, (squares / (counts - 1).clamp(min=1)).sqrt(), torch.zeros_like(squares))
        return centred / (std[inverse] + GROUP_NORM_EPS)  # [B]


# --------------------------------------------------------------------------------------------------
# Importance sampling: the (detached) denominator log-probs of the token ratio rho = exp(log q - log p).


class ImportanceSampling(Protocol):
    def __call__(self, logprobs: torch.Tensor, behavior_logprobs: torch.Tensor) -> torch.Tensor:
        """Return the log-probs [B, T] the current ones are compared with (ratio and trust region)."""


IMPORTANCE_SAMPLINGS: Registry[ImportanceSampling] = Registry("importance_sampling", positional=2)


@IMPORTANCE_SAMPLINGS.register("token")
class TokenImportanceSampling:
    """FlashREINFORCE: the behavior policy recorded at sampling time, ``rho_it = q_it / p_it``."""

    def __call__(self, logprobs: torch.Tensor, behavior_logprobs: torch.Tensor) -> torch.Tensor:
        return behavior_logprobs


@IMPORTANCE_SAMPLINGS.register("none")
class NoImportanceSampling:
    """No behavior correction: the detached current policy is the denominator, so ``rho = 1``.

    The reference's ``no_is`` ablation (``examples/settings/qwen3_tool_ablation.json``: "no_is uses the
    current policy as the detached denominator; the binary-KL gate then also becomes inactive"): the
    trust region compares the current policy with itself, so its drift is 0 and it accepts every
    trajectory that has a valid token.
    """

    def __call__(self, logprobs: torch.Tensor, behavior_logprobs: torch.Tensor) -> torch.Tensor:
        return logprobs.detach()


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
        """Decide per trajectory from current and behavior log-probs [B, T] and the mask [B, T].

        ``delta = math.inf`` accepts every trajectory that has a valid token.
        """


TRUST_REGIONS: Registry[TrustRegion] = Registry("trust_region", positional=3, keywords=("delta",))

BERNOULLI_KL_CLAMP = 1e-6
"""p and q of the gate's Bernoulli KL are clamped to [1e-6, 1 - 1e-6], as the reference
(``flashreinforce/loss.py``) and Molt (``molt/models/loss.py``, ``is_correction_gating="binary_kl"``) do,
so that the paper's delta values mean the same gate."""


def bernoulli_kl_clamped(logp: torch.Tensor, logq: torch.Tensor, eps: float = BERNOULLI_KL_CLAMP) -> torch.Tensor:
    """Bernoulli KL ``p log(p/q) + (1-p) log((1-p)/(1-q))`` of probabilities clamped to [eps, 1 - eps].

    The gate of the published method: p = exp(logp), q = exp(logq), both clamped before the KL. At
    extreme probabilities it differs from the exact KL (:func:`bernoulli_kl`) on purpose.
    """
    p = logp.exp().clamp(eps, 1.0 - eps)
    q = logq.exp().clamp(eps, 1.0 - eps)
    return p * (p.log() - q.log()) + (1.0 - p) * (torch.log1p(-p) - torch.log1p(-q))


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, accurate at both ends (Maechler, 2012)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def bernoulli_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Exact Bernoulli KL ``p log(p/q) + (1-p) log((1-p)/(1-q))`` from log-probabilities, elementwise.

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


def _sequence_decision(token_drift: torch.Tensor, loss_mask: torch.Tensor, delta: float) -> TrustDecision:
    """Mean drift over each trajectory's valid tokens; accept iff it is <= delta and there is a token."""
    d = torch.where(loss_mask, token_drift, torch.zeros_like(token_drift)).clamp(min=0.0)  # [B, T]
    counts = loss_mask.sum(-1)  # [B]
    drift = d.sum(-1) / counts.clamp(min=1)  # [B]
    trust = (drift <= delta) & (counts > 0)  # [B]
    return TrustDecision(drift=drift, trust_mask=trust)


@TRUST_REGIONS.register("bernoulli_kl")
class BernoulliKLSequenceTrustRegion:
    """Sequence Trust Region: accept iff the mean per-token Bernoulli KL (clamped p, q) <= delta.

    ``p`` is the behavior (or importance-sampling denominator) probability, ``q`` the current one, both
    clamped to [1e-6, 1 - 1e-6] (:data:`BERNOULLI_KL_CLAMP`). A trajectory with no valid token is
    rejected (there is nothing to measure or learn from).
    """

    def __call__(self, logprobs, behavior_logprobs, loss_mask, *, delta: float) -> TrustDecision:
        with torch.no_grad():
            d = bernoulli_kl_clamped(behavior_logprobs, logprobs)  # [B, T]  (p = behavior, q = current)
            return _sequence_decision(d, loss_mask, delta)


@TRUST_REGIONS.register("bernoulli_kl_exact")
class ExactBernoulliKLSequenceTrustRegion:
    """As ``bernoulli_kl`` with the exact log-space KL (:func:`bernoulli_kl`), no probability clamp.

    flashrl's own variant: near p or q = 1 it measures drifts the clamped gate cannot see, so its delta
    values are not the paper's.
    """

    def __call__(self, logprobs, behavior_logprobs, loss_mask, *, delta: float) -> TrustDecision:
        with torch.no_grad():
            d = bernoulli_kl(behavior_logprobs, logprobs)  # [B, T]
            return _sequence_decision(d, loss_mask, delta)


@TRUST_REGIONS.register("tv")
class TotalVariationSequenceTrustRegion:
    """Accept iff the mean per-token ``|p - q|`` of the sampled tokens <= delta.

    Molt's ``is_correction_gating="tv"`` at ``is_correction_level="seq"`` (``molt/models/loss.py``):
    the absolute difference of the two probabilities of the sampled token, unclamped, averaged over the
    trajectory's valid tokens.
    """

    def __call__(self, logprobs, behavior_logprobs, loss_mask, *, delta: float) -> TrustDecision:
        with torch.no_grad():
            d = (behavior_logprobs.exp() - logprobs.exp()).abs()  # [B, T]
            return _sequence_decision(d, loss_mask, delta)


@TRUST_REGIONS.register("none")
class NoTrustRegion:
    """Ablation: every trajectory with at least one valid token is accepted; the drift is still reported."""

    def __call__(self, logprobs, behavior_logprobs, loss_mask, *, delta: float) -> TrustDecision:
        return BernoulliKLSequenceTrustRegion()(logprobs, behavior_logprobs, loss_mask, delta=math.inf)


# --------------------------------------------------------------------------------------------------
# Aggregations: how per-token terms become one scalar objective.


@dataclass(frozen=True)
class Normalizers:
    """The batch-global denominators an aggregation may divide by (data-parallel shards pass globals)."""

    num_trajectories: int
    """B: every trajectory of the (global) batch, rejected and empty ones included."""
    num_tokens: int
    """Valid tokens of the (global) batch, those of rejected trajectories included."""
    constant_length: int | None = None
    """The constant L of ``constant_length`` (None when not configured)."""


class Aggregation(Protocol):
    def __call__(self, token_terms: torch.Tensor, valid_counts: torch.Tensor, norm: Normalizers) -> torch.Tensor:
        """Reduce ``token_terms`` [B, T] (already zero where a token does not contribute) to a scalar.

        ``valid_counts`` [B] is each trajectory's number of valid tokens ``T_i`` (before any filter).
        """


AGGREGATIONS: Registry[Aggregation] = Registry("aggregation", positional=3)


@AGGREGATIONS.register("sample_mean")
class SampleMean:
    """Sample-Mean Optimization: mean over each trajectory's T_i tokens, then mean over B."""

    def __call__(self, token_terms, valid_counts, norm: Normalizers) -> torch.Tensor:
        per_traj = token_terms.sum(-1) / valid_counts.clamp(min=1).to(token_terms.dtype)  # [B]
        return per_traj.sum() / norm.num_trajectories


@AGGREGATIONS.register("token_mean")
class TokenMean:
    """One mean over all valid tokens of the batch (long trajectories weigh more).

    The reference's ``token_mean`` variant and GRPO's reduction (Molt's ``token-mean``: the token sum
    over the batch's action-token count). The count includes the tokens of rejected trajectories,
    mirroring ``sample_mean``'s B.
    """

    def __call__(self, token_terms, valid_counts, norm: Normalizers) -> torch.Tensor:
        return token_terms.sum() / max(norm.num_tokens, 1)


@AGGREGATIONS.register("constant_length")
class ConstantLength:
    """Token sum over the batch divided by ``B x L`` for a constant L: Dr. GRPO's normaliser.

    The reference's ``constant_length`` variant (``examples/settings/
    qwen2p5_7b_instruct_python_tool_10turn.json``: Molt's ``seq-mean-token-sum-norm`` with
    ``loss_scale_factor = 6144``): each trajectory's token sum, averaged over B, divided by L.
    """

    def __call__(self, token_terms, valid_counts, norm: Normalizers) -> torch.Tensor:
        if norm.constant_length is None or norm.constant_length < 1:
            raise ValueError(
                f"aggregation='constant_length' needs constant_length_normalizer, an integer >= 1 (the L of "
                f"sum / (B x L)); got {norm.constant_length!r}. Set it, e.g. 6144 as the reference does."
            )
        return token_terms.sum() / (norm.num_trajectories * norm.constant_length)


# --------------------------------------------------------------------------------------------------
# Token masks: which valid tokens of each trajectory keep their loss term.


class TokenMask(Protocol):
    def __call__(
        self, loss_mask: torch.Tensor, *, entropy: torch.Tensor | None, failures: torch.Tensor | None
    ) -> torch.Tensor:
        """Return a bool [B, T] mask, a subset of ``loss_mask`` [B, T]: the tokens whose term is in the loss.

        ``entropy`` [B, T] holds the current policy's token entropies, ``failures`` [B] the env's failure
        labels (None when the batch has none). Decide each row from that row alone: the learner calls
        the mask on micro-batches, whose losses must add up to the whole batch's. The denominators
        (``T_i``, B) stay the full counts.
        """


TOKEN_MASKS: Registry[TokenMask] = Registry("token_mask", positional=1, keywords=("entropy", "failures"))


@TOKEN_MASKS.register("all")
class AllTokens:
    """Every valid token keeps its term (no filter)."""

    def __call__(self, loss_mask, *, entropy=None, failures=None) -> torch.Tensor:
        return loss_mask


def failure_token_keep_mask(
    entropy: torch.Tensor,
    loss_mask: torch.Tensor,
    failures: torch.Tensor,
    fraction: float,
) -> torch.Tensor:
    """Which valid tokens keep their loss term under the failure-token entropy filter.

    A trajectory with ``failures[i]`` keeps exactly ``ceil(fraction * T_i)`` of its ``T_i`` valid
    tokens: those of highest ``entropy``, ties broken by position (the earlier token first, a stable
    descending sort, as the reference ``flashreinforce/loss.py``). Other trajectories keep every valid
    token. Returns a bool [B, T] mask (a subset of ``loss_mask``).
    """
    b, t = loss_mask.shape
    lengths = loss_mask.sum(-1)  # [B]  T_i
    # Python's float product, as math.ceil(q * T_i) in the reference: float64 gives the same rounding.
    counts = torch.ceil(fraction * lengths.to(torch.float64))  # [B]
    scores = entropy.masked_fill(~loss_mask, -math.inf)  # [B, T]  padding sorts last
    order = scores.argsort(dim=-1, descending=True, stable=True)  # [B, T]
    positions = torch.arange(t, device=loss_mask.device).expand(b, t)  # [B, T]
    rank = torch.empty_like(order).scatter_(1, order, positions)  # [B, T]  rank of each token
    keep_failed = loss_mask & (rank < counts.unsqueeze(-1))  # [B, T]
    return torch.where(failures.unsqueeze(-1), keep_failed, loss_mask)  # [B, T]


@dataclass(frozen=True)
class FailureTokenEntropyMask:
    """The failure-token entropy filter as a token mask: a failed trajectory keeps its ``ceil(fraction *
    T_i)`` highest-entropy tokens (:func:`failure_token_keep_mask`); ``negative_token_fraction`` < 1
    selects it."""

    fraction: float

    def __call__(self, loss_mask, *, entropy=None, failures=None) -> torch.Tensor:
        if entropy is None or failures is None:
            missing = " and ".join(n for n, v in (("entropy", entropy), ("failures", failures)) if v is None)
            raise ValueError(f"FailureTokenEntropyMask needs the token entropies and the failure labels; {missing} "
                             "is None (the env must put a bool info['success'] in every step's info).")
        return failure_token_keep_mask(entropy, loss_mask, failures, self.fraction)
