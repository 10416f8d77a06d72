"""What a ``Learner`` asks of the algorithm: its loss, through one hook, on one micro-batch at a time.

The learner owns the model, the parallelism, micro-batching, gradient accumulation, clipping, the
optimizer step and its schedule; it knows nothing of any particular method. The algorithm hands it a
``Loss`` object (inside ``LearnerSpec.loss``) with one required method::

    loss, metrics = spec.loss.compute_loss(micro_batch, context)

called once per micro-batch, right before that micro-batch's backward pass. ``context`` is what
``Loss.prepare(batch)`` returned for the WHOLE batch, computed once per update and identical on every
data-parallel rank: the batch-global quantities of the method (FlashREINFORCE's advantages and
normalisers, ``docs/design.md`` §1 steps 1 and 4) must come from there, never from the micro-batch, so
that the per-micro-batch losses add up to the loss of the whole batch and their gradients to its
gradient. One optimizer step follows the last micro-batch.

Metrics must add up the same way, so the hook returns them by how they combine (``LossMetrics``):
sums (a mean is a sum divided by a GLOBAL count taken from the context), maxima, minima, and
per-trajectory values, as 0-d (or [b]) tensors on the micro-batch's device, computed without reading
anything back to the host. The learner combines them over micro-batches and ranks on the device and
reads them back once per update.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from flashrl.learners.batch import TrainBatch

__all__ = ["BatchContext", "Loss", "LossMetrics", "MicroBatch"]


@dataclass(frozen=True)
class BatchContext:
    """The batch-global inputs of a loss (extend it with the method's own fields)."""

    batch: TrainBatch
    """The whole batch of the update (the same on every rank)."""
    metrics: dict[str, float | torch.Tensor] = field(default_factory=dict)
    """Batch-level metrics (e.g. the reward mean), reported as they are; 0-d tensors are read back with
    the update's other metrics, in its one transfer."""


@dataclass(frozen=True)
class MicroBatch:
    """The rows of one forward and backward pass, with their current log-probs."""

    rows: TrainBatch
    """[b, t] the rows, right-padded to their longest (a sub-batch of the context's batch)."""
    indices: torch.Tensor
    """[b] long, on the rows' device: each row's index in the whole batch (to slice batch-global [B]
    quantities)."""
    logprobs: torch.Tensor
    """[b, t] current log-probs of every token given its prefix (differentiable; 0 at padding)."""
    entropy: torch.Tensor | None
    """[b, t] entropy of each of those distributions, or None when the loss does not need them."""


@dataclass
class LossMetrics:
    """A micro-batch's metrics, grouped by how they combine over micro-batches and ranks.

    Values are 0-d tensors (floats are accepted too), left on the device: converting them to Python
    floats here would cost a host sync per metric per micro-batch. ``flashrl.learners.Learner`` packs
    each kind into one tensor, reduces it over ranks and reads it back once per update.
    """

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    """Added up (divide by a global count inside the hook to report a mean)."""
    maxes: dict[str, torch.Tensor] = field(default_factory=dict)
    """Maximum over micro-batches and ranks (-inf: no value here)."""
    mins: dict[str, torch.Tensor] = field(default_factory=dict)
    """Minimum over micro-batches and ranks (inf: no value here)."""
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    """[b] per-row values, assembled into a list over the whole batch (by ``MicroBatch.indices``)."""

    def merge(self, other: LossMetrics) -> None:
        """Fold ``other`` (another micro-batch's metrics, same keys) into this one, in place, on the device."""
        if (set(self.sums), set(self.maxes), set(self.mins)) != (set(other.sums), set(other.maxes), set(other.mins)):
            raise ValueError(
                "Every micro-batch must report the same metric keys; got "
                f"{sorted(self.sums) + sorted(self.maxes) + sorted(self.mins)} and "
                f"{sorted(other.sums) + sorted(other.maxes) + sorted(other.mins)}."
            )
        for key, value in other.sums.items():
            self.sums[key] = self.sums[key] + value
        for key, value in other.maxes.items():
            self.maxes[key] = torch.maximum(torch.as_tensor(self.maxes[key]), torch.as_tensor(value))
        for key, value in other.mins.items():
            self.mins[key] = torch.minimum(torch.as_tensor(self.mins[key]), torch.as_tensor(value))


class Loss(ABC):
    """The algorithm's part of an update. Subclasses must be picklable (they travel to learner actors)."""

    needs_entropy: bool = False
    """Ask the learner for the token entropies (one more pass over each vocabulary chunk)."""

    def prepare(self, batch: TrainBatch) -> BatchContext:
        """Batch-global quantities, computed once per update on the WHOLE batch (every rank alike).

        May raise ``ValueError`` for a batch the loss cannot train on (e.g. missing labels): every rank
        raises the same, before any forward pass.
        """
        return BatchContext(batch=batch)

    @abstractmethod
    def compute_loss(self, micro_batch: MicroBatch, context: BatchContext) -> tuple[torch.Tensor, LossMetrics]:
        """This micro-batch's share of the whole batch's loss (a scalar to backpropagate), and its metrics.

        The shares of all micro-batches on all ranks must add up to the loss of the whole batch: divide
        by the context's global normalisers, never by the micro-batch's own size.
        """
