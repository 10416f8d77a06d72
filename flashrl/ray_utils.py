"""Joining or starting a Ray cluster, and checking a run's resource requests and its nodes against it.

The node check (``check_cluster_nodes``): a node with another Ray, flashrl or Python version than the
driver's joins the cluster (Ray checks its own version and Python's when a node joins, flashrl's
never) and fails later inside an actor, with an unpickling error or a missing setting that names no
node. A checkpoint folder that some node cannot write, or that is that node's own disk instead of
storage every node shares, fails at the first checkpoint, an interval into the run. Both are checked
at setup, in seconds, by one tiny task per alive node (``NodeAffinitySchedulingStrategy``, no CPU
reserved): the node reports its versions and probes the folder: it reads the probe file the driver
wrote there (the folder is shared), writes and reads back one of its own (it can write). The
driver's own node is checked in the driver's process (a single-node run starts no task).
``NodeCheckError`` names each node, what differs and the fix.

``kill_and_confirm`` is the fault drills' kill: it returns only once the actor is seen dead.
"""

from __future__ import annotations

import difflib
import logging
import os
import platform
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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


# ------------------------------------------------------------------------------------ node check
PROBE_PREFIX = ".flashrl_node_probe_"
"""Probe files' names in a checked folder (removed again by whoever wrote them)."""
REPORT_TIMEOUT_S = 120.0
"""How long the driver waits for every node's report (a worker process starts on each node); flashrl's own choice."""


class NodeCheckError(RuntimeError):
    """A node of the cluster differs from the driver's, or cannot use the run's storage folder."""


@dataclass(frozen=True)
class NodeReport:
    """What one node says about itself: its versions and the folders it could not use."""

    node: str
    """The node's address and Ray node id (``10.0.0.2 (node 3f2a...)``)."""
    versions: Mapping[str, str]
    """``python`` (major.minor), ``ray``, ``flashrl``."""
    folder_errors: Mapping[str, str] = field(default_factory=dict)
    """Folder -> why this node cannot use it (empty: it can)."""


def local_versions() -> dict[str, str]:
    """This process's Python (major.minor: what pickles must agree on), Ray and flashrl versions."""
    import ray

    import flashrl

    return {"python": ".".join(platform.python_version_tuple()[:2]), "ray": ray.__version__,
            "flashrl": flashrl.__version__}  # fmt: skip


def probe_folder(folder: str, *, expect: tuple[str, str] | None = None) -> str | None:
    """Why this process cannot use ``folder`` as the run's storage (None: it can).

    ``expect``: the driver's probe (file name, content), which a node sharing the folder reads back.
    The folder is created if missing and, when this call created it, removed again (only empty ones).
    """
    if expect is not None:
        try:
            with open(os.path.join(folder, expect[0]), encoding="utf-8") as f:
                seen = f.read()
        except OSError as error:
            return (f"cannot read the probe file the driver wrote there ({error.strerror or error}): the folder "
                    "is not storage this node shares with the driver")
        if seen != expect[1]:
            return "reads another file than the driver wrote there: the folder is not shared with the driver"
    created = _first_missing(folder)
    name = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    try:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(name)
        with open(path, encoding="utf-8") as f:
            if f.read() != name:
                return "a file written there reads back different"
        os.remove(path)
    except OSError as error:
        return f"cannot write there ({error.strerror or error})"
    finally:
        _remove_created(folder, created)
    return None


def _first_missing(folder: str) -> str | None:
    """The outermost folder of ``folder``'s path that does not exist yet (None: it exists)."""
    missing, path = None, os.path.abspath(folder)
    while not os.path.exists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _remove_created(folder: str, created: str | None) -> None:
    """Remove the empty folders from ``folder`` up to ``created`` (what a probe made)."""
    if created is None:
        return
    path = os.path.abspath(folder)
    while True:
        try:
            os.rmdir(path)
        except OSError:
            return  # not empty (someone else writes there) or already gone
        if path == created:
            return
        path = os.path.dirname(path)


def node_report(node: str, folders: Mapping[str, tuple[str, str]]) -> NodeReport:
    """This node's report: its versions and ``probe_folder`` of each folder (folder -> the driver's probe)."""
    errors = {folder: error for folder, probe in folders.items()
              if (error := probe_folder(folder, expect=probe)) is not None}  # fmt: skip
    return NodeReport(node=node, versions=local_versions(), folder_errors=errors)


def compare_nodes(driver: Mapping[str, str], reports: Sequence[NodeReport]) -> list[str]:
    """Every problem of ``reports`` against the driver's versions, one line each (empty: none)."""
    problems = []
    for report in reports:
        differ = [f"{name} {report.versions.get(name, 'missing')} (the driver has {version})"
                  for name, version in driver.items() if report.versions.get(name) != version]  # fmt: skip
        if differ:
            problems.append(
                f"node {report.node} runs {', '.join(differ)}. Fix: install the driver's versions on every node "
                f"({_versions_text(driver)}; the same image or environment everywhere), or start that node's "
                "Ray from the driver's environment"
            )
        for folder, error in report.folder_errors.items():
            problems.append(
                f"node {report.node} {error}: {folder}. Fix: put the run's storage (checkpoint_dir, the output "
                "folder) on a filesystem every node mounts read-write at the same path (NFS, a cluster "
                "filesystem), writable by the user Ray runs as"
            )
    return problems


def check_cluster_nodes(folders: Sequence[str], *, timeout_s: float = REPORT_TIMEOUT_S) -> None:
    """Check every alive node of the connected Ray cluster against the driver (module docstring).

    ``folders``: the run's storage folders every node must share and write (the checkpoint folder).
    Raises ``NodeCheckError`` listing every problem.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    probes: dict[str, tuple[str, str]] = {}
    reports: list[NodeReport] = []
    created = {folder: _first_missing(folder) for folder in folders}  # removed again at the end
    try:
        for folder in folders:  # the driver's node first: it writes the probe the others read
            try:
                os.makedirs(folder, exist_ok=True)
                error = probe_folder(folder)
            except OSError as failed:
                error = f"cannot write there ({failed.strerror or failed})"
            if error is not None:
                reports.append(NodeReport(node=f"{_address(here)} (the driver's)", versions=local_versions(),
                                          folder_errors={folder: error}))
                continue
            name = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
            with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                f.write(name)
            probes[folder] = (name, name)
        others = [node for node in ray.nodes() if node.get("Alive") and node["NodeID"] != here]
        remote = ray.remote(num_cpus=0, max_retries=0)(node_report)
        refs = {
            remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(
                _describe(node), probes): _describe(node)
            for node in others
        }  # fmt: skip
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        failed = []
        for ref in ready:
            try:
                reports.append(ray.get(ref))
            except ray.exceptions.RayError as error:  # e.g. a Python whose pickles differ cannot run the task
                failed.append(f"node {refs[ref]} could not run the check ({type(error).__name__}: "
                              f"{str(error).strip().splitlines()[-1][:300]}). Fix: give every node the driver's "
                              f"environment ({_versions_text(local_versions())})")
    finally:
        for folder, (name, _) in probes.items():
            try:
                os.remove(os.path.join(folder, name))
            except OSError:
                pass  # the check's verdict stands; a stray probe file is harmless
        for folder, first in created.items():
            _remove_created(folder, first)
    problems = compare_nodes(local_versions(), reports) + failed
    problems += [f"node {refs[ref]} did not report within {timeout_s:.0f} s. Fix: check that node's Ray logs "
                 "(it is alive but starts no worker process)" for ref in pending]  # fmt: skip
    if problems:
        raise NodeCheckError("The cluster's nodes cannot run this job as they are:\n  - " + "\n  - ".join(problems))


def _versions_text(versions: Mapping[str, str]) -> str:
    return f"python {versions.get('python')}, ray=={versions.get('ray')}, flashrl=={versions.get('flashrl')}"


def _describe(node: Mapping[str, object]) -> str:
    return f"{node.get('NodeManagerAddress', '?')} (node {str(node['NodeID'])[:12]})"


def _address(node_id: str) -> str:
    import ray

    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return _describe(node)
    return f"node {node_id[:12]}"


def kill_and_confirm(actor: Any, *, timeout_s: float = 30.0) -> None:
    """Kill ``actor`` (no restart) and return once a call to it fails (fault drills and tests).

    ``ray.kill`` only asks: a call made just after it can still reach the live process and be
    answered, so a drill that kills a runner and at once checks for the death could find it alive.
    Each probe is the actor's built-in ``__ray_ready__`` call; any ``RayActorError`` confirms the death.
    """
    import time

    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=1.0)
        except RayActorError:
            return
        except GetTimeoutError:  # a busy actor queues the probe: the kill ends it, ask again
            continue
        time.sleep(0.05)
    raise TimeoutError(
        f"ray.kill was sent, but the actor still answered calls after {timeout_s:.0f} s: the Ray "
        "cluster is not delivering the kill (check `ray status` and the raylet log of its node)."
    )
