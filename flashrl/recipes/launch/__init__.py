"""Launchers: a tuned example as a cluster job, rendered from its preset's node plan (`flashrl launch`).

- ``job``: the tuned example, its flags and the node plan they resolve to, checked (`launch_job`);
- ``slurm``: an sbatch script (Ray head and ``srun`` workers with token auth, ``ray job submit``);
- ``kuberay``: a KubeRay ``RayJob`` manifest (head and worker groups of the plan's pods).

A new target is one file and one line of `TARGETS`. docs/training.md, "Running on a cluster", shows both.
"""

from __future__ import annotations

from collections.abc import Callable

from flashrl.recipes.launch.job import LaunchError, LaunchJob, launch_job
from flashrl.recipes.launch.kuberay import render_rayjob
from flashrl.recipes.launch.slurm import render_sbatch

__all__ = ["TARGETS", "LaunchError", "LaunchJob", "launch_job", "render"]

TARGETS: dict[str, Callable[..., str]] = {"slurm": render_sbatch, "kuberay": render_rayjob}
"""Launch target -> its renderer (a `LaunchJob` in, the file's text out)."""


def render(target: str, job: LaunchJob, *, image: str | None = None) -> str:
    """The file that launches ``job`` on ``target`` (``kuberay`` needs the container ``image``)."""
    if target not in TARGETS:
        raise LaunchError(f"launch target: expected one of {sorted(TARGETS)}, got {target!r}.")
    if target == "kuberay":
        if not image:
            raise LaunchError(
                "expected --image, a container image with flashrl and its tuned examples "
                "installed (a Ray image alone cannot run the job). Fix: build one FROM rayproject/ray and pass it"
            )
        return render_rayjob(job, image=image)
    return TARGETS[target](job)
