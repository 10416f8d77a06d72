"""The unit of training data: one finished episode from one prompt."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Episode:
    """One finished interaction, flattened into a single token sequence.

    Position ``t`` of every per-token list refers to ``token_ids[t]``. Tokens the model sampled carry
    ``loss_mask[t] = True`` and the behavior log-probability the inference engine recorded when it
    sampled them (never recomputed later). Prompt and environment tokens carry ``loss_mask[t] = False``
    and a behavior log-prob of ``0.0`` that nothing reads.
    """

    prompt_id: str
    """Key of the prompt/task this episode answers; a batch holds B distinct ones."""
    token_ids: list[int]
    """Prompt, model and environment tokens, in order."""
    loss_mask: list[bool]
    """True where the token was sampled by the policy."""
    behavior_logprobs: list[float]
    """Log-prob of each sampled token under the distribution actually sampled from."""
    reward: float
    """Scalar episode return."""
    policy_versions: list[int] = field(default_factory=list)
    """Policy version of each model turn (one entry per model turn, in order)."""
    terminated: bool = True
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """Environment details (verification result, turn count, ...) of the last step; must be picklable."""
    success: bool | None = None
    """Whether the episode solved its task; None = taken from ``info["success"]``, None if absent.

    The env contract (``flashrl.envs.base``) puts a bool ``info["success"]`` in every step's info. It
    labels failures for the failure-token entropy filter, which, as the method's reference does,
    uses explicit labels and never the reward or the advantage sign. flashrl does not guess a label
    from the reward: an env that reports none leaves this None, and the filter then refuses the batch.
    """

    routed_experts: np.ndarray | None = None
    """[len(token_ids), num_hidden_layers, top_k] integer: the experts the engine routed each token to (an
    MoE policy whose engine records routing, ``routing_replay``); -1 where none was recorded (the last
    token, env tokens after the last model turn, dense layers). None: not recorded."""

    segment_starts: list[int] | None = None
    """Where each of the episode's contexts starts in ``token_ids``; None: one context (``[0]``).

    An agent that edits or summarises its conversation between model calls sends a prompt that does not
    extend the previous call's tokens: that call starts a new *segment*, a sequence the model saw from
    its own start. ``token_ids`` is then the segments one after another, and the learner recomputes
    each one on its own context (position 0 again, attention inside the segment); the loss still runs
    over all of the episode's sampled tokens, so the episode weighs 1/B (``docs/design.md`` §1). Each
    start is a prompt token (``loss_mask`` False); the first is 0 and they increase strictly.
    """

    def __post_init__(self) -> None:
        if self.success is None and "success" in self.info:
            self.success = self.info["success"]
        if self.success is not None:
            if not isinstance(self.success, (bool, np.bool_)):
                raise TypeError(
                    f"Episode {self.prompt_id!r}: success (info['success']) must be a bool or None; got "
                    f"{self.success!r} ({type(self.success).__name__})."
                )
            self.success = bool(self.success)
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.behavior_logprobs) != n:
            raise ValueError(
                f"Episode {self.prompt_id!r}: token_ids, loss_mask and behavior_logprobs must have the "
                f"same length; got {n}, {len(self.loss_mask)} and {len(self.behavior_logprobs)}."
            )
        starts = self.segment_starts
        if starts is not None:
            starts = [int(x) for x in starts]
            if (not starts or starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts))
                    or (starts[-1] >= n and starts != [0]) or any(x < n and self.loss_mask[x] for x in starts)):
                raise ValueError(
                    f"Episode {self.prompt_id!r}: segment_starts must start at 0, increase strictly, lie below "
                    f"len(token_ids)={n} and fall on prompt tokens (loss_mask False); got {self.segment_starts!r}."
                )
            self.segment_starts = starts
        routed = self.routed_experts
        if routed is not None and (
            not isinstance(routed, np.ndarray) or routed.ndim != 3 or routed.shape[0] != n
            or not np.issubdtype(routed.dtype, np.integer)
        ):
            raise ValueError(
                f"Episode {self.prompt_id!r}: routed_experts must be None or an integer array [{n}, layers, "
                f"top_k] (one row per token); got {getattr(routed, 'shape', type(routed).__name__)}."
            )

    @property
    def num_generated_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def is_finite(self) -> bool:
        """Whether the reward and every recorded behavior log-prob of a sampled token are finite."""
        if not math.isfinite(self.reward):
            return False
        return all(math.isfinite(lp) for lp, m in zip(self.behavior_logprobs, self.loss_mask) if m)

    @property
    def segments(self) -> list[slice]:
        """The episode's segments as slices of ``token_ids`` (one slice for a one-context episode)."""
        starts = self.segment_starts or [0]
        ends = [*starts[1:], len(self.token_ids)]
        return [slice(a, b) for a, b in zip(starts, ends)]

    @property
    def min_policy_version(self) -> int | None:
        return min(self.policy_versions) if self.policy_versions else None
