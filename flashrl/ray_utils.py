"""Joining or starting a Ray cluster, and checking a run's resource requests against it."""

from __future__ import annotations

import logging
import os
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
    """Raise `ConfigError` if `config` asks for more CPUs/GPUs than the cluster has.

    Inside a Tune trial the placement group already holds the resources (Tune checked them with
    `FlashReinforce.default_resource_request`), so nothing is checked there. A plain driver process
    reserves nothing itself, so its bundle (and a local learner's) is not counted.
    """
    if inside_placement_group():
        return
    total, nodes = cluster_resources()
    config.validate_resources(total, nodes, include_main_process=False)
