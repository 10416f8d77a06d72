"""What a transport is: one way new weights travel from the learners to the env runners' engines.

A transport (``shm``, ``nccl``, ``ipc``: one file each) is a ``Transport``: its name, its learner
half (a ``flashrl.weight_sync.sender.WeightSender``), its runner half (a
``flashrl.weight_sync.receiver.WeightReceiver``), the driver's side (``route``: a
``WeightSyncRoute``) and what a vLLM engine needs to start with it (``engine_args``,
``engine_environment``). ``flashrl.weight_sync.registry`` names them.

The driver's side is route-blind: ``setup`` once, ``push`` after each applied update,
``after_restore`` after a checkpoint restore, ``stop`` at the end. It talks to the learners and the
runners only through ``Learners.sync_weights`` (typed learner messages) and the runner group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol

from flashrl.weight_sync.messages import PutBuckets
from flashrl.weight_sync.receiver import WeightReceiver
from flashrl.weight_sync.sender import LearnerMessage, WeightSender
from flashrl.weight_sync.wire import DEFAULT_BUCKET_BYTES, WEIGHT_NAMES

__all__ = ["Learners", "Runners", "Transport", "WeightSyncRoute"]


class Learners(Protocol):
    """What a route needs of the learners (``flashrl.learners.LearnerGroup``)."""

    @property
    def version(self) -> int: ...

    def sync_weights(self, message: LearnerMessage) -> Any: ...


class Runners(Protocol):
    """What a route needs of the env runners (``flashrl.env_runners.EnvRunnerGroup``)."""

    @property
    def actors(self) -> list[Any]: ...

    @property
    def transfer_workers(self) -> list[int]: ...

    @property
    def generation(self) -> int: ...

    def check_alive(self) -> int: ...

    def broadcast_weights(self, version: int, weights_ref: Any, *, wait: bool = False) -> float: ...

    def set_weights_source(self, source: Callable[[], tuple[int, Any]] | None) -> None: ...


class WeightSyncRoute(ABC):
    """How new weights reach the runners; the driver calls it the same way whatever the transport."""

    name: str
    """The transport, as the engines resolved ``weight_sync`` (``shm``, ``nccl``, ``ipc``)."""

    def __init__(self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, weight_names: str = "model") -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive; got {bucket_bytes}.")
        if weight_names not in WEIGHT_NAMES:
            raise ValueError(f"weight_names must be one of {WEIGHT_NAMES}; got {weight_names!r}.")
        self.bucket_bytes = bucket_bytes
        self.weight_names = weight_names
        """How the streamed buckets name the tensors: what the engines load (``flashrl.learners.weight_gather``)."""

    @property
    def num_formations(self) -> int:
        """How many times a transfer group was formed (0: this route forms none)."""
        return 0

    def setup(self, learners: Learners, runners: Runners) -> None:
        """Prepare the route before the first update (nothing to prepare unless overridden)."""

    @abstractmethod
    def push(self, learners: Learners, runners: Runners) -> float:
        """Send the learners' current weights to every runner; returns the seconds it took."""

    def after_restore(self, learners: Learners, runners: Runners) -> float:
        """After a checkpoint restore: load the learners' weights into every runner and wait.

        Every route streams them through the object store here (every engine takes that route,
        whatever it was started with), so ``runners`` may be a new group outside any transfer
        group. Version 0 is the initial policy the runners already serve: nothing is sent.
        """
        if learners.version == 0:
            return 0.0
        return runners.broadcast_weights(learners.version, self.stream(learners), wait=True)

    def stream(self, learners: Learners) -> Any:
        """The learners' current weights as object-store buckets (``shm``'s ``PutBuckets``)."""
        return learners.sync_weights(PutBuckets(self.bucket_bytes, self.weight_names))  # type: ignore[arg-type]

    def stop(self) -> None:
        """Release what the route holds (idempotent; nothing unless overridden)."""


class Transport(ABC):
    """One way new weights travel; subclasses fill the class attributes and ``route``."""

    name: ClassVar[str]
    """What the engine option ``weight_sync`` names it (the registry's key)."""
    sender: ClassVar[type[WeightSender]]
    """The learner half (one per learner rank)."""
    receiver: ClassVar[type[WeightReceiver]]
    """The runner half (one per env runner)."""

    @abstractmethod
    def route(self, facts: Mapping[str, Any], *, wait_for_load: bool, bucket_bytes: int) -> WeightSyncRoute:
        """The driver's side, from an EnvRunner's setup facts (``EnvRunnerGroup.setup()``)."""

    def engine_args(self) -> dict[str, object]:
        """The ``vllm.AsyncEngineArgs`` fields this transport needs (none unless overridden)."""
        return {}

    def engine_environment(self) -> dict[str, str]:
        """Environment a vLLM engine's process needs, set before vLLM starts (none unless overridden)."""
        return {}
