"""The GPU push route's control flow on CPU: when the transfer group is formed, re-formed and used.

vLLM's trainer engine (the NCCL broadcast / CUDA-IPC mapping) needs a GPU, so here it is replaced at
the one seam where flashrl hands over to vLLM (`start_push_transfer`); everything around it is real:
the `Learner` and its `LearnerGroup`, the `EnvRunnerSyncClient` they build, and `PushRoute`. What
these cannot show is that the data plane runs on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from flashrl.learners import Learner, LearnerGroup, weight_sender
from flashrl.weight_sync import vllm_push
from flashrl.weight_sync.route import PushRoute


class FakeTrainerEngine:
    """What vLLM's `TrainerWeightTransferEngine` offers flashrl: `send_weights()` and `shutdown()`."""

    def __init__(self, log: list, route: str, client: vllm_push.EnvRunnerSyncClient, kwargs: dict) -> None:
        self.log, self.route, self.client, self.kwargs = log, route, client, kwargs
        self.sent = 0
        self.closed = False

    def send_weights(self) -> None:
        self.sent += 1
        self.log.append(("send", self.client.version()))

    def shutdown(self) -> None:
        self.closed = True
        self.log.append(("shutdown",))


@pytest.fixture
def fake_engines(monkeypatch):
    """Replace vLLM's trainer engine: every `start_push_transfer` call is recorded, engines kept."""
    engines: list[FakeTrainerEngine] = []
    log: list = []

    def fake_start(route, model, client, **kwargs):
        engine = FakeTrainerEngine(log, route, client, {"model": model, **kwargs})
        engines.append(engine)
        log.append(("start", route))
        return engine

    monkeypatch.setattr(weight_sender, "start_push_transfer", fake_start)
    return engines, log


def test_learner_forms_pushes_and_tears_down(make_spec, batch, fake_engines) -> None:
    engines, log = fake_engines
    learner = Learner(make_spec(dtype="bfloat16"))
    with pytest.raises(RuntimeError, match="before start_weight_push"):
        learner.push_weights()
    runners = ["runner-a", "runner-b"]
    learner.start_weight_push("nccl", runners, [2, 1], master_address="10.0.0.1", master_port=29555, bucket_bytes=2**20)
    (engine,) = engines
    assert engine.route == "nccl"
    assert engine.kwargs["model"] is learner.policy.model
    assert engine.kwargs["rank"] == 0 and engine.kwargs["device"] == torch.device("cpu")
    assert engine.kwargs["dtype"] == torch.bfloat16  # what the engine serves, as on the shm route
    assert (engine.kwargs["master_address"], engine.kwargs["master_port"]) == ("10.0.0.1", 29555)
    assert engine.kwargs["bucket_bytes"] == 2**20
    # one group: the learner (rank 0) and the 3 workers of the two engines
    assert engine.client.runners == runners and engine.client.world_size == 4

    learner.update(batch)
    assert learner.push_weights() == 1
    assert log[-1] == ("send", 1)  # the client stamps the runners with the learner's version

    learner.start_weight_push("nccl", runners, [2, 1], master_address="10.0.0.1", master_port=29556)
    assert engines[0].closed and not engines[1].closed  # forming again tears the old group down first
    learner.stop_weight_push()
    learner.stop_weight_push()  # idempotent
    assert engines[1].closed and log.count(("shutdown",)) == 2


def test_a_hung_or_failed_push_is_torn_down_on_both_sides(make_spec, fake_engines) -> None:
    """A send that outlives its deadline (a broadcast whose peer stopped receiving) raises, shuts the
    learner's side down and has every runner abort; the next start forms the group again."""
    import threading

    from flashrl.weight_sync.vllm_push import TransferTimeout

    engines, log = fake_engines
    learner = Learner(make_spec())
    learner.start_weight_push("nccl", ["r0", "r1"], [1, 1], master_address="h", master_port=1, deadline_s=0.3)
    (engine,) = engines
    runner_calls: list = []
    engine.client._all = lambda method, per_runner=None, *args: runner_calls.append((method, args))
    release = threading.Event()
    engine.send_weights = lambda: release.wait(30)  # hangs until the communicator is aborted
    engine.shutdown = lambda: (log.append(("shutdown",)), release.set())
    with pytest.raises(TransferTimeout):
        learner.push_weights()
    assert log[-1] == ("shutdown",)
    assert runner_calls == [("abort_weight_transfer", ("a pushed transfer ran out of time",))]
    with pytest.raises(RuntimeError, match="before start_weight_push"):
        learner.push_weights()  # the group is gone
    learner.stop_weight_push()  # nothing left to tear down
    assert runner_calls == [("abort_weight_transfer", ("a pushed transfer ran out of time",))]

    learner.start_weight_push("nccl", ["r0", "r1"], [1, 1], master_address="h", master_port=1, deadline_s=5)
    engine = engines[-1]
    engine.client._all = lambda method, per_runner=None, *args: runner_calls.append((method, args))

    def broken() -> None:
        raise RuntimeError("NCCL error: remote process exited")

    engine.send_weights = broken
    with pytest.raises(RuntimeError, match="NCCL error"):
        learner.push_weights()
    assert engine.closed and runner_calls[-1][0] == "abort_weight_transfer"
    assert "NCCL error" in runner_calls[-1][1][0]


def test_a_normal_stop_releases_the_runners_side_too(make_spec, fake_engines) -> None:
    engines, _ = fake_engines
    learner = Learner(make_spec())
    learner.start_weight_push("ipc", ["r0"], [1], master_address="h", master_port=1)
    runner_calls: list = []
    engines[0].client._all = lambda method, per_runner=None, *args: runner_calls.append(method)
    learner.stop_weight_push()
    assert engines[0].closed and runner_calls == ["end_weight_push"]


def test_local_learner_group_passes_a_rendezvous_address(make_spec, fake_engines) -> None:
    engines, _ = fake_engines
    group = LearnerGroup(make_spec(), local=True)
    try:
        group.start_weight_push("ipc", ["runner"], [1])
        (engine,) = engines
        assert isinstance(engine.kwargs["master_address"], str) and engine.kwargs["master_address"]
        assert 0 < engine.kwargs["master_port"] < 65536
        assert group.push_weights() == 0 and engines[0].sent == 1
        group.stop_weight_push()
        assert engines[0].closed
    finally:
        group.shutdown()


class FakeLearners:
    def __init__(self) -> None:
        self.version = 0
        self.calls: list = []

    def start_weight_push(self, route, actors, workers, *, bucket_bytes) -> None:
        self.calls.append(("start", route, list(actors), list(workers)))

    def push_weights(self) -> int:
        self.calls.append(("push", self.version))
        return self.version

    def stop_weight_push(self) -> None:
        self.calls.append(("stop",))

    def weight_buckets_refs(self, bucket_bytes, names="model"):
        assert names == "checkpoint"  # a replacement runner of a push route hosts vLLM: checkpoint names
        return f"buckets of v{self.version} ({bucket_bytes} B)"


class FakeRunners:
    """An EnvRunnerGroup's surface: actors, workers, a generation that changes on restart, check_alive,
    the weights source of a replacement runner."""

    def __init__(self, actors: list[str]) -> None:
        self.actors = actors
        self.transfer_workers = [1] * len(actors)
        self.generation = len(actors)
        self.weights_source = None
        self.die_at_next_check: int | None = None

    def set_weights_source(self, source) -> None:
        self.weights_source = source

    def check_alive(self) -> int:
        if self.die_at_next_check is None:
            return 0
        index, self.die_at_next_check = self.die_at_next_check, None
        self.actors[index] += "'"  # the replacement
        self.generation += 1
        return 1


def test_push_route_forms_once_and_again_after_a_restart() -> None:
    learners, runners = FakeLearners(), FakeRunners(["a", "b"])
    route = PushRoute("nccl", bucket_bytes=64)
    assert route.name == "nccl" and route.num_formations == 0
    route.setup(learners, runners)
    assert route.reform(learners, runners) is False
    assert learners.calls == [("start", "nccl", ["a", "b"], [1, 1])]
    # a replacement runner loads the learner's current weights (the shm stream) before it joins
    learners.version = 3
    assert runners.weights_source() == (3, "buckets of v3 (64 B)")

    route.push(learners, runners)
    assert learners.calls[-1] == ("push", 3) and route.num_formations == 1

    runners.die_at_next_check = 1
    learners.version = 4
    route.push(learners, runners)
    assert learners.calls[-2:] == [("start", "nccl", ["a", "b'"], [1, 1]), ("push", 4)]
    assert route.num_formations == 2

    other = FakeRunners(["c", "d"])  # a restore builds a new EnvRunnerGroup
    other.generation = runners.generation  # even with the same generation count
    route.push(learners, other)
    assert learners.calls[-2:] == [("start", "nccl", ["c", "d"], [1, 1]), ("push", 4)]
    assert other.weights_source() == (4, "buckets of v4 (64 B)")

    route.stop()
    route.stop()
    assert learners.calls.count(("stop",)) == 1


def test_push_route_refuses_a_pull_route() -> None:
    with pytest.raises(ValueError, match=r"one of \('nccl', 'ipc'\); got 'shm' \(shm is pulled: use ShmRoute\)"):
        PushRoute("shm")
