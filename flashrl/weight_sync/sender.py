"""A learner rank's side of weight sync: the ``WeightSender`` interface and the ``WeightExtractor`` it sends from.

A transport's learner half is a ``WeightSender``: it takes the typed messages it declares
(``messages``) and sends the learner's weights the transport's way. What it sends comes from a
``WeightExtractor`` the learner hands in (SkyRL's "weight extractor"): the manifest and the buckets
of a possibly sharded policy, gathered by the learners' own code (``flashrl.learners.weight_gather``
over ``flashrl.learners.fsdp``), so this package never imports the learners.

A learner rank holds one of each registered transport's sender behind one
``flashrl.weight_sync.endpoints.WeightOutbox``, which ``Learner.sync_weights`` hands every message to.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from flashrl.weight_sync.wire import WeightManifest, WeightNames

if TYPE_CHECKING:
    import torch

__all__ = ["LearnerMessage", "WeightExtractor", "WeightSender"]


class LearnerMessage:
    """Base of the typed messages a learner rank takes (frozen dataclasses, one per request)."""


class WeightExtractor(Protocol):
    """A learner's weights as bounded buckets: what every sender sends (``flashrl.learners.weight_gather``).

    ``manifest`` declares the buckets without gathering anything; ``buckets`` materialises them one at
    a time (for a sharded policy a collective: every rank consumes it to the end). ``names``: the
    learner's state-dict names (``model``) or the checkpoint's (``checkpoint``, what vLLM loads).
    """

    @property
    def device(self) -> torch.device | str:
        """Where the learner's tensors live (a push gathers each tensor there)."""
        ...

    def manifest(self, bucket_bytes: int, names: WeightNames) -> WeightManifest: ...

    def buckets(
        self, manifest: WeightManifest, names: WeightNames, device: torch.device | str | None
    ) -> Iterator[dict[str, torch.Tensor]]: ...


class WeightSender(ABC):
    """A transport's learner half, one per learner rank.

    Args:
        weights: the learner's weights (``WeightExtractor``).
        rank: this learner's rank; rank 0 sends, the others join the gathers (collectives).
        version: the learner's current version.
    """

    messages: ClassVar[tuple[type[LearnerMessage], ...]]
    """The message types this sender takes (no two registered senders share one)."""

    def __init__(self, weights: WeightExtractor, *, rank: int, version: Callable[[], int]) -> None:
        self.weights = weights
        self.rank = rank
        self.version = version

    @abstractmethod
    def handle(self, message: LearnerMessage) -> Any:
        """Act on one of ``messages``; returns what the message asks for."""
