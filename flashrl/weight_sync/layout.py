"""Which weight-sync route a run's resource layout allows, decided before the engines start and checked after.

The three routes need different layouts:

| route | works when | why not otherwise |
| --- | --- | --- |
| ``shm`` | always (the only route with CPU learners or CPU engines) | |
| ``ipc`` | every engine worker's GPU is the GPU of a learner rank | a worker maps the learner's CUDA memory by its device: CUDA IPC does not cross devices |
| ``nccl`` | learner rank 0 and every engine worker each on a GPU of its own | NCCL refuses two ranks of one group on one device |

Two steps:

- ``plan_route`` (before any engine starts; an engine's transfer backend is fixed at its start):
  the engine option ``weight_sync`` against the Ray requests. ``auto`` becomes ``shm`` when either
  side is on the CPU, ``ipc`` when learner and engine ask for GPU fractions that fit on one GPU
  together (the colocated layout), ``nccl`` when both ask for whole GPUs (Ray never gives two of
  them the same one), and ``shm`` for fractional engines next to whole-GPU learners (two engines
  may share a GPU, which NCCL refuses). An explicit ``nccl`` / ``ipc`` that these requests rule
  out is a ``RouteError`` with the reason and the fix (``validate()`` reports it).
- ``check_route`` (after the engines started, before the transfer group forms): the same rules on
  the GPUs Ray actually assigned (``TransferLayout``: per learner rank and per engine, the GPUs as
  ``<node id>/<GPU id>``, see ``gpu_slots``). Fractional requests may or may not land on one GPU;
  only this check knows, and it refuses with the devices named rather than letting NCCL or CUDA
  fail inside the first transfer.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from flashrl.weight_sync.resolve import PUSH_ROUTES, WEIGHT_SYNC_OPTIONS, RouteName

__all__ = [
    "RouteError",
    "TransferLayout",
    "check_route",
    "gpu_slots",
    "plan_route",
    "planned_engine_options",
    "route_problem",
]


class RouteError(ValueError):
    """A weight-sync route that the run's layout cannot carry (the message says why and the fix)."""


_FIX = "Fix: engine_options={'weight_sync': 'auto'} (picks a route the layout allows) or 'shm'"


def plan_route(option: str, *, learner_gpus: float, runner_gpus: float, num_env_runners: int = 1) -> RouteName:
    """The route of ``option`` (the engine option ``weight_sync``) for these Ray GPU requests.

    Args:
        option: ``auto``, ``shm``, ``nccl`` or ``ipc``.
        learner_gpus: GPUs each learner asks for (``num_gpus_per_learner``; 0 = CPU learners).
        runner_gpus: GPUs each env runner asks for (``num_gpus_per_env_runner``; 0 = CPU engines).
        num_env_runners: the engines of the run (fractional engines may share a GPU).

    Raises:
        RouteError: ``nccl`` / ``ipc`` asked for where these requests rule it out.
    """
    if option not in WEIGHT_SYNC_OPTIONS:
        raise RouteError(f"weight_sync: expected one of {WEIGHT_SYNC_OPTIONS}, got {option!r}. {_FIX}.")
    on_cpu = learner_gpus <= 0 or runner_gpus <= 0
    colocated = 0 < learner_gpus < 1 and 0 < runner_gpus < 1 and learner_gpus + runner_gpus <= 1 + 1e-9
    engines_may_share = 0 < runner_gpus < 1 and num_env_runners > 1
    layout = f"num_gpus_per_learner={learner_gpus:g}, num_gpus_per_env_runner={runner_gpus:g}"
    if option == "auto":
        if on_cpu:
            return "shm"
        if colocated:
            return "ipc"
        return "shm" if engines_may_share else "nccl"
    if option in PUSH_ROUTES and on_cpu:
        raise RouteError(
            f"weight_sync: expected 'auto' or 'shm' with {layout} (a side on the CPU), got {option!r}: vLLM's "
            f"weight-transfer engines move CUDA tensors from a learner's GPU. {_FIX}, or GPUs on both sides."
        )
    if option == "ipc" and not colocated:
        raise RouteError(
            f"weight_sync: expected 'ipc' only for learners and engines that share a GPU (GPU fractions adding "
            f"up to at most 1, e.g. 0.5 and 0.5), got 'ipc' with {layout}: Ray gives them different GPUs and "
            f"CUDA IPC does not cross devices. {_FIX}, or 'nccl'."
        )
    if option == "nccl" and (colocated or engines_may_share):
        why = "a learner and an engine" if colocated else f"two of the {num_env_runners} engines"
        raise RouteError(
            f"weight_sync: expected 'nccl' only with every learner and engine on GPUs of their own, got 'nccl' "
            f"with {layout}: {why} can land on one GPU, and NCCL refuses two ranks on one device. {_FIX}"
            + (", or 'ipc'." if colocated else ", or whole GPUs per env runner.")
        )
    return option  # type: ignore[return-value]


def planned_engine_options(
    engine: str, engine_options: dict, *, learner_gpus: float, runner_gpus: float, num_env_runners: int
) -> dict:
    """``engine_options`` with ``weight_sync`` resolved by ``plan_route`` (vLLM engines; others as given).

    The algorithm starts its env runners with these, so that no engine resolves ``auto`` alone (an
    engine cannot see where the learners are).
    """
    if engine != "vllm":
        return dict(engine_options)
    route = plan_route(
        str(engine_options.get("weight_sync", "auto")),
        learner_gpus=float(learner_gpus),
        runner_gpus=float(runner_gpus),
        num_env_runners=int(num_env_runners),
    )
    return {**engine_options, "weight_sync": route}


def route_problem(
    engine: str, engine_options: dict, *, learner_gpus: float, runner_gpus: float, num_env_runners: int
) -> str | None:
    """``plan_route``'s refusal as one ``validate()`` problem line, or None when the route is possible."""
    try:
        planned_engine_options(
            engine, engine_options, learner_gpus=learner_gpus, runner_gpus=runner_gpus,
            num_env_runners=num_env_runners,
        )  # fmt: skip
    except RouteError as err:
        return "engine_options." + str(err)
    except (AttributeError, TypeError, ValueError):  # a malformed setting: its own spec reports it
        return None
    return None


@dataclass(frozen=True)
class TransferLayout:
    """The GPUs Ray assigned: per learner rank, and per engine (its workers'), as ``<node>/<GPU id>``.

    An empty tuple is a process on the CPU (or one whose GPU is unknown).
    """

    learners: tuple[tuple[str, ...], ...]
    engines: tuple[tuple[str, ...], ...]

    @classmethod
    def of(cls, learners: Sequence[Sequence[str]], engines: Sequence[Sequence[str]]) -> TransferLayout:
        return cls(tuple(tuple(d) for d in learners), tuple(tuple(d) for d in engines))


def check_route(route: str, layout: TransferLayout) -> None:
    """Raise ``RouteError`` unless ``route`` works on the GPUs of ``layout`` (``shm`` always does)."""
    if route not in PUSH_ROUTES:
        return
    cpu_learners = [r for r, d in enumerate(layout.learners) if not d]
    cpu_engines = [i for i, d in enumerate(layout.engines) if not d]
    if not layout.learners or cpu_learners or cpu_engines:
        raise RouteError(
            f"weight_sync={route!r} needs every learner rank and every engine on a GPU; learner ranks "
            f"{cpu_learners} and engines {cpu_engines} have none (Ray assigned them no GPU). {_FIX}."
        )
    if route == "ipc":
        learner_gpus = {g for devices in layout.learners for g in devices}
        outside = {i: [g for g in d if g not in learner_gpus] for i, d in enumerate(layout.engines)}
        outside = {i: gpus for i, gpus in outside.items() if gpus}
        if outside:
            raise RouteError(
                f"weight_sync='ipc' needs every engine worker on the GPU of a learner rank (CUDA IPC does not "
                f"cross devices); engines {sorted(outside)} run on {sorted({g for v in outside.values() for g in v})}, "
                f"the learners on {sorted(learner_gpus)}. {_FIX}, or 'nccl' (learners and engines on GPUs of "
                "their own)."
            )
        return
    ranks = [layout.learners[0][0], *(g for devices in layout.engines for g in devices)]
    shared = sorted(g for g, n in Counter(ranks).items() if n > 1)
    if shared:
        raise RouteError(
            f"weight_sync='nccl' needs learner rank 0 and every engine worker on a GPU of its own (NCCL refuses "
            f"two ranks of one group on one device); GPUs {shared} hold two of them (learner rank 0 on "
            f"{ranks[0]}, engines on {[list(d) for d in layout.engines]}). {_FIX}, or 'ipc' when learner and "
            "engine share a GPU."
        )


def gpu_slots(device: object = None) -> tuple[str, ...]:
    """This process's GPUs as ``<node id>/<GPU id>``: Ray's assignment, else ``device``'s CUDA index.

    A Ray actor (or task) with GPUs reports the ids Ray assigned it (physical ids on its node). A
    process Ray assigned none (a driver script hosting a local learner) reports ``device`` when that
    is a CUDA device, mapped through ``CUDA_VISIBLE_DEVICES``; a CPU ``device`` (or None) gives ().
    """
    node = "local"
    assigned: list[str] = []
    try:
        import ray

        if ray.is_initialized():
            context = ray.get_runtime_context()
            node = context.get_node_id()
            assigned = [str(g) for g in context.get_accelerator_ids().get("GPU", [])]
    except ImportError:  # pragma: no cover - ray is a dependency
        pass
    if assigned:
        return tuple(f"{node}/{g}" for g in assigned)
    index = _cuda_index(device)
    if index is None:
        return ()
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    physical = visible[index] if index < len(visible) else str(index)
    return (f"{node}/{physical}",)


def _cuda_index(device: object) -> int | None:
    if device is None:
        return None
    text = str(device)
    if not text.startswith("cuda"):
        return None
    return int(text.split(":", 1)[1]) if ":" in text else 0
