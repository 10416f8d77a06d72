"""The run's weight-sync route: chosen from the runners' facts, one interface, each route's moves.

Fakes stand in for the learner and runner groups (the surface `flashrl.weight_sync.transport.Learners`
and `Runners` name); `test_runners.py` and `test_push_route.py` run the real groups.
"""

from __future__ import annotations

import pytest

from flashrl.weight_sync.messages import PutBuckets
from flashrl.weight_sync.push import PushRoute
from flashrl.weight_sync.route import route_for
from flashrl.weight_sync.shm import ShmRoute
from flashrl.weight_sync.transport import WeightSyncRoute
from flashrl.weight_sync.vllm_push import Push, StartPush, StopPush
from flashrl.weight_sync.wire import DEFAULT_BUCKET_BYTES


class Learners:
    def __init__(self, version: int) -> None:
        self.version = version
        self.calls: list = []
        self.names: list[str] = []

    def sync_weights(self, message) -> str | int | None:
        match message:
            case PutBuckets(bucket_bytes, names):
                self.calls.append(("buckets", bucket_bytes))
                self.names.append(names)
                return f"v{self.version}/{bucket_bytes}"
            case StartPush(route, runners, workers_per_runner, bucket_bytes=bucket_bytes):
                self.calls.append(("start", route, list(runners), list(workers_per_runner), bucket_bytes))
            case Push():
                self.calls.append(("push", self.version))
                return self.version
            case StopPush():
                self.calls.append(("stop",))
            case _:
                raise AssertionError(f"unexpected message {message!r}")
        return None


class Runners:
    def __init__(self) -> None:
        self.actors = ["a", "b"]
        self.transfer_workers = [2, 1]
        self.generation = 2
        self.calls: list = []
        self.source = None

    def check_alive(self) -> int:
        self.calls.append(("check_alive",))
        return 0

    def broadcast_weights(self, version: int, weights_ref, *, wait: bool = False) -> float:
        self.calls.append(("broadcast", version, weights_ref, wait))
        return 0.25

    def set_weights_source(self, source) -> None:
        self.source = source


@pytest.mark.parametrize(
    ("facts", "kind", "name"),
    [({"weight_sync": "shm"}, ShmRoute, "shm"), ({"weight_sync": "nccl"}, PushRoute, "nccl"),
     ({"weight_sync": "ipc"}, PushRoute, "ipc")],
)  # fmt: skip
def test_the_route_is_the_one_the_engines_resolved(facts, kind, name) -> None:
    route = route_for({"pad_token_id": 0, **facts}, wait_for_load=False, bucket_bytes=1024)
    assert type(route) is kind and isinstance(route, WeightSyncRoute)
    assert route.name == name and route.bucket_bytes == 1024


@pytest.mark.parametrize("facts", [{"weight_sync": "rdma"}, {"weight_sync": "auto"}, {}])
def test_an_unknown_or_missing_route_is_refused_with_the_fix(facts) -> None:
    with pytest.raises(ValueError) as err:
        route_for(facts, wait_for_load=False)
    message = str(err.value)
    assert f"report weight_sync={facts.get('weight_sync')!r}" in message
    assert "expected one of ('shm', 'nccl', 'ipc', 'lora')" in message and "Fix:" in message


def test_a_bucket_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_bytes must be positive; got 0"):
        ShmRoute(wait_for_load=True, bucket_bytes=0)
    with pytest.raises(ValueError, match="bucket_bytes must be positive; got -1"):
        PushRoute("nccl", bucket_bytes=-1)


@pytest.mark.parametrize("wait", [True, False])
def test_shm_broadcasts_the_buckets_and_waits_only_when_asked(wait: bool) -> None:
    learners, runners = Learners(version=3), Runners()
    route = route_for({"weight_sync": "shm"}, wait_for_load=wait)
    route.setup(learners, runners)
    assert learners.calls == [] and runners.calls == [] and runners.source is None  # nothing to prepare
    assert route.push(learners, runners) == 0.25  # the broadcast's own seconds
    assert learners.calls == [("buckets", DEFAULT_BUCKET_BYTES)]
    assert runners.calls == [("broadcast", 3, f"v3/{DEFAULT_BUCKET_BYTES}", wait)]
    route.stop()
    assert route.num_formations == 0 and len(runners.calls) == 1


@pytest.mark.parametrize("route", [ShmRoute(wait_for_load=False, bucket_bytes=64), PushRoute("nccl", bucket_bytes=64)])
def test_a_restore_loads_the_restored_weights_into_every_runner_and_waits(route: WeightSyncRoute) -> None:
    learners, runners = Learners(version=5), Runners()
    assert route.after_restore(learners, runners) == 0.25
    # the shm stream whatever the route (the runner group may be new, outside any transfer group); waits
    assert runners.calls == [("broadcast", 5, "v5/64", True)]
    assert [c[0] for c in learners.calls] == ["buckets"]


def test_a_restore_to_the_initial_policy_sends_nothing() -> None:
    learners, runners = Learners(version=0), Runners()
    assert ShmRoute(wait_for_load=True).after_restore(learners, runners) == 0.0
    assert learners.calls == [] and runners.calls == []


def test_a_push_route_forms_at_setup_and_pushes_after_a_liveness_check() -> None:
    learners, runners = Learners(version=1), Runners()
    route = route_for({"weight_sync": "ipc"}, wait_for_load=False, bucket_bytes=64)
    route.setup(learners, runners)
    assert learners.calls == [("start", "ipc", ["a", "b"], [2, 1], 64)] and route.num_formations == 1
    assert runners.source() == (1, "v1/64")  # a replacement runner's weights: the learners' current ones
    seconds = route.push(learners, runners)
    assert seconds >= 0.0 and runners.calls == [("check_alive",)]  # nothing broadcast
    assert learners.calls[-1] == ("push", 1) and route.num_formations == 1
    route.stop()
    route.stop()
    assert learners.calls.count(("stop",)) == 1
