"""What a launcher renders from: a tuned example, its flags, and the node plan they resolve to.

`launch_job` loads the tuned example (its ``PRESET`` and ``make_config``; nothing runs), builds the
config from the flags the job will pass it (as the script itself would), takes the node plan from
those flags (`--num-nodes`, `--gpus-per-node`, ...; the preset's plan by default), and refuses a plan
the config's actors cannot be placed on (`flashrl.recipes.plan.placement_error`; actors pinned by Ray
custom resources, which no launched node offers) before anything is rendered: a cluster job that waits
forever for a GPU it was never given is the failure to avoid.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashrl.recipes.args import node_plan_from_args
from flashrl.recipes.plan import placement_error
from flashrl.recipes.preset import NodePlan, Preset

__all__ = ["LaunchError", "LaunchJob", "launch_job"]


class LaunchError(ValueError):
    """A tuned example, its flags or its node plan that no launcher can render a working job from."""


@dataclass(frozen=True)
class LaunchJob:
    """A tuned example ready to render as a cluster job."""

    preset: Preset
    script: str
    """The tuned example's path relative to the working directory the job ships (``tuned_examples/<name>.py``)."""
    script_args: tuple[str, ...]
    """The flags passed to the tuned example, as given."""
    nodes: NodePlan
    """The cluster the job asks for: the preset's node plan, with the flags' changes."""

    @property
    def name(self) -> str:
        """The job's name: the preset's, as Kubernetes and SLURM accept it (lower case, '-' for '_')."""
        return "flashrl-" + self.preset.name.lower().replace("_", "-")


def launch_job(script: Path, script_args: Sequence[str]) -> LaunchJob:
    """Load ``script`` (a tuned example), build its config from ``script_args`` and check its placement."""
    from flashrl.recipes.run import build_config

    namespace = _load(script)
    preset, make_config = namespace.get("PRESET"), namespace.get("make_config")
    if not isinstance(preset, Preset) or not callable(make_config):
        raise LaunchError(
            f"{script}: expected a tuned example defining PRESET (a flashrl.recipes.Preset) and make_config(args); "
            f"got PRESET={type(preset).__name__}, make_config={type(make_config).__name__}. Fix: pass a script "
            "written like those in tuned_examples/"
        )
    add_arguments = namespace.get("add_arguments") or getattr(make_config, "add_arguments", None)
    try:
        config, args = build_config(preset, make_config, list(script_args), add_arguments=add_arguments,
                                    find_resume_checkpoint=False)
        nodes = node_plan_from_args(args)
    except SystemExit as exit_:  # argparse's or the config's own message went to stderr
        raise LaunchError(f"{script}: the flags {list(script_args)} do not build a config (see above).") from exit_
    problem = placement_error(config, nodes) or _custom_resources_error(config, nodes)
    if problem is not None:
        raise LaunchError(f"{preset.name}: {problem}.")
    relative = script.resolve()
    try:
        relative = relative.relative_to(Path.cwd().resolve())
    except ValueError:
        relative = Path("tuned_examples") / script.name  # a checkout elsewhere: the job ships its working dir
    return LaunchJob(preset=preset, script=relative.as_posix(), script_args=tuple(script_args), nodes=nodes)


def _custom_resources_error(config: Any, nodes: NodePlan) -> str | None:
    """Why a job whose actors ask for Ray custom resources cannot be launched: the launchers start identical
    nodes with CPUs and GPUs only, so no node would offer them and the run's setup would refuse to start."""
    actors = {"custom_resources_per_env_runner": config.num_env_runners,
              "custom_resources_per_learner": config.num_learners}
    asks = {name: {k: v for k, v in getattr(config, name).items() if v > 0} for name, count in actors.items()
            if count >= 1}  # as the setup's check: no actor, or nothing asked, places nothing
    asks = {name: resources for name, resources in asks.items() if resources}
    if not asks:
        return None
    said = ", ".join(f"{name}={value}" for name, value in asks.items())
    return (
        f"the config asks for Ray custom resources ({said}), but a launched cluster is {nodes.describe()} started "
        "with CPUs and GPUs only: no node would offer them and the run's setup refuses actors it cannot place. "
        "Fix: drop them for a launched job (the node plan places the actors); to pin actors to some nodes, start "
        "that cluster yourself (ray start --resources on those nodes) and ray job submit the tuned example to it"
    )


def _load(script: Path) -> dict[str, Any]:
    """The tuned example's globals, run under another name than ``__main__`` (so nothing trains)."""
    saved = list(sys.path)
    sys.path.insert(0, str(script.resolve().parent))  # a tuned example may import its siblings
    try:
        return runpy.run_path(str(script), run_name="flashrl_launch")
    finally:
        sys.path[:] = saved
