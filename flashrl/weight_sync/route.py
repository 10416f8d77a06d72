"""A run's weight-sync route: how each new policy version gets from the learners into every env runner.

One interface, ``WeightSyncRoute``, chosen once at setup from what the runners' engines resolved
(``route_for(facts)``: an EnvRunner's setup facts carry ``weight_sync``, see
``flashrl.weight_sync.resolve``):

- ``ShmRoute`` (``shm``, CPU and the fallback everywhere): the learner puts its weights into the
  object store bucket by bucket (``LearnerGroup.weight_buckets_refs``) and the runners pull them
  (``EnvRunnerGroup.broadcast_weights``). With ``wait_for_load`` (the ``sync_group`` mode: the next
  round must sample from the new weights) a push returns once every runner has loaded them; without
  it (async) the runners load while they keep sampling.
- ``PushRoute`` (``nccl`` / ``ipc``, GPU): the learners send straight into the runners' vLLM workers
  through vLLM's weight-transfer engines (``flashrl.weight_sync.vllm_push``). The transfer group is
  formed at ``setup`` (a rendezvous failure surfaces there, not mid-run) and again whenever the
  runner set changed.

The driver's side is route-blind: ``setup`` once, ``push`` after each applied update,
``after_restore`` after a checkpoint restore, ``stop`` at the end.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from flashrl.weight_sync.layout import TransferLayout, check_route
from flashrl.weight_sync.resolve import PUSH_ROUTES, ROUTE_NAMES, RouteName
from flashrl.weight_sync.wire import DEFAULT_BUCKET_BYTES, WEIGHT_NAMES, WeightBuckets

__all__ = ["Learners", "PushRoute", "Runners", "ShmRoute", "WeightSyncRoute", "route_for"]


class Learners(Protocol):
    """What a route needs of the learners (``flashrl.learners.LearnerGroup``)."""

    @property
    def version(self) -> int: ...

    def weight_buckets_refs(self, bucket_bytes: int = ..., names: str = ...) -> WeightBuckets: ...

    def start_weight_push(
        self,
        route: str,
        runners: Sequence[Any],
        workers_per_runner: Sequence[int],
        *,
        bucket_bytes: int = ...,
    ) -> None: ...

    def push_weights(self) -> int: ...

    def stop_weight_push(self) -> None: ...


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
    """How new weights reach the runners; the driver calls it the same way whatever the route."""

    name: str
    """The route, as the engines resolved ``weight_sync`` (``shm``, ``nccl``, ``ipc``)."""

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
        weights = learners.weight_buckets_refs(self.bucket_bytes, names=self.weight_names)
        return runners.broadcast_weights(learners.version, weights, wait=True)

    def stop(self) -> None:
        """Release what the route holds (idempotent; nothing unless overridden)."""


class ShmRoute(WeightSyncRoute):
    """Buckets through the object store, pulled by every runner (``shm``).

    Args:
        wait_for_load: return only once every runner has loaded the weights (``sync_group``);
            False (async) returns at once and the runners load while they keep sampling.
        bucket_bytes: bucket size of the learner's ``weight_buckets_refs``.
        weight_names: ``model`` or ``checkpoint``: the names the runners' engines load.
    """

    name = "shm"

    def __init__(
        self, *, wait_for_load: bool, bucket_bytes: int = DEFAULT_BUCKET_BYTES, weight_names: str = "model"
    ) -> None:
        super().__init__(bucket_bytes=bucket_bytes, weight_names=weight_names)
        self.wait_for_load = wait_for_load

    def push(self, learners: Learners, runners: Runners) -> float:
        """The runners' broadcast time (the learner's puts happen before it and are not counted)."""
        weights = learners.weight_buckets_refs(self.bucket_bytes, names=self.weight_names)
        return runners.broadcast_weights(learners.version, weights, wait=self.wait_for_load)


class PushRoute(WeightSyncRoute):
    """Each new version goes from the learners straight into the runners' workers (``nccl`` / ``ipc``).

    ``push`` first pings the runners (``check_alive``: a dead member would leave the others waiting
    inside the collective), forms the transfer group again whenever the runner set changed (a
    restart, or a new runner group after a restore), then has every learner rank send
    (``push_weights``). A push is a collective: it returns once every runner has the weights. A
    replacement runner is outside the group until then, so it first loads the learners' current
    weights through the ``shm`` stream (the route sets the runners' weights source). A runner that
    dies *during* a transfer fails the learners' call (the collective cannot complete); restore from
    the last checkpoint.

    Args:
        route: ``nccl`` or ``ipc`` (what the runners' engines resolved ``weight_sync`` to).
        bucket_bytes: bucket size of the gathers feeding vLLM's packed producer, and of the
            ``shm`` stream a replacement runner loads.
    """

    def __init__(self, route: str, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if route not in PUSH_ROUTES:
            raise ValueError(
                f"PushRoute: route must be one of {PUSH_ROUTES}; got {route!r} (shm is pulled: use ShmRoute)."
            )
        super().__init__(bucket_bytes=bucket_bytes, weight_names="checkpoint")  # vLLM engines only
        self.name: RouteName = route  # type: ignore[assignment]
        self._formations = 0
        self._formed: tuple[Runners, int] | None = None
        """The runner group and its generation the transfer group was formed with."""
        self._learners: Learners | None = None

    @property
    def num_formations(self) -> int:
        """1 + the re-formations after restarts and restores."""
        return self._formations

    def setup(self, learners: Learners, runners: Runners) -> None:
        """Form the transfer group now, so that a rendezvous failure surfaces at setup."""
        self.reform(learners, runners)

    def reform(self, learners: Learners, runners: Runners) -> bool:
        """Form the transfer group over ``runners`` unless formed with these very actors; True if formed.

        Either way ``runners`` get their weights source: a replacement runner, outside the group
        until the next push, loads the learners' current weights through the ``shm`` stream.
        """
        def current() -> tuple[int, WeightBuckets]:
            return learners.version, learners.weight_buckets_refs(self.bucket_bytes, names=self.weight_names)

        runners.set_weights_source(current)
        if self._formed is not None and self._formed[0] is runners and self._formed[1] == runners.generation:
            return False
        learners.start_weight_push(
            self.name, runners.actors, runners.transfer_workers, bucket_bytes=self.bucket_bytes
        )
        self._formed, self._learners = (runners, runners.generation), learners
        self._formations += 1
        return True

    def push(self, learners: Learners, runners: Runners) -> float:
        start = time.perf_counter()
        runners.check_alive()
        self.reform(learners, runners)
        learners.push_weights()
        return time.perf_counter() - start

    def stop(self) -> None:
        """Tear the transfer group down (idempotent)."""
        learners, self._learners = self._learners, None
        if self._formed is not None and learners is not None:
            self._formed = None
            learners.stop_weight_push()


def route_for(
    facts: Mapping[str, Any],
    *,
    wait_for_load: bool,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    layout: TransferLayout | None = None,
) -> WeightSyncRoute:
    """The route of a run, from an EnvRunner's setup facts (``facts["weight_sync"]``).

    Args:
        facts: what ``EnvRunnerGroup.setup()`` returned.
        wait_for_load: for ``shm``, whether a push waits until every runner has loaded (``sync_group``).
        bucket_bytes: bucket size of the learner's gathers.
        layout: the GPUs Ray assigned the learners and the engines; a push route is checked against it
            (``flashrl.weight_sync.layout.check_route``) before any transfer group forms.

    Raises:
        RouteError: the engines were started with a push route these GPUs cannot carry.
    """
    name = facts.get("weight_sync")
    if name == "shm":
        names = str(facts.get("weight_names", "model"))
        return ShmRoute(wait_for_load=wait_for_load, bucket_bytes=bucket_bytes, weight_names=names)
    if name in PUSH_ROUTES:
        if layout is not None:
            check_route(name, layout)
        return PushRoute(name, bucket_bytes=bucket_bytes)
    raise ValueError(
        f"the env runners' engines report weight_sync={name!r}; expected one of {ROUTE_NAMES}. Fix: the "
        "engine resolves its weight_sync option (flashrl.weight_sync.resolve.resolve_weight_sync) and the "
        "EnvRunner reports it in its setup facts."
    )
