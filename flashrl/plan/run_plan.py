"""`RunPlan`: what a run's config decides about its processes, worked out once (docs/design.md §2).

Before any actor starts, one function, `plan_run(config)`, derives from a validated algorithm config
everything the processes are started with and the planner reviews, as prime-rl derives every
process's config in one place:

- the engine options of every env runner: the user's, with the weight-sync route resolved from the
  resource layout (``flashrl.weight_sync.layout.plan_route``; an engine alone cannot see where the
  learners are), vLLM's ``log_level`` from ``framework_log_level``, next to a learner on its GPU the
  sleep mode and the learner's planned bytes (``flashrl.engines.colocation``), and the run's context,
  sequences in flight and routing replay (``flashrl.engines.engine_options_for_run``);
- the learners' placement and the env runners' count;
- the memory estimates of one learner and one env runner (``flashrl.plan.memory``) from the model's
  shape (``flashrl.plan.architectures``).

The driver (``FlashReinforce.setup``) starts the learners and the runners from it, and the
``--dry-run`` report (``flashrl.recipes.plan``) renders it against a node plan. The config is read by
attribute: the core imports no algorithm.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from flashrl.engines import engine_options_for_run
from flashrl.engines.colocation import colocated_engine_options, is_colocated, resolve_sleep_mode
from flashrl.engines.memory import DEFAULT_MAX_NUM_SEQS, GIB
from flashrl.models.lora import LoRASettings
from flashrl.plan.architectures import Architecture, architecture_for
from flashrl.plan.memory import EnvRunnerMemory, LearnerMemory, env_runner_memory, learner_memory_for
from flashrl.weight_sync.layout import RouteError, planned_engine_options

__all__ = ["LearnerPlacement", "RunPlan", "RunnerEngine", "lora_engine_options", "plan_run", "runner_engine_options"]


@dataclass(frozen=True)
class LearnerPlacement:
    """Where the learners run: Ray actors, or one learner inside the driver."""

    num_learners: int
    """Learner ranks (at least 1: ``num_learners=0`` is one learner in the driver)."""
    local: bool
    """Whether the one learner runs in the driver process (``num_learners=0``)."""
    num_cpus: float
    num_gpus: float
    """Per learner; a fraction below 1 may share its GPU with an engine (``colocated``)."""


@dataclass(frozen=True)
class RunnerEngine:
    """What one env runner's engine holds, as its memory estimate counts it."""

    dtype: str
    """The engine's weight dtype (its ``dtype`` option, else bfloat16 on a GPU and float32 on the CPU)."""
    num_seqs: int
    """Sequences it holds at once (vLLM's ``max_num_seqs``, else the episodes in flight)."""
    context: int
    """Tokens per sequence (``max_model_len``, else ``max_episode_tokens``)."""


@dataclass(frozen=True)
class RunPlan:
    """A run's processes as its config plans them (`plan_run`); read-only once made."""

    engine: str
    engine_options: dict[str, Any]
    """The run's engine options before the per-runner limits: the user's, the route resolved, the
    colocated share and sleep mode, vLLM's ``log_level``."""
    runner_engine_options: dict[str, Any]
    """What every env runner starts its engine with (``engine_options`` plus ``max_model_len``, the
    sequences in flight and routing replay where they leave them out); the driver hands them to the
    runners in their spec."""
    weight_sync: str
    """The route the engines start with (``shm``, ``nccl``, ``ipc``; ``shm`` when the layout refuses one)."""
    sleep_mode: bool
    """``engine_sleep_mode`` resolved: colocated vLLM engines sleep while their learner updates."""
    colocated: bool
    """A vLLM engine shares its GPU with a learner (GPU fractions that fit on one device together)."""
    learners: LearnerPlacement
    num_env_runners: int
    wait_for_load: bool
    """Every runner loads each new version before the next round (``rollout_mode="sync_group"``)."""
    architecture: Architecture | None
    """The model's shape (None: not in the table and no local ``config.json``; nothing is estimated)."""
    learner_memory: LearnerMemory | None
    """One learner's estimate on the planned route (None without an architecture)."""
    runner_engine: RunnerEngine
    runner_memory: EnvRunnerMemory | None
    """One env runner's engine estimate (None without an architecture, or see ``runner_memory_error``)."""
    route_error: str | None = None
    """Why the layout refuses the asked ``weight_sync`` (a plan made with ``raise_problems=False``)."""
    sleep_error: str | None = None
    """Why ``engine_sleep_mode`` cannot hold (a plan made with ``raise_problems=False``)."""
    engine_options_error: str | None = None
    """Why the runners' engine options contradict the run (a plan made with ``raise_problems=False``)."""
    runner_memory_error: str | None = None
    """Why the engine would refuse its KV-cache budget at start (it says so itself then)."""


def runner_engine_options(spec: Any, engine_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """An env runner's engine options: ``engine_options`` (default: the spec's) with the run's context
    (``max_episode_tokens``), sequences in flight and routing replay filled in where they leave them out.

    ``spec`` is an ``EnvRunnerSpec`` or an algorithm config (the same names). A spec that carries a
    `RunPlan`'s ``runner_engine_options`` gets them back unchanged; one built without a plan (a test,
    ``flashrl eval``) gets what the plan would give it.
    """
    return engine_options_for_run(
        spec.engine,
        spec.engine_options if engine_options is None else engine_options,
        max_model_len=spec.max_episode_tokens,
        num_seqs=spec.episodes_in_flight_per_env_runner,
        record_routed_experts=spec.routing_replay,
    )


def lora_engine_options(config: Any) -> dict[str, Any]:
    """The config's engine options, with a LoRA run's route and adapter (``flashrl.weight_sync.lora``).

    With ``lora_rank`` set the engines take the ``lora`` route (only the adapter crosses; they keep
    their base) and get the adapter's settings as the option ``lora`` (vLLM also ``weight_sync='lora'``;
    the torch engine reports the route from its ``lora`` option); full training leaves the options
    as they are. A LoRA run whose options ask for another route is a ``RouteError``.
    """
    options = dict(config.engine_options)
    if getattr(config, "lora_rank", None) is None:
        return options
    asked = options.get("weight_sync", "auto")
    if asked not in ("auto", "lora"):
        raise RouteError(
            f"weight_sync: expected 'auto' or 'lora' with lora_rank={config.lora_rank} (the engines keep their base "
            f"and load each version's adapter), got {asked!r}. Fix: drop weight_sync from engine_options, or set "
            "lora_rank=None for full training."
        )
    settings = LoRASettings(rank=int(config.lora_rank), alpha=float(config.lora_alpha),
                            target_modules=str(config.lora_target_modules), dropout=float(config.lora_dropout))
    options["lora"] = settings.to_dict()
    if config.engine == "vllm":  # the torch engine has no route option: it reports 'lora' when it has an adapter
        options["weight_sync"] = "lora"
    return options


def plan_run(config: Any, *, model_path: str | None = None, raise_problems: bool = True) -> RunPlan:
    """The plan of a validated algorithm config (``FlashReinforceConfig``).

    Args:
        config: the run's config, read by attribute.
        model_path: a local folder holding the model, whose ``config.json`` gives its shape when the
            model is not in ``flashrl.plan.architectures``'s table (None: the table only).
        raise_problems: raise a route the layout refuses (``RouteError``), a sleep mode that cannot
            hold and engine options that contradict the run (``ValueError``) as a run would; False
            records them in the plan instead (the dry-run reports them).
    """
    learner_gpus, runner_gpus = config.num_gpus_per_learner, config.num_gpus_per_env_runner
    route_error = sleep_error = engine_options_error = runner_memory_error = None
    try:
        options = planned_engine_options(
            config.engine, lora_engine_options(config), learner_gpus=learner_gpus, runner_gpus=runner_gpus,
            num_env_runners=config.num_env_runners,
        )  # fmt: skip
    except RouteError as err:
        if raise_problems:
            raise
        route_error, options = str(err), dict(config.engine_options)
    if config.engine == "vllm":
        options.setdefault("log_level", config.framework_log_level)
    route = str(options.get("weight_sync", "shm")) if route_error is None else "shm"
    if route_error is None and options.get("lora") is not None:  # the torch engine's route with an adapter
        route = "lora"
    try:
        sleep = resolve_sleep_mode(
            config.engine_sleep_mode, engine=config.engine, learner_gpus=learner_gpus, runner_gpus=runner_gpus
        )
    except ValueError as err:
        if raise_problems:
            raise
        sleep_error, sleep = str(err), False
    arch = architecture_for(config.model, model_path)
    # the learner's estimate on the route it pushes over; next to an engine it sizes the engine's share
    learner = None if arch is None else learner_memory_for(config, arch, weight_sync=route)
    options = colocated_engine_options(
        options, engine=config.engine, learner_gpus=learner_gpus, runner_gpus=runner_gpus, sleep_mode=sleep,
        learner_memory=learner,
    )  # fmt: skip
    try:
        runner_options = runner_engine_options(config, options)
    except ValueError as err:
        if raise_problems:
            raise
        engine_options_error = str(err)
        runner_options = engine_options_for_run(config.engine, options, max_model_len=config.max_episode_tokens,
                                                num_seqs=config.episodes_in_flight_per_env_runner)  # fmt: skip
    engine = _runner_engine(config, runner_options)
    runner = None
    cpu_vllm = config.engine == "vllm" and runner_gpus == 0
    kv_bytes, kv_source = runner_options.get("kv_cache_memory_bytes"), "kv_cache_memory_bytes"
    legacy = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip() if cpu_vllm else ""
    if legacy.isdigit():  # vLLM's CPU build lets it win over the engine's setting (flashrl.engines.vllm_engine)
        kv_bytes, kv_source = int(legacy) * GIB, f"VLLM_CPU_KVCACHE_SPACE={legacy} (GiB)"
    if arch is not None:
        try:
            runner = env_runner_memory(
                arch, engine_dtype=engine.dtype, episodes_in_flight=engine.num_seqs, max_episode_tokens=engine.context,
                cpu_vllm=cpu_vllm, kv_cache_memory_bytes=kv_bytes, kv_cache_source=kv_source,
                cpu_engine=config.engine if runner_gpus == 0 else None,
            )  # fmt: skip
        except ValueError as err:  # the engine refuses this budget at start, with the same message
            runner_memory_error = str(err)
    return RunPlan(
        engine=config.engine,
        engine_options=options,
        runner_engine_options=runner_options,
        weight_sync=route,
        sleep_mode=sleep,
        colocated=config.engine == "vllm" and is_colocated(learner_gpus, runner_gpus),
        learners=LearnerPlacement(num_learners=max(1, config.num_learners), local=config.num_learners == 0,
                                  num_cpus=config.num_cpus_per_learner, num_gpus=learner_gpus),
        num_env_runners=config.num_env_runners,
        wait_for_load=config.rollout_mode == "sync_group",
        architecture=arch,
        learner_memory=learner,
        runner_engine=engine,
        runner_memory=runner,
        route_error=route_error,
        sleep_error=sleep_error,
        engine_options_error=engine_options_error,
        runner_memory_error=runner_memory_error,
    )


def _runner_engine(config: Any, options: dict[str, Any]) -> RunnerEngine:
    """The weight dtype, sequences and context of one runner's engine started with ``options``."""
    on_gpu = config.num_gpus_per_env_runner > 0
    dtype = str(config.engine_options.get("dtype") or ("bfloat16" if on_gpu else "float32"))
    if dtype not in ("float32", "bfloat16", "float16"):
        dtype = "bfloat16"
    seqs = int(options.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS) if config.engine == "vllm" else None
    return RunnerEngine(
        dtype=dtype,
        num_seqs=seqs or config.episodes_in_flight_per_env_runner,
        context=int(options.get("max_model_len") or config.max_episode_tokens),
    )
