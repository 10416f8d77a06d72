"""Joining or starting a Ray cluster, and checking a run's resource requests against it."""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("flashrl")


def init_or_join(
    *, include_dashboard: bool = False, framework_log_level: str | None = None, **init_kwargs: Any
) -> str:
    """Make sure this process is connected to a Ray cluster.

    Order: an already initialised connection is used as is; else the cluster named by the
    `RAY_ADDRESS` environment variable is joined; else a local cluster is started (dashboard off
    unless asked). Returns "existing", "joined" or "started".

    ``framework_log_level`` (a run's setting; None leaves Ray's logging alone) sets the driver's Ray
    logger (``ray.init(logging_level=...)``, unless ``RAY_LOGGER_LEVEL`` is set) and, at WARNING or
    above, drops the known-harmless messages of `flashrl.framework_logging`.
    """
    import ray

    from flashrl.framework_logging import configure_driver, ray_logging_level

    configure_driver(framework_log_level)
    level = ray_logging_level(framework_log_level)
    if level is not None:
        init_kwargs.setdefault("logging_level", level)

    if ray.is_initialized():
        return "existing"
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **init_kwargs)
        logger.info("Joined the Ray cluster at %s.", address)
        return "joined"
    ray.init(include_dashboard=include_dashboard, **init_kwargs)
    logger.info("Started a local Ray cluster: %s", ray.cluster_resources())
    return "started"


def cluster_resources() -> tuple[dict[str, float], list[dict[str, float]]]:
    """Total resources of the cluster and the resources of each alive node."""
    import ray

    nodes = [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
    return dict(ray.cluster_resources()), nodes


def inside_placement_group() -> bool:
    """True inside a Tune trial (or any task/actor that runs in a placement group)."""
    from ray.util import get_current_placement_group

    return get_current_placement_group() is not None


def check_resources(config: Any) -> None:
    """Raise `ConfigError` if `config` asks for more CPUs/GPUs than the cluster has, or for custom resources
    no alive node could grant (`custom_resource_problems`).

    Inside a Tune trial the placement group already holds the resources (Tune checked them with
    `FlashReinforce.default_resource_request`), so nothing is checked there. A plain driver process
    reserves nothing itself, so its bundle (and a local learner's) is not counted.
    """
    if inside_placement_group():
        return
    total, nodes = cluster_resources()
    config.validate_resources(total, nodes, include_main_process=False)
    config.validate_custom_resources(nodes)


def custom_resource_problems(
    requests: Mapping[str, tuple[int, Mapping[str, float]]], nodes: list[Mapping[str, float]]
) -> list[str]:
    """What Ray could never grant of the actors' custom resources (``custom_resources_per_*``).

    ``requests``: setting name -> (how many actors, the custom resources each asks for); ``nodes``: the
    resources of each alive node (their totals, not what is free now). A name no alive node offers, one
    actor's amount more than any one node offers, or more in all than the alive nodes offer together
    would leave actors pending until the start timeout (``ENGINE_START_TIMEOUT_S``, 15 minutes); a
    resource that is only in use now, or on a node that comes back later, is no problem here (elastic
    runners wait for it). A dead node's resources count as absent: a run does not start on them.
    """
    from flashrl.validation import RAY_BUILTIN_RESOURCES

    offered = _custom_offer(nodes, RAY_BUILTIN_RESOURCES)
    asked_in_all: dict[str, float] = {}
    problems = []
    said: set[str] = set()  # names already wrong for one actor: their total says nothing more
    for setting_name, (count, resources) in requests.items():
        for name, amount in resources.items():
            if count < 1 or amount <= 0:
                continue  # no actor, or nothing asked: nothing to place
            asked_in_all[name] = asked_in_all.get(name, 0.0) + count * float(amount)
            largest = max((float(n.get(name, 0.0)) for n in nodes), default=0.0)
            if amount > largest + 1e-9:
                said.add(name)
            if largest <= 0:
                close = difflib.get_close_matches(name, list(offered), n=1)
                hint = f"rename it to {close[0]!r}" if close else "correct the name"
                problems.append(
                    f"{setting_name}: expected resource names an alive node offers, got {name!r}, which no alive "
                    f"node offers (the nodes offer: {_describe_offer(offered)}). Fix: {hint}, or start a node "
                    f"with it (ray start ... --resources='{{\"{name}\": {amount:g}}}'); otherwise Ray keeps "
                    "the actor pending until the start timeout."
                )
            elif amount > largest + 1e-9:
                problems.append(
                    f"{setting_name}: one actor asks for {name}={amount:g} but the largest node offers "
                    f"{largest:g}. Fix: ask for at most {largest:g} per actor, or start a node that offers more."
                )
    for name, asked in asked_in_all.items():
        have = sum(float(n.get(name, 0.0)) for n in nodes)
        if name not in said and asked > have + 1e-9:
            problems.append(
                f"{name}: the learners and env runners ask for {asked:g} in all but the alive nodes offer {have:g} "
                f"together. Fix: lower the per-actor amount or the number of actors, or add a node with {name}."
            )
    return problems


def _custom_offer(nodes: list[Mapping[str, float]], builtin: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """Custom resource name -> (total over the nodes, largest on one node); Ray's own ``node:<ip>`` left out."""
    offer: dict[str, tuple[float, float]] = {}
    for node in nodes:
        for name, amount in node.items():
            if name in builtin or name.startswith("node:"):
                continue
            total, largest = offer.get(name, (0.0, 0.0))
            offer[name] = (total + float(amount), max(largest, float(amount)))
    return offer


def _describe_offer(offer: Mapping[str, tuple[float, float]]) -> str:
    if not offer:
        return "no custom resources"
    return ", ".join(f"{name}={total:g} (largest node {largest:g})" for name, (total, largest) in sorted(offer.items()))
