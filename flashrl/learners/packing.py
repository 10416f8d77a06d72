"""Micro-batch planning and sequence packing for the learner's forward and backward passes.

Two independent steps turn a global batch of B trajectories into bounded forward passes:

1. **Planning** (:func:`plan_micro_batches`). Trajectories are assigned to data-parallel ranks so that
   every rank gets about the same number of tokens (greedy longest-processing-time, LPT), then, within
   a rank, into micro-batches whose packed token count stays under ``max_tokens_per_micro_batch``
   (first-fit decreasing, FFD). Both are deterministic: the same lengths give the same layout, ties are
   broken by index. A trajectory longer than the budget is not an error: it goes alone into its own
   micro-batch (``MicroBatchMembers.over_budget``), the smallest forward pass that can hold it, so one long
   episode costs memory but never the update.
2. **Packing** (:func:`pack_rows`, :func:`unpack_rows`). A micro-batch's rows are concatenated without
   padding into ``input_ids`` [1, N] with ``position_ids`` [1, N] restarting at 0 for every sequence and
   the boundaries ``cu_seqlens`` [S + 1]; ``flashrl.models.compute_packed_token_logprobs`` scores them
   with attention confined to each sequence, and :func:`unpack_rows` puts the per-token results back
   into the right-padded [S, T] layout of ``TrainBatch`` rows, so the loss code is unchanged.

The layout (``BatchLayout``: each rank's ``RankShare`` of ``MicroBatchMembers``) says only which
trajectories run together. The batch-global quantities of the method (the baseline's advantages, the
1/B or token-count normaliser) still come from the WHOLE batch, and the update still takes exactly one optimizer step per batch (``docs/design.md`` §1, step 6).

Balance guarantees (both tested): on every layout, the most loaded rank exceeds the least loaded one by
at most the longest trajectory, and LPT's most loaded rank is within ``4/3 - 1/(3W)`` of the best
possible assignment (Graham, 1969). Within a rank, at most one micro-batch is at most half full.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from flashrl.learners.batch import TrainBatch

__all__ = [
    "BatchLayout",
    "MicroBatchMembers",
    "PackedSequences",
    "RankShare",
    "assign_to_ranks",
    "gather_rows",
    "pack_rows",
    "plan_micro_batches",
    "split_into_micro_batches",
    "unpack_rows",
]


# --------------------------------------------------------------------------------------------------
# Planning
@dataclass(frozen=True)
class MicroBatchMembers:
    """Trajectories that run in one packed forward and backward pass."""

    indices: tuple[int, ...]
    """Global row indices into the batch, ascending."""
    lengths: tuple[int, ...]
    """Token count of each of those rows (same order)."""
    over_budget: bool = False
    """True for a lone trajectory longer than the token budget (the only case a budget is exceeded)."""

    def __post_init__(self) -> None:
        if not self.indices or len(self.indices) != len(self.lengths):
            raise ValueError(
                f"MicroBatchMembers needs one length per index and at least one index; got "
                f"{len(self.indices)} indices and {len(self.lengths)} lengths."
            )

    @property
    def num_tokens(self) -> int:
        """Packed token count (no padding)."""
        return sum(self.lengths)

    @property
    def num_sequences(self) -> int:
        return len(self.indices)


@dataclass(frozen=True)
class RankShare:
    """The micro-batches of one data-parallel rank."""

    rank: int
    micro_batches: tuple[MicroBatchMembers, ...]

    @property
    def indices(self) -> tuple[int, ...]:
        """Every global row index of this rank, ascending."""
        return tuple(sorted(i for mb in self.micro_batches for i in mb.indices))

    @property
    def num_tokens(self) -> int:
        return sum(mb.num_tokens for mb in self.micro_batches)


@dataclass(frozen=True)
class BatchLayout:
    """Which rank and which micro-batch every trajectory of a global batch runs in."""

    world_size: int
    max_tokens_per_micro_batch: int | None
    """The token budget of a micro-batch; None means one micro-batch per rank."""
    ranks: tuple[RankShare, ...]
    """One entry per rank, ``ranks[r].rank == r``."""

    @property
    def num_trajectories(self) -> int:
        return sum(len(r.indices) for r in self.ranks)

    @property
    def rank_tokens(self) -> tuple[int, ...]:
        """Token count of every rank."""
        return tuple(r.num_tokens for r in self.ranks)

    def for_rank(self, rank: int) -> RankShare:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"Expected 0 <= rank < {self.world_size}; got rank={rank}.")
        return self.ranks[rank]


def _check_lengths(lengths: Sequence[int] | torch.Tensor) -> list[int]:
    values = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    bad = [(i, n) for i, n in enumerate(values) if int(n) != n or n < 1]
    if bad:
        i, n = bad[0]
        raise ValueError(
            f"Every trajectory needs a whole number of tokens >= 1; lengths[{i}] is {n!r}. Drop empty "
            "episodes before planning."
        )
    return [int(n) for n in values]


def assign_to_ranks(lengths: Sequence[int] | torch.Tensor, world_size: int) -> tuple[tuple[int, ...], ...]:
    """Assign trajectories to ``world_size`` ranks with balanced token counts (greedy LPT).

    Longest first (ties: lower index first), each goes to the rank with the fewest tokens so far (ties:
    fewer trajectories, then lower rank). With ``len(lengths) >= world_size`` every rank gets at least
    one trajectory: the first ``world_size`` go to distinct ranks, since every length is >= 1.

    Returns:
        For every rank, its global indices, ascending.
    """
    sizes = _check_lengths(lengths)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}.")
    if len(sizes) < world_size:
        raise ValueError(
            f"A batch of {len(sizes)} trajectories cannot be split over {world_size} ranks (each needs at "
            "least one); use train_batch_size >= num_learners."
        )
    loads = [0] * world_size
    members: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        r = min(range(world_size), key=lambda k: (loads[k], len(members[k]), k))
        loads[r] += sizes[i]
        members[r].append(i)
    return tuple(tuple(sorted(m)) for m in members)


def split_into_micro_batches(
    lengths: Sequence[int] | torch.Tensor,
    indices: Sequence[int],
    max_tokens_per_micro_batch: int | None,
) -> tuple[MicroBatchMembers, ...]:
    """Group the trajectories ``indices`` (into ``lengths``) into micro-batches under the token budget.

    First-fit decreasing: longest first (ties: lower index), each into the first micro-batch it fits
    in, else a new one. A trajectory longer than the budget gets a micro-batch of its own. With
    ``max_tokens_per_micro_batch=None`` all of them form one micro-batch.
    """
    sizes = _check_lengths(lengths)
    if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 1:
        raise ValueError(
            f"max_tokens_per_micro_batch must be >= 1 or None; got {max_tokens_per_micro_batch}."
        )
    if len(set(indices)) != len(indices) or any(not 0 <= i < len(sizes) for i in indices):
        raise ValueError(f"indices must be distinct rows in [0, {len(sizes)}); got {list(indices)}.")
    if not indices:
        return ()
    budget = max_tokens_per_micro_batch
    if budget is None:
        ordered = sorted(indices)
        return (MicroBatchMembers(indices=tuple(ordered), lengths=tuple(sizes[i] for i in ordered)),)
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(indices, key=lambda j: (-sizes[j], j)):
        n = sizes[i]
        # An over-budget trajectory fits nowhere and opens its own bin, whose load (> budget) then
        # admits nothing else: it stays alone.
        k = next((k for k, load in enumerate(loads) if load + n <= budget), None)
        if k is None:
            bins.append([i])
            loads.append(n)
        else:
            bins[k].append(i)
            loads[k] += n
    plans = []
    for members in bins:
        ordered = sorted(members)
        over = len(ordered) == 1 and sizes[ordered[0]] > budget
        plans.append(
            MicroBatchMembers(indices=tuple(ordered), lengths=tuple(sizes[i] for i in ordered), over_budget=over)
        )
    return tuple(plans)


def plan_micro_batches(
    lengths: Sequence[int] | torch.Tensor,
    *,
    world_size: int = 1,
    max_tokens_per_micro_batch: int | None = None,
) -> BatchLayout:
    """The layout of a global batch: balanced ranks, then micro-batches under the budget.

    Args:
        lengths: ``[B]`` token count of every trajectory (``TrainBatch.attention_mask.sum(-1)``).
        world_size: number of data-parallel ranks.
        max_tokens_per_micro_batch: packed tokens allowed in one forward pass; None for one pass per rank.
    """
    sizes = _check_lengths(lengths)  # one read-back of a tensor, then plain ints for every rank
    members = assign_to_ranks(sizes, world_size)
    ranks = tuple(
        RankShare(rank=r, micro_batches=split_into_micro_batches(sizes, idx, max_tokens_per_micro_batch))
        for r, idx in enumerate(members)
    )
    return BatchLayout(
        world_size=world_size, max_tokens_per_micro_batch=max_tokens_per_micro_batch, ranks=ranks
    )


# --------------------------------------------------------------------------------------------------
# Packing
@dataclass(frozen=True)
class PackedSequences:
    """S sequences concatenated into one row, without padding."""

    input_ids: torch.Tensor
    """[1, N] long: the real tokens of every row, row after row."""
    position_ids: torch.Tensor
    """[1, N] long: each token's position inside its own sequence (restarts at 0)."""
    cu_seqlens: torch.Tensor
    """[S + 1] int32: sequence ``s`` occupies packed columns ``cu_seqlens[s]:cu_seqlens[s + 1]`` (a row's
    segments are sequences of their own: then one entry per segment)."""
    max_seqlen: int
    """Length of the longest sequence (what varlen attention kernels want next to ``cu_seqlens``)."""
    row_mask: torch.Tensor
    """[S, T] bool: where the packed tokens came from, and where :func:`unpack_rows` puts results."""

    @property
    def num_sequences(self) -> int:
        """Packed sequences (rows' segments count one each)."""
        return int(self.cu_seqlens.shape[0]) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def pack_rows(
    token_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    lengths: Sequence[int] | None = None,
    positions: torch.Tensor | None = None,
) -> PackedSequences:
    """Concatenate the real tokens of ``token_ids`` [S, T] (``attention_mask`` True) into one row.

    Positions count real tokens only, as ``flashrl.models.compute_token_logprobs`` does, so a right-padded
    row gets ``0, 1, ..., n - 1``. Every row needs at least one real token. ``lengths``: each row's real
    token count when the caller already knows it on the host (a ``MicroBatchMembers`` does), which spares
    reading it back from the device; it must match ``attention_mask``.

    ``positions``: [S, T] the rows' own position ids (``TrainBatch.segment_positions``), restarting at 0
    where a segment of a row starts. Every segment is then a packed sequence of its own (``cu_seqlens``
    and ``max_seqlen`` count segments, which costs one read-back), so attention stays inside it.
    """
    if token_ids.dim() != 2 or attention_mask.shape != token_ids.shape:
        raise ValueError(
            f"token_ids and attention_mask must both be [S, T]; got {tuple(token_ids.shape)} and "
            f"{tuple(attention_mask.shape)}."
        )
    mask = attention_mask.to(torch.bool)  # [S, T]
    row_lengths = mask.sum(-1)  # [S]
    if lengths is None:
        lengths = row_lengths.tolist()
    if len(lengths) != mask.shape[0] or min(lengths) < 1:
        empty = [i for i, n in enumerate(lengths) if n < 1]
        raise ValueError(
            f"Every row to pack needs at least one real token; rows {empty} have none (expected one length "
            f"per row, {mask.shape[0]}; got {len(lengths)})."
        )
    if positions is None:
        packed_positions = (mask.long().cumsum(-1) - 1)[mask]  # [N] index among the row's real tokens
        cu_seqlens = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=token_ids.device)  # [S + 1]
        cu_seqlens[1:] = row_lengths.cumsum(0)
        longest = int(max(lengths))
    else:
        if positions.shape != mask.shape:
            raise ValueError(f"positions must be [S, T] like token_ids {tuple(mask.shape)}; got {tuple(positions.shape)}.")
        packed_positions = positions.to(token_ids.device)[mask]  # [N] restarting at every segment
        end = torch.tensor([packed_positions.shape[0]], device=token_ids.device)  # [1]
        cu_seqlens = torch.cat([(packed_positions == 0).nonzero().flatten(), end]).to(torch.int32)  # [segments + 1]
        longest = int(cu_seqlens.diff().max())
    return PackedSequences(
        input_ids=token_ids[mask].unsqueeze(0),  # [1, N]
        position_ids=packed_positions.unsqueeze(0),  # [1, N]
        cu_seqlens=cu_seqlens,
        max_seqlen=longest,
        row_mask=mask,
    )


def unpack_rows(values: torch.Tensor, packed: PackedSequences) -> torch.Tensor:
    """Per-token ``values`` [1, N] (or [N]) back into the [S, T] layout of the packed rows; 0 elsewhere.

    Differentiable w.r.t. ``values``: the loss computed on the [S, T] result back-propagates into the
    packed forward pass.
    """
    flat = values.reshape(-1) if values.dim() == 2 and values.shape[0] == 1 else values  # [N]
    if flat.dim() != 1 or flat.shape[0] != packed.num_tokens:
        raise ValueError(
            f"values must be [1, {packed.num_tokens}] or [{packed.num_tokens}] (one per packed token); got "
            f"{tuple(values.shape)}."
        )
    return flat.new_zeros(packed.row_mask.shape).masked_scatter(packed.row_mask, flat)  # [S, T]


def gather_rows(
    batch: TrainBatch,
    indices: Sequence[int],
    *,
    index: torch.Tensor | None = None,
    num_columns: int | None = None,
) -> TrainBatch:
    """The rows ``indices`` of ``batch``, in that order, with padding trimmed to their longest row.

    ``TrainBatch.rows`` takes a contiguous slice; a micro-batch's rows are any subset. Every field is
    gathered by its layout, so a per-episode field added to ``TrainBatch`` later comes along: per-token
    ``[B, T, ...]`` tensors (the routed experts' ``[B, T, layers, top_k]`` too) by row and trimmed,
    ``[B]`` tensors and lists by row, ``None`` stays ``None``.

    A learner gathers every micro-batch from a batch on its device and knows the rows' lengths, so it
    may pass ``index`` (``indices`` as a long tensor on the batch's device: no host-to-device copy per
    call) and ``num_columns`` (the longest row's length: no read-back from the device).
    """
    if len(indices) == 0:
        raise ValueError("gather_rows needs at least one row index; got none.")
    b = batch.batch_size
    if any(not 0 <= i < b for i in indices):
        raise ValueError(f"Row indices must lie in [0, {b}); got {list(indices)}.")
    device = batch.token_ids.device
    if index is None:
        index = torch.as_tensor(list(indices), dtype=torch.long, device=device)  # [b]
    elif index.shape != (len(indices),) or index.device != device:
        raise ValueError(
            f"index must be the {len(indices)} indices as a [{len(indices)}] tensor on {device}; got shape "
            f"{tuple(index.shape)} on {index.device}."
        )
    t = int(batch.attention_mask[index].sum(-1).max()) if num_columns is None else num_columns
    gathered = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            gathered[f.name] = value[index.to(value.device), :t]  # [b, t, ...]
        elif isinstance(value, torch.Tensor) and value.dim() == 1:
            gathered[f.name] = value[index.to(value.device)]  # [b]
        elif isinstance(value, list):
            gathered[f.name] = [value[i] for i in indices]
    return batch.derived(**gathered)  # rows of a valid batch are valid: no re-validation (host syncs)
