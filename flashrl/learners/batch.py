"""The learner's input: B finished episodes as right-padded tensors."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from flashrl.episode import Episode
from flashrl.learners.segments import segment_positions, segment_positions_problem

__all__ = ["TrainBatch"]

LOGPROB_TOLERANCE = 1e-4
"""Largest recorded log-prob accepted (engines round to tiny positive values; more means a bug)."""

UNKNOWN_POLICY_VERSION = -1
"""``policy_versions`` entry of an episode that recorded no generated segment."""


@dataclass(kw_only=True)
class TrainBatch:
    """B finished episodes, right-padded to a common length T.

    Row ``i`` is one episode; column ``t`` is its ``t``-th token. ``behavior_logprobs[i, t]`` is the
    log-prob the inference engine recorded when it sampled ``token_ids[i, t]`` (aligned with the token,
    not shifted), so it lines up with ``flashrl.models.compute_token_logprobs``, whose column ``t`` is
    ``log p(token_ids[:, t] | token_ids[:, :t])``. Padding has ``attention_mask = loss_mask = False``.

    The constructor checks shapes, dtypes and masks; finiteness is checked by ``non_finite_reason``, which
    the learner calls once per batch to skip and count a non-finite batch instead of failing (the one
    check of the batch's rewards and recorded log-probs). ``from_episodes`` rejects non-finite episodes
    outright.
    """

    token_ids: torch.Tensor
    """[B, T] long: prompt, model and environment tokens, right-padded."""
    attention_mask: torch.Tensor
    """[B, T] bool: True on real tokens, False on padding."""
    loss_mask: torch.Tensor
    """[B, T] bool: True on tokens the policy sampled (the ones the loss trains)."""
    behavior_logprobs: torch.Tensor
    """[B, T] float32: recorded sampling log-probs; 0.0 where ``loss_mask`` is False."""
    rewards: torch.Tensor
    """[B] float32: scalar return of each episode."""
    group_ids: torch.Tensor | None = None
    """[B] long or None: which rollouts share a prompt (only the synchronous group baseline uses it)."""
    policy_versions: torch.Tensor
    """[B] long: oldest policy version that generated a segment of the episode (-1 if unknown)."""
    prompt_ids: list[str]
    """The prompt/task key of each episode."""
    success: torch.Tensor | None = None
    """[B] bool or None: whether each episode solved its task (the env's ``info["success"]``); None
    when any episode of the batch carries no label. The failure-token entropy filter needs it."""
    routed_experts: torch.Tensor | None = None
    """[B, T, num_hidden_layers, top_k] int16 or None: the experts the engine routed each token to, which
    the learner replays (``LearnerSpec.routing_replay``); -1 where none was recorded (padding included,
    and the rows of an episode that recorded none). None when no episode of the batch recorded any."""
    segment_positions: torch.Tensor | None = None
    """[B, T] long or None: each token's position inside its segment (``Episode.segment_starts``), 0 at
    every segment start and on padding; the learner recomputes each segment on its own context
    (``flashrl.learners.segments``). None when every episode of the batch has one segment."""

    def __post_init__(self) -> None:
        if self.token_ids.dim() != 2:
            raise ValueError(f"token_ids must be [B, T]; got shape {tuple(self.token_ids.shape)}.")
        b, t = self.token_ids.shape
        if b < 1 or t < 1:
            raise ValueError(f"A TrainBatch needs at least one episode and one token; got shape [{b}, {t}].")
        expected = {
            "token_ids": ((b, t), (torch.int64,)),
            "attention_mask": ((b, t), (torch.bool,)),
            "loss_mask": ((b, t), (torch.bool,)),
            "behavior_logprobs": ((b, t), (torch.float32,)),
            "rewards": ((b,), (torch.float32,)),
            "policy_versions": ((b,), (torch.int64,)),
        }
        if self.group_ids is not None:
            expected["group_ids"] = ((b,), (torch.int64,))
        if self.success is not None:
            expected["success"] = ((b,), (torch.bool,))
        routed = self.routed_experts
        if routed is not None and not (isinstance(routed, torch.Tensor) and routed.dim() == 4
                                       and tuple(routed.shape[:2]) == (b, t) and routed.dtype == torch.int16):
            raise ValueError(
                f"TrainBatch.routed_experts must be None or [{b}, {t}, layers, top_k] int16; got "
                f"{getattr(routed, 'shape', type(routed).__name__)} {getattr(routed, 'dtype', '')}. Build batches "
                "with TrainBatch.from_episodes."
            )
        for name, (shape, dtypes) in expected.items():
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"TrainBatch.{name} must be a torch.Tensor; got {type(value).__name__}.")
            if tuple(value.shape) != shape or value.dtype not in dtypes:
                raise ValueError(
                    f"TrainBatch.{name} must have shape {list(shape)} and dtype {dtypes[0]}; got "
                    f"{list(value.shape)} and {value.dtype}. Build batches with TrainBatch.from_episodes."
                )
        if len(self.prompt_ids) != b:
            raise ValueError(f"prompt_ids must have one entry per episode ({b}); got {len(self.prompt_ids)}.")
        if bool((self.loss_mask & ~self.attention_mask).any()):
            raise ValueError("loss_mask is True on a padding position (attention_mask False); it must not be.")
        if bool(self.loss_mask[:, 0].any()):
            raise ValueError(
                "loss_mask is True at position 0; the first token has no context to be sampled from. "
                "An episode must start with at least one prompt token."
            )
        sampled = self.behavior_logprobs[self.loss_mask]  # [N]
        if sampled.numel() and bool((sampled > LOGPROB_TOLERANCE).any()):
            raise ValueError(
                f"behavior_logprobs are log-probabilities and must be <= 0 on sampled tokens; got a maximum "
                f"of {float(sampled.nan_to_num(nan=0.0).max()):.4g}. Did the engine record probabilities or logits?"
            )
        lengths = self.attention_mask.sum(-1)  # [B]
        positions = torch.arange(t, device=self.attention_mask.device)  # [T]
        if not torch.equal(self.attention_mask, positions.unsqueeze(0) < lengths.unsqueeze(1)):
            raise ValueError("attention_mask must be right-padded: True on a prefix of each row, then False.")
        if self.segment_positions is not None:
            problem = segment_positions_problem(self.segment_positions, self.attention_mask, self.loss_mask)
            if problem is not None:
                raise ValueError(
                    f"TrainBatch.segment_positions {problem}. Build batches with TrainBatch.from_episodes, which "
                    "takes the segments from Episode.segment_starts."
                )

    # ------------------------------------------------------------------------------------------
    @classmethod
    def from_episodes(
        cls,
        episodes: Sequence[Episode],
        *,
        pad_token_id: int,
        group_ids: Sequence[int] | torch.Tensor | None = None,
    ) -> TrainBatch:
        """Pad ``episodes`` into one batch.

        Raises ``ValueError`` for an empty list, an empty episode, an episode whose first token is in
        the loss mask, a non-finite reward or recorded log-prob (EnvRunners are expected to drop and
        count those), or ``group_ids`` of the wrong length.
        """
        if len(episodes) == 0:
            raise ValueError("TrainBatch.from_episodes needs at least one episode; got an empty list.")
        if pad_token_id < 0:
            raise ValueError(f"pad_token_id must be a token id >= 0; got {pad_token_id}.")
        for i, ep in enumerate(episodes):
            if not isinstance(ep, Episode):
                raise TypeError(f"episodes[{i}] must be a flashrl.episode.Episode; got {type(ep).__name__}.")
            if len(ep.token_ids) == 0:
                raise ValueError(f"episodes[{i}] (prompt {ep.prompt_id!r}) has no tokens.")
            if ep.loss_mask[0]:
                raise ValueError(
                    f"episodes[{i}] (prompt {ep.prompt_id!r}) has loss_mask True at position 0; the first "
                    "token must be a prompt token."
                )
            if not math.isfinite(ep.reward):
                raise ValueError(
                    f"episodes[{i}] (prompt {ep.prompt_id!r}) has a non-finite reward {ep.reward!r}; drop "
                    "non-finite episodes (Episode.is_finite) before batching."
                )
            if not ep.is_finite:
                raise ValueError(
                    f"episodes[{i}] (prompt {ep.prompt_id!r}) has a non-finite behavior log-prob on a "
                    "sampled token; drop non-finite episodes (Episode.is_finite) before batching."
                )
        b = len(episodes)
        t = max(len(ep.token_ids) for ep in episodes)
        token_ids = torch.full((b, t), pad_token_id, dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros(b, t, dtype=torch.bool)  # [B, T]
        loss_mask = torch.zeros(b, t, dtype=torch.bool)  # [B, T]
        behavior_logprobs = torch.zeros(b, t, dtype=torch.float32)  # [B, T]
        for i, ep in enumerate(episodes):
            n = len(ep.token_ids)
            token_ids[i, :n] = torch.tensor(ep.token_ids, dtype=torch.long)
            attention_mask[i, :n] = True
            loss_mask[i, :n] = torch.tensor(ep.loss_mask, dtype=torch.bool)
            behavior_logprobs[i, :n] = torch.tensor(ep.behavior_logprobs, dtype=torch.float32)
        # Unused positions carry 0.0 whatever the episode stored there.
        behavior_logprobs = torch.where(loss_mask, behavior_logprobs, torch.zeros_like(behavior_logprobs))
        rewards = torch.tensor([float(ep.reward) for ep in episodes], dtype=torch.float32)  # [B]
        versions = [ep.min_policy_version for ep in episodes]
        policy_versions = torch.tensor(
            [UNKNOWN_POLICY_VERSION if v is None else v for v in versions], dtype=torch.long
        )  # [B]
        labels = [ep.success for ep in episodes]
        success = None if any(s is None for s in labels) else torch.tensor(labels, dtype=torch.bool)  # [B]
        groups = None
        routed = _routed_experts(episodes, t)
        positions = segment_positions([ep.segment_starts for ep in episodes], [len(ep.token_ids) for ep in episodes], t)
        if group_ids is not None:
            groups = torch.as_tensor(group_ids, dtype=torch.long).reshape(-1)  # [B]
            if groups.shape[0] != b:
                raise ValueError(f"group_ids must have one entry per episode ({b}); got {groups.shape[0]}.")
        return cls(
            token_ids=token_ids,
            attention_mask=attention_mask,
            loss_mask=loss_mask,
            behavior_logprobs=behavior_logprobs,
            rewards=rewards,
            group_ids=groups,
            policy_versions=policy_versions,
            prompt_ids=[ep.prompt_id for ep in episodes],
            success=success,
            routed_experts=routed,
            segment_positions=positions,
        )

    # ------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def failures(self) -> torch.Tensor:
        """[B] bool: the episodes that did not solve their task (``~success``).

        Raises ``ValueError`` when the batch has no success labels: the env must report
        ``info["success"]`` (see ``flashrl.envs.base``).
        """
        if self.success is None:
            raise ValueError(
                "This batch has no success labels (an episode's Episode.success is None), which the "
                "failure-token entropy filter (negative_token_fraction < 1) needs. Make the environment put "
                "a bool info['success'] in every step's info (the flashrl envs do; see flashrl.envs.base), "
                "or set negative_token_fraction=1.0."
            )
        return ~self.success

    def non_finite_reason(self) -> str | None:
        """Why the batch must not be trained on (a non-finite reward or recorded log-prob), or None.

        The one finiteness check of the data the engine and the env produced. The learner's recomputed
        log-probs are a different quantity, checked by the learner (``non_finite_logprobs``).
        """
        if not bool(torch.isfinite(self.rewards).all()):
            return "non_finite_rewards"
        sampled = self.behavior_logprobs[self.loss_mask]  # [N]
        if not bool(torch.isfinite(sampled).all()):
            return "non_finite_behavior_logprobs"
        return None

    def rows(self, index: slice, *, max_length: int | None = None) -> TrainBatch:
        """A sub-batch of the rows in ``index`` (optionally keeping only the first ``max_length`` columns)."""
        cols = slice(0, max_length)
        return replace(
            self,
            token_ids=self.token_ids[index, cols],
            attention_mask=self.attention_mask[index, cols],
            loss_mask=self.loss_mask[index, cols],
            behavior_logprobs=self.behavior_logprobs[index, cols],
            rewards=self.rewards[index],
            group_ids=None if self.group_ids is None else self.group_ids[index],
            policy_versions=self.policy_versions[index],
            prompt_ids=list(self.prompt_ids[index]),
            success=None if self.success is None else self.success[index],
            routed_experts=None if self.routed_experts is None else self.routed_experts[index, cols],
            segment_positions=None if self.segment_positions is None else self.segment_positions[index, cols],
        )

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with every tensor on ``device`` (not validated again: the values are the same)."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return self.derived(**moved)

    def derived(self, **changes: Any) -> TrainBatch:
        """A copy with ``changes`` that the constructor does not check again.

        Only for what is valid whenever this batch is: its rows (any non-empty subset, trimmed to their
        longest) or its tensors moved to another device. The constructor's checks read values back to
        the host, which on a GPU would be several device syncs per micro-batch.
        """
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            names = [f.name for f in fields(self)]
            raise TypeError(f"TrainBatch has no field(s) {sorted(unknown)}; expected some of {names}.")
        out = copy.copy(self)
        for name, value in changes.items():
            setattr(out, name, value)
        return out


def _routed_experts(episodes: Sequence[Episode], t: int) -> torch.Tensor | None:
    """[B, T, layers, top_k] int16 of the episodes' recorded routing (-1 elsewhere), or None if none has any."""
    recorded = [ep.routed_experts for ep in episodes if ep.routed_experts is not None]
    if not recorded:
        return None
    shapes = sorted({tuple(r.shape[1:]) for r in recorded})
    if len(shapes) > 1:
        raise ValueError(
            f"episodes recorded routed_experts of different (layers, top_k) shapes {shapes}; a batch comes from "
            "one model. Fix: do not mix episodes of different models in a batch."
        )
    out = torch.full((len(episodes), t, *shapes[0]), -1, dtype=torch.int16)  # [B, T, L, K]
    for i, ep in enumerate(episodes):
        if ep.routed_experts is not None:
            out[i, : len(ep.token_ids)] = torch.tensor(ep.routed_experts, dtype=torch.int16)  # a copy: Ray hands read-only arrays
    return out
