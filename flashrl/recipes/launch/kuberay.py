"""`flashrl launch kuberay PRESET`: a KubeRay ``RayJob`` manifest (``ray.io/v1``) that creates a Ray cluster
of the preset's node plan on Kubernetes, runs the tuned example on it and deletes the cluster after.

One pod per planned node: the head pod (``headGroupSpec``) is the plan's first node and runs actors
too, one worker group (``workerGroupSpecs``) holds the others (``replicas`` = ``minReplicas`` =
``maxReplicas`` = nodes - 1: the plan is a fixed cluster). Every pod requests and is limited to one
node's CPUs, memory and GPUs (``nvidia.com/gpu``), and ``rayStartParams`` tell Ray the same counts.
The image must hold flashrl and its tuned examples (a source checkout, or ``FLASHRL_TUNED_EXAMPLES``);
the entrypoint is ``flashrl train <preset> <flags>``. Field names follow KubeRay's RayJob and
RayCluster CRDs (``ray-operator/apis/ray/v1/rayjob_types.go``, ``raycluster_types.go``).
"""

from __future__ import annotations

import shlex
from typing import Any

import yaml

from flashrl.recipes.launch.job import LaunchJob

__all__ = ["rayjob_manifest", "render_rayjob"]


def rayjob_manifest(job: LaunchJob, *, image: str) -> dict[str, Any]:
    """The RayJob of ``job`` as a dict (`render_rayjob` writes it as YAML)."""
    nodes = job.nodes
    params = {"num-cpus": str(nodes.cpus_per_node), "num-gpus": str(nodes.gpus_per_node)}
    quantities: dict[str, Any] = {"cpu": str(nodes.cpus_per_node), "memory": f"{nodes.host_memory_gib:g}Gi"}
    if nodes.gpus_per_node:
        quantities["nvidia.com/gpu"] = str(nodes.gpus_per_node)

    def pod(container: str) -> dict[str, Any]:
        return {"spec": {"containers": [{
            "name": container,
            "image": image,
            "resources": {"requests": dict(quantities), "limits": dict(quantities)},
        }]}}

    workers = nodes.num_nodes - 1
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": job.name},
        "spec": {
            "entrypoint": shlex.join(["flashrl", "train", job.preset.name, *job.script_args]),
            "shutdownAfterJobFinishes": True,
            "rayClusterSpec": {
                "rayVersion": job.preset.pins.get("ray", "").lstrip("=") or None,
                "headGroupSpec": {
                    "rayStartParams": {**params, "dashboard-host": "0.0.0.0"},
                    "template": pod("ray-head"),
                },
                "workerGroupSpecs": [{
                    "groupName": "workers",
                    "replicas": workers,
                    "minReplicas": workers,
                    "maxReplicas": workers,
                    "rayStartParams": dict(params),
                    "template": pod("ray-worker"),
                }],
            },
        },
    }


def render_rayjob(job: LaunchJob, *, image: str) -> str:
    """The RayJob manifest of ``job`` as YAML, headed by a comment saying how to apply it."""
    manifest = rayjob_manifest(job, image=image)
    if manifest["spec"]["rayClusterSpec"]["rayVersion"] is None:
        del manifest["spec"]["rayClusterSpec"]["rayVersion"]
    head = (
        f"# Rendered by `flashrl launch kuberay {job.preset.name}`: {job.nodes.describe()}.\n"
        f"# kubectl apply -f {job.name}.yaml   (the KubeRay operator must be installed)\n"
    )
    return head + yaml.safe_dump(manifest, sort_keys=False, default_flow_style=False)
