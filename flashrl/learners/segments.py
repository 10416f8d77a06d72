"""Episodes of several segments: each segment is recomputed on its own context.

An agent that edits or summarises its conversation sends a prompt that does not extend the tokens it
saw before; the model then saw that call's sequence from its own start. Such an episode
(``Episode.segment_starts``) is its segments one after another in ``token_ids``. The learner must
score every segment as the engine did: positions from 0, attention inside the segment only, and the
first token of a segment unscored, as position 0 of a row is.

``TrainBatch.segment_positions`` [B, T] carries the structure: each real token's position inside its
segment, 0 at every segment start (and on padding). The learner then scores the rows either

* packed (``flashrl.learners.packing.pack_rows`` with ``positions``): every segment is a packed
  sequence of its own, since packed attention restarts where the position ids restart at 0; or
* padded (:func:`split_segments`, :func:`to_segments`, :func:`from_segments`): the ``[b, t]`` rows are
  laid out as ``[S, Ts]`` rows, one per segment, scored, and the ``[S, Ts]`` results folded back into
  the ``[b, t]`` rows, differentiably.

Either way the per-token results sit where the loss expects them, so the loss is unchanged: the trust
region's mean drift and Sample-Mean Optimization's per-episode mean run over all of an episode's
sampled tokens across its segments, and every episode weighs 1/B (``docs/design.md`` §1).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "SegmentSplit",
    "from_segments",
    "segment_positions",
    "segment_positions_problem",
    "split_segments",
    "to_segments",
]


def segment_positions(starts: Sequence[Sequence[int] | None], lengths: Sequence[int], num_columns: int) -> torch.Tensor | None:
    """[B, T] long: each token's position inside its segment (0 on padding); None if no row has two segments.

    ``starts[i]`` is episode ``i``'s ``Episode.segment_starts`` (None: one segment), ``lengths[i]`` its
    token count, ``num_columns`` the batch's T.
    """
    if all(s is None or len(s) <= 1 for s in starts):
        return None
    out = torch.zeros(len(lengths), num_columns, dtype=torch.long)  # [B, T]
    for i, (row_starts, n) in enumerate(zip(starts, lengths, strict=True)):
        bounds = [*(row_starts or [0]), n]
        for a, b in itertools.pairwise(bounds):
            out[i, a:b] = torch.arange(b - a)
    return out


def segment_positions_problem(positions: torch.Tensor, attention_mask: torch.Tensor,
                              loss_mask: torch.Tensor) -> str | None:
    """Why ``positions`` [B, T] is not a valid ``TrainBatch.segment_positions`` for these masks, or None.

    Valid: 0 at column 0 and on padding; on a real token at column ``t > 0`` either the previous
    position + 1, or 0 (a segment starts) on a token outside ``loss_mask``.
    """
    if not (isinstance(positions, torch.Tensor) and positions.dtype == torch.int64
            and positions.shape == attention_mask.shape):
        return (f"must be None or a [{', '.join(map(str, attention_mask.shape))}] int64 tensor; got "
                f"{getattr(positions, 'shape', type(positions).__name__)} {getattr(positions, 'dtype', '')}")
    mask = attention_mask.to(positions.device)  # [B, T]
    if bool((positions[~mask] != 0).any()) or bool((positions[:, 0] != 0).any()):
        return "must be 0 at column 0 and on padding"
    following = positions[:, 1:] == positions[:, :-1] + 1  # [B, T-1]
    restart = (positions[:, 1:] == 0) & ~loss_mask[:, 1:].to(positions.device)  # [B, T-1]
    bad = mask[:, 1:] & ~(following | restart)  # [B, T-1]
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        return (f"must count 0, 1, 2, ... inside each segment and restart at 0 only on a prompt token "
                f"(loss_mask False); row {row} has {int(positions[row, col + 1])} at column {col + 1} after "
                f"{int(positions[row, col])} (loss_mask {bool(loss_mask[row, col + 1])})")
    return None


@dataclass(frozen=True)
class SegmentSplit:
    """Where the tokens of ``b`` rows go when each of their S segments becomes a right-padded row."""

    row_mask: torch.Tensor
    """[b, t] bool: the real tokens of the rows (row after row, they are the segments' tokens in order)."""
    mask: torch.Tensor
    """[S, Ts] bool: the real tokens of the segment rows; ``Ts`` is the longest segment."""


def split_segments(positions: torch.Tensor, attention_mask: torch.Tensor) -> SegmentSplit:
    """The layout of one row per segment of the ``[b, t]`` rows (one read-back of the segment lengths).

    A segment starts at every real token whose position is 0; each row starts one, so no segment
    spans two rows.
    """
    row_mask = attention_mask.to(torch.bool)  # [b, t]
    flat = positions[row_mask]  # [N] the real tokens, row after row
    starts = (flat == 0).nonzero().flatten()  # [S]
    end = torch.tensor([flat.shape[0]], device=flat.device)  # [1]
    lengths = torch.cat([starts, end]).diff()  # [S]
    longest = int(lengths.max())  # the shape of the segment rows: the one read-back
    mask = torch.arange(longest, device=flat.device).unsqueeze(0) < lengths.unsqueeze(1)  # [S, Ts]
    return SegmentSplit(row_mask=row_mask, mask=mask)


def to_segments(values: torch.Tensor, split: SegmentSplit, fill: float = 0) -> torch.Tensor:
    """``values`` [b, t, ...] laid out as [S, Ts, ...], one row per segment; ``fill`` on padding."""
    out = values.new_full((*split.mask.shape, *values.shape[2:]), fill)  # [S, Ts, ...]
    out[split.mask] = values[split.row_mask]
    return out


def from_segments(values: torch.Tensor, split: SegmentSplit) -> torch.Tensor:
    """Per-segment ``values`` [S, Ts] back into the [b, t] rows; 0 on padding. Differentiable w.r.t. ``values``."""
    return values.new_zeros(split.row_mask.shape).masked_scatter(split.row_mask, values[split.mask])  # [b, t]
