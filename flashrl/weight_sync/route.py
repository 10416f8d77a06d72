"""A run's weight-sync route: the driver's side of the transport the runners' engines resolved.

``route_for(facts)`` picks it once at setup (an EnvRunner's setup facts carry ``weight_sync``, see
``flashrl.weight_sync.resolve``) from the registry (``flashrl.weight_sync.registry``); the driver
then calls the ``WeightSyncRoute`` the same way whatever the transport (``setup`` once, ``push``
after each applied update, ``after_restore`` after a checkpoint restore, ``stop`` at the end):

- ``shm`` (``flashrl.weight_sync.shm.ShmRoute``; CPU and the fallback everywhere): the learner puts
  its weights into the object store bucket by bucket and the runners pull them
  (``EnvRunnerGroup.broadcast_weights``). With ``wait_for_load`` (the ``sync_group`` mode: the next
  round must sample from the new weights) a push returns once every runner has loaded them; without
  it (async) the runners load while they keep sampling.
- ``nccl`` / ``ipc`` (``flashrl.weight_sync.push.PushRoute``; GPU): the learners send straight into
  the runners' vLLM workers through vLLM's weight-transfer engines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flashrl.weight_sync.layout import TransferLayout, check_route
from flashrl.weight_sync.registry import TRANSPORTS, transport
from flashrl.weight_sync.resolve import ROUTE_NAMES
from flashrl.weight_sync.transport import WeightSyncRoute
from flashrl.weight_sync.wire import DEFAULT_BUCKET_BYTES

__all__ = ["route_for"]


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
    if name not in TRANSPORTS:
        raise ValueError(
            f"the env runners' engines report weight_sync={name!r}; expected one of {ROUTE_NAMES}. Fix: the "
            "engine resolves its weight_sync option (flashrl.weight_sync.resolve.resolve_weight_sync) and the "
            "EnvRunner reports it in its setup facts."
        )
    if layout is not None:
        check_route(name, layout)  # shm: always fine
    return transport(name).route(facts, wait_for_load=wait_for_load, bucket_bytes=bucket_bytes)
