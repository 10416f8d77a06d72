"""The GPU push route's control flow on CPU: when the transfer group is formed, re-formed and used.

vLLM's trainer engine (the NCCL broadcast / CUDA-IPC mapping) needs a GPU, so here it is replaced at
the one seam where flashrl hands over to vLLM (`flashrl.weight_sync.push.start_push_transfer`); everything around it is real:
the `Learner` and its `LearnerGroup`, the `EnvRunnerSyncClient` they build, and `PushRoute`. What
these cannot show is that the data plane runs on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from flashrl.learners import Learner, LearnerGroup
from flashrl.weight_sync import push, vllm_push
from flashrl.weight_sync.messages import PutBuckets
from flashrl.weight_sync.push import PushRoute
from flashrl.weight_sync.vllm_push import AbortTransfer, Push, ReleaseTransfer, StartPush, StopPush


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

    def fake_start(transport, weights, client, **kwargs):
        engine = FakeTrainerEngine(log, transport.name, client, {"weights": weights, **kwargs})
        engines.append(engine)
        log.append(("start", transport.name))
        return engine

    monkeypatch.setattr(push, "start_push_transfer", fake_start)
    return engines, log


def test_learner_forms_pushes_and_tears_down(make_spec, batch, fake_engines) -> None:
    engines, log = fake_engines
    learner = Learner(make_spec(dtype="bfloat16"))
    with pytest.raises(RuntimeError, match="Push before StartPush"):
        learner.sync_weights(Push())
    runners = ["runner-a", "runner-b"]
    learner.sync_weights(StartPush("nccl", tuple(runners), (2, 1), master_address="10.0.0.1", master_port=29555,
                                   bucket_bytes=2**20))  # fmt: skip
    (engine,) = engines
    assert engine.route == "nccl"
    weights = engine.kwargs["weights"]  # the learner's extractor: its policy, gathered on its device
    assert weights._model() is learner.policy.model
    assert engine.kwargs["rank"] == 0 and weights.device == torch.device("cpu")
    assert weights.dtype == torch.bfloat16  # what the engine serves, as on the shm route
    assert (engine.kwargs["master_address"], engine.kwargs["master_port"]) == ("10.0.0.1", 29555)
    assert engine.kwargs["bucket_bytes"] == 2**20
    # one group: the learner (rank 0) and the 3 workers of the two engines
    assert engine.client.runners == runners and engine.client.world_size == 4

    learner.update(batch)
    assert learner.sync_weights(Push()) == 1
    assert log[-1] == ("send", 1)  # the client stamps the runners with the learner's version

    learner.sync_weights(StartPush("nccl", tuple(runners), (2, 1), master_address="10.0.0.1", master_port=29556))
    assert engines[0].closed and not engines[1].closed  # forming again tears the old group down first
    learner.sync_weights(StopPush())
    learner.sync_weights(StopPush())  # idempotent
    assert engines[1].closed and log.count(("shutdown",)) == 2


def test_a_hung_or_failed_push_is_torn_down_on_both_sides(make_spec, fake_engines) -> None:
    """A send that outlives its deadline (a broadcast whose peer stopped receiving) raises, shuts the
    learner's side down and has every runner abort; the next start forms the group again."""
    import threading

    from flashrl.weight_sync.vllm_push import TransferTimeout

    engines, log = fake_engines
    learner = Learner(make_spec())
    learner.sync_weights(StartPush("nccl", ("r0", "r1"), (1, 1), master_address="h", master_port=1, deadline_s=0.3))
    (engine,) = engines
    runner_calls: list = []
    engine.client._all = runner_calls.append
    release = threading.Event()
    engine.send_weights = lambda: release.wait(30)  # hangs until the communicator is aborted
    engine.shutdown = lambda: (log.append(("shutdown",)), release.set())
    aborted = [[AbortTransfer("a pushed transfer ran out of time")] * 2]  # one message per runner
    with pytest.raises(TransferTimeout):
        learner.sync_weights(Push())
    assert log[-1] == ("shutdown",)
    assert runner_calls == aborted
    with pytest.raises(RuntimeError, match="Push before StartPush"):
        learner.sync_weights(Push())  # the group is gone
    learner.sync_weights(StopPush())  # nothing left to tear down
    assert runner_calls == aborted

    learner.sync_weights(StartPush("nccl", ("r0", "r1"), (1, 1), master_address="h", master_port=1, deadline_s=5))
    engine = engines[-1]
    engine.client._all = runner_calls.append

    def broken() -> None:
        raise RuntimeError("NCCL error: remote process exited")

    engine.send_weights = broken
    with pytest.raises(RuntimeError, match="NCCL error"):
        learner.sync_weights(Push())
    assert engine.closed and all(isinstance(m, AbortTransfer) for m in runner_calls[-1])
    assert "NCCL error" in runner_calls[-1][0].reason


def test_a_normal_stop_releases_the_runners_side_too(make_spec, fake_engines) -> None:
    engines, _ = fake_engines
    learner = Learner(make_spec())
    learner.sync_weights(StartPush("ipc", ("r0",), (1,), master_address="h", master_port=1))
    runner_calls: list = []
    engines[0].client._all = runner_calls.append
    learner.sync_weights(StopPush())
    assert engines[0].closed and runner_calls == [[ReleaseTransfer()]]


def test_local_learner_group_passes_a_rendezvous_address(make_spec, fake_engines) -> None:
    engines, _ = fake_engines
    group = LearnerGroup(make_spec(), local=True)
    try:
        group.sync_weights(StartPush("ipc", ("runner",), (1,)))
        (engine,) = engines
        assert isinstance(engine.kwargs["master_address"], str) and engine.kwargs["master_address"]
        assert 0 < engine.kwargs["master_port"] < 65536
        assert group.sync_weights(Push()) == 0 and engines[0].sent == 1
        group.sync_weights(StopPush())
        assert engines[0].closed
    finally:
        group.shutdown()


class FakeLearners:
    def __init__(self) -> None:
        self.version = 0
        self.calls: list = []

    def sync_weights(self, message):
        match message:
            case StartPush(route, actors, workers):
                self.calls.append(("start", route, list(actors), list(workers)))
            case Push():
                self.calls.append(("push", self.version))
                return self.version
            case StopPush():
                self.calls.append(("stop",))
            case PutBuckets(bucket_bytes, names):
                assert names == "checkpoint"  # a replacement runner of a push route hosts vLLM: checkpoint names
                return f"buckets of v{self.version} ({bucket_bytes} B)"
            case _:
                raise AssertionError(f"unexpected message {message!r}")
        return None


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
