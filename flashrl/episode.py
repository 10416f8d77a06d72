"""The unit of training data: one finished episode from one prompt."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


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
    """Policy version of each generated segment (one entry per model turn, in order)."""
    terminated: bool = True
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """Environment details (verification result, turn count, ...); must be picklable."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.behavior_logprobs) != n:
            raise ValueError(
                f"Episode {self.prompt_id!r}: token_ids, loss_mask and behavior_logprobs must have the "
                f"same length; got {n}, {len(self.loss_mask)} and {len(self.behavior_logprobs)}."
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
    def min_policy_version(self) -> int | None:
        return min(self.policy_versions) if self.policy_versions else None
