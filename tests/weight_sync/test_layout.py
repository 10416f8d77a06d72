"""The route from the resource layout: planned from the Ray requests, checked against the GPUs assigned.

No GPU is needed: the layouts are what Ray reports (``<node id>/<GPU id>`` per process), written out.
"""

from __future__ import annotations

import pytest

from flashrl.weight_sync.layout import (
    RouteError,
    TransferLayout,
    check_route,
    gpu_slots,
    plan_route,
    planned_engine_options,
)
from flashrl.weight_sync.push import PushRoute
from flashrl.weight_sync.route import route_for
from flashrl.weight_sync.shm import ShmRoute


@pytest.mark.parametrize(
    ("learner_gpus", "runner_gpus", "runners", "route"),
    [
        (0, 0, 2, "shm"),  # CPU learners and engines
        (0, 1, 2, "shm"),  # CPU learners, GPU engines
        (1, 0, 1, "shm"),  # GPU learners, CPU engines
        (0.5, 0.5, 1, "ipc"),  # colocated: both fit on one GPU
        (0.3, 0.6, 4, "ipc"),
        (1, 1, 4, "nccl"),  # whole GPUs: never the same one
        (1, 4, 2, "nccl"),  # tensor-parallel engines on whole GPUs
        (1, 0.5, 2, "shm"),  # two half-GPU engines may share a GPU: NCCL would refuse them
        (1, 0.5, 1, "nccl"),  # one fractional engine next to whole-GPU learners
        (0.6, 0.6, 1, "nccl"),  # fractions that cannot share one GPU
    ],
)
def test_auto_follows_the_layout(learner_gpus, runner_gpus, runners, route) -> None:
    assert plan_route("auto", learner_gpus=learner_gpus, runner_gpus=runner_gpus, num_env_runners=runners) == route


@pytest.mark.parametrize(
    ("option", "learner_gpus", "runner_gpus", "runners", "reason"),
    [
        ("nccl", 0, 1, 1, "a side on the CPU"),
        ("ipc", 1, 0, 1, "a side on the CPU"),
        ("ipc", 1, 1, 1, "Ray gives them different GPUs and CUDA IPC does not cross devices"),
        ("nccl", 0.5, 0.5, 1, "a learner and an engine can land on one GPU"),
        ("nccl", 1, 0.5, 3, "two of the 3 engines can land on one GPU"),
        ("rdma", 1, 1, 1, "expected one of ('auto', 'shm', 'nccl', 'ipc', 'lora')"),
    ],
)
def test_an_explicit_route_the_layout_rules_out_is_refused(option, learner_gpus, runner_gpus, runners, reason) -> None:
    with pytest.raises(RouteError) as err:
        plan_route(option, learner_gpus=learner_gpus, runner_gpus=runner_gpus, num_env_runners=runners)
    assert reason in str(err.value) and "Fix:" in str(err.value)


def test_an_explicit_route_the_layout_allows_is_kept() -> None:
    assert plan_route("shm", learner_gpus=1, runner_gpus=1) == "shm"
    assert plan_route("nccl", learner_gpus=1, runner_gpus=2, num_env_runners=3) == "nccl"
    assert plan_route("ipc", learner_gpus=0.5, runner_gpus=0.5) == "ipc"


def test_the_planned_route_goes_into_vllm_engine_options_only() -> None:
    options = {"gpu_memory_utilization": 0.4}
    out = planned_engine_options("vllm", options, learner_gpus=0.5, runner_gpus=0.5, num_env_runners=1)
    assert out == {"gpu_memory_utilization": 0.4, "weight_sync": "ipc"} and options == {"gpu_memory_utilization": 0.4}
    assert planned_engine_options("torch", options, learner_gpus=1, runner_gpus=1, num_env_runners=1) == options


NODE = "n0"


def _layout(learners, engines) -> TransferLayout:
    return TransferLayout.of([[f"{NODE}/{g}" for g in d] for d in learners], [[f"{NODE}/{g}" for g in d] for d in engines])


def test_ipc_needs_every_worker_on_a_learners_gpu() -> None:
    check_route("ipc", _layout([[0], [1]], [[0], [1]]))  # two colocated pairs
    with pytest.raises(RouteError, match=r"engines \[1\] run on \['n0/2'\], the learners on \['n0/0', 'n0/1'\]"):
        check_route("ipc", _layout([[0], [1]], [[0], [2]]))


def test_nccl_needs_a_gpu_per_rank() -> None:
    check_route("nccl", _layout([[0], [1]], [[2, 3], [4, 5]]))  # learner 1 is not in the group
    with pytest.raises(RouteError, match=r"GPUs \['n0/0'\] hold two of them"):
        check_route("nccl", _layout([[0]], [[0]]))  # learner and engine on one GPU
    with pytest.raises(RouteError, match=r"GPUs \['n0/2'\] hold two of them"):
        check_route("nccl", _layout([[0]], [[2], [2]]))  # two engines on one GPU


def test_push_routes_need_gpus_on_both_sides_and_shm_needs_nothing() -> None:
    with pytest.raises(RouteError, match=r"learner ranks \[\] and engines \[1\] have none"):
        check_route("nccl", _layout([[0]], [[1], []]))
    with pytest.raises(RouteError, match=r"learner ranks \[0\]"):
        check_route("ipc", _layout([[]], [[0]]))
    check_route("shm", _layout([[]], [[]]))


def test_route_for_checks_a_push_route_against_the_layout() -> None:
    with pytest.raises(RouteError, match="NCCL refuses two ranks"):
        route_for({"weight_sync": "nccl"}, wait_for_load=False, layout=_layout([[0]], [[0]]))
    assert isinstance(route_for({"weight_sync": "ipc"}, wait_for_load=False, layout=_layout([[0]], [[0]])), PushRoute)
    shm = route_for({"weight_sync": "shm", "weight_names": "checkpoint"}, wait_for_load=True,
                    layout=_layout([[]], [[]]))  # fmt: skip
    assert isinstance(shm, ShmRoute) and shm.weight_names == "checkpoint"


def test_gpu_slots_of_a_process_without_ray_gpus(monkeypatch) -> None:
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # a driver outside Ray (an earlier test may have joined)
    assert gpu_slots("cpu") == () and gpu_slots(None) == ()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert gpu_slots("cuda:1") == ("local/5",) and gpu_slots("cuda") == ("local/3",)


def test_validate_reports_an_impossible_route(tiny_config) -> None:
    from flashrl.algorithms.flash_reinforce.config import ConfigError

    config = tiny_config().env_runners(engine="vllm", engine_options={"weight_sync": "nccl"})
    with pytest.raises(ConfigError, match=r"engine_options\.weight_sync: expected 'auto' or 'shm'"):
        config.validate()
