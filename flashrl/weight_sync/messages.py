"""The streamed weights' two messages, which every transport falls back to.

Every engine loads a ``WeightBuckets`` stream of object refs, whatever transport it was started
with: a runner restarted outside a transfer group, and every runner after a checkpoint restore, get
their weights this way. So these two are shared by all transports (``shm`` handles them:
``flashrl.weight_sync.shm``); a transport's own messages live in its file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashrl.weight_sync.receiver import RunnerMessage
from flashrl.weight_sync.sender import LearnerMessage
from flashrl.weight_sync.wire import DEFAULT_BUCKET_BYTES, WeightNames

__all__ = ["LoadWeights", "PutBuckets"]


@dataclass(frozen=True)
class PutBuckets(LearnerMessage):
    """To every learner rank: gather the weights into the object store, one ``ray.put`` per bucket.

    Answer: a ``WeightBuckets`` of object refs (rank 0; None on the other ranks, which only join
    the gathers).
    """

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    names: WeightNames = "model"
    """``model`` (the learner's state-dict names) or ``checkpoint`` (what vLLM loads)."""


@dataclass(frozen=True)
class LoadWeights(RunnerMessage):
    """To a runner: load ``weights`` as version ``version`` while sampling goes on.

    ``weights``: a full ``{name: tensor}`` dict (or an object ref of one, resolved before anything
    else) or a ``WeightBuckets`` stream (``PutBuckets``' answer).
    Answer: the version the runner now serves (-1 once it stopped).
    """

    version: int
    weights: Any
    """``flashrl.weight_sync.buckets.Weights``."""
