"""Elastic env runners, the books without a cluster: a replacement Ray cannot place (its node left, no other
has room) leaves the run going on with the runners it has, counted (`env_runners/num_healthy`) and said once
on the console; when a node with room joins, the replacement starts with the current weights, without a restart.

The Ray calls are test doubles at the place the group makes them (as in test_worker_faults.py); a ping that
Ray has not answered stands for an actor waiting for a node. The drill on a real multi-node cluster is
tests/runtime/test_multi_node.py (``-m slow``).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import NodeDiedError

from flashrl.env_runners import EnvRunnerGroupError
from flashrl.env_runners import group as group_module
from flashrl.env_runners.group import EnvRunnerGroup, _RunnerSlot
from flashrl.env_runners.types import RunnerReport
from flashrl.metrics.iteration import IterationMetrics, IterationTimes, StreamCounts
from flashrl.weight_sync.messages import LoadWeights

from .test_stream import ep


class _Actor:
    """An EnvRunner handle's double: ``method.remote(*args)`` records (method, args) and returns a named ref."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, method: str) -> Any:
        actor = self

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> str:
                actor.calls.append((method, args))
                return f"{method}-{actor.name}-{sum(name == method for name, _ in actor.calls)}"

        return _Method

    @property
    def methods(self) -> list[str]:
        return [name for name, _ in self.calls]


class _Ray:
    """``ray`` as group.py calls it: refs in ``unplaced`` never get ready (their actor waits for a node);
    ``get`` raises ``errors[ref]``; a poll answers with one episode of its runner."""

    def __init__(self) -> None:
        self.errors: dict[str, BaseException] = {}
        self.unplaced: set[str] = set()
        self.killed: list[str] = []

    def _ready(self, ref: str) -> bool:
        return not any(f"-{actor}-" in ref for actor in self.unplaced)

    def wait(self, refs: list[str], num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
        ready = [ref for ref in refs if self._ready(ref)][:num_returns]
        return ready, [ref for ref in refs if ref not in ready]

    def get(self, ref: str, timeout: float | None = None) -> Any:
        if ref in self.errors:
            raise self.errors[ref]
        if ref.startswith("poll-"):
            runner = int(ref.split("-")[1][6])
            return RunnerReport(runner_index=runner, episodes=[ep(f"p{runner}")], in_flight=1, buffered=0, started=3)
        return None

    def kill(self, actor: _Actor, no_restart: bool = True) -> None:
        self.killed.append(actor.name)


def _group(monkeypatch, *, streaming: bool = True, budgeted: bool = False) -> tuple[EnvRunnerGroup, _Ray]:
    """Two runners (doubles) that stream; runner 1's node is about to leave."""
    fake = _Ray()
    monkeypatch.setattr(group_module, "ray", fake)
    group = EnvRunnerGroup.__new__(EnvRunnerGroup)
    group.spec = SimpleNamespace(
        train_batch_size=4, restart_failed_env_runners=True, max_num_env_runner_restarts=5, sample_timeout_s=60.0,
        num_cpus_per_env_runner=0.5, num_gpus_per_env_runner=0.0, custom_resources_per_env_runner={"rollout": 1},
    )
    group.num_runners, group.generation, group.num_restarts, group.num_lost_episodes = 2, 2, 0, 0
    group._repeats, group._weights, group._weights_source, group._weight_calls = None, None, None, {}
    group._budgeted, group._streaming = budgeted, streaming
    group.last_env_error = None
    replacements = iter("bcdef")

    def new_actor(index: int, start_counter: int) -> _Actor:
        group.generation += 1
        return _Actor(f"runner{index}{next(replacements)}")

    group._new_actor = new_actor
    group._slots = {
        0: _RunnerSlot(actor=_Actor("runner0"), started=3, granted=3 if budgeted else None, poll="poll-runner0-1"),
        1: _RunnerSlot(actor=_Actor("runner1"), started=2, in_flight=2, granted=2 if budgeted else None,
                       poll="poll-runner1-1"),
    }
    return group, fake


def _lose_runner_1(group: EnvRunnerGroup, fake: _Ray) -> _Actor:
    """Runner 1's node dies; no node has room for its replacement. Returns the replacement's handle."""
    fake.errors["poll-runner1-1"] = NodeDiedError("The node running this actor died.")
    fake.unplaced.add("runner1b")
    reports = group.next_reports(timeout_s=1.0)
    assert [r.runner_index for r in reports] == [0]  # the other runner's episodes still arrive
    return group._slots[1].actor


def test_a_replacement_without_a_node_leaves_the_run_going_with_fewer_runners_counted(monkeypatch, caplog):
    group, fake = _group(monkeypatch)
    monkeypatch.setattr(group_module, "PLACEMENT_WAIT_S", 0.0)
    with caplog.at_level(logging.WARNING, logger="flashrl.env_runners"):
        waiting = _lose_runner_1(group, fake)
        assert (group.num_healthy, group.num_runners, group.num_restarts) == (1, 2, 1)
        assert waiting.methods == ["ping"]  # nothing queued on an actor Ray has not placed
        assert [a.name for a in group.actors] == ["runner0"]  # a push route forms its group over the running ones
        group.broadcast_weights(7, "weights-v7")  # async: goes to the running runner only
        assert waiting.methods == ["ping"]
        for _ in range(3):
            group.next_reports(timeout_s=1.0)
    lines = [r.getMessage() for r in caplog.records if "cannot be placed" in r.getMessage()]
    assert lines == [(
        "EnvRunner 1 cannot be placed: no node has room for it (num_cpus=0.5, num_gpus=0, custom resources "
        "{'rollout': 1}); training goes on with 1 of 2 env runners (env_runners/num_healthy), and it starts "
        "when a node with room joins."
    )]  # once, not at every poll
    assert group.in_flight == 1  # runner 0's; the lost runner's 2 are booked as lost
    assert group.num_lost_episodes == 2


def test_when_a_node_with_room_joins_the_replacement_starts_with_the_current_weights(monkeypatch, caplog):
    group, fake = _group(monkeypatch)
    monkeypatch.setattr(group_module, "PLACEMENT_WAIT_S", 0.0)
    waiting = _lose_runner_1(group, fake)
    group.broadcast_weights(7, "weights-v7")
    generation = group.generation
    fake.unplaced.clear()  # a node joins: Ray places the waiting actor, its ping answers
    with caplog.at_level(logging.WARNING, logger="flashrl.env_runners"):
        group.next_reports(timeout_s=1.0)
    assert group.num_healthy == 2
    assert waiting.methods[:3] == ["ping", "start", "poll"]
    assert waiting.calls[1] == ("start", (7, "weights-v7", None))  # the current weights, before its first episode
    assert group.generation == generation + 1  # a push route forms its transfer group again, with it
    assert [a.name for a in group.actors] == ["runner0", "runner1b"]
    assert group.num_restarts == 1  # the same replacement, started late: no second restart
    assert any(r.getMessage() == "EnvRunner 1 was placed and starts: 2 of 2 env runners running."
               for r in caplog.records)


def test_a_quick_replacement_says_nothing_about_placement(monkeypatch, caplog):
    group, fake = _group(monkeypatch)  # PLACEMENT_WAIT_S as shipped: a replacement placed at once is no news
    fake.errors["poll-runner1-1"] = NodeDiedError("The node running this actor died.")
    with caplog.at_level(logging.WARNING, logger="flashrl.env_runners"):
        group.next_reports(timeout_s=1.0)
    assert group.num_healthy == 2 and group._slots[1].actor.methods == ["ping", "start", "poll"]
    assert not [r for r in caplog.records if "placed" in r.getMessage()]


def test_the_admission_budget_goes_to_running_runners_only(monkeypatch):
    group, fake = _group(monkeypatch, budgeted=True)
    waiting = _lose_runner_1(group, fake)
    granted = group.granted
    group.grant(granted + 4)
    assert group._slots[1].granted == group._slots[1].started  # nothing granted to the waiting runner
    assert group._slots[0].granted == 3 + 4
    assert "set_start_limit" not in waiting.methods


def test_sync_sampling_gives_a_lost_runners_share_to_a_running_one(monkeypatch):
    group, fake = _group(monkeypatch, streaming=False)
    monkeypatch.setattr(group_module, "PLACEMENT_WAIT_S", 0.0)
    fake.errors["sample-runner1-1"] = NodeDiedError("The node running this actor died.")
    fake.unplaced.add("runner1b")
    group.sample([10, 11, 12, 13], group_size=2)
    shares = [(args[0]) for name, args in group._slots[0].actor.calls if name == "sample"]
    assert shares == [[10, 12], [11, 13]]  # its own share, then runner 1's
    assert group.num_lost_episodes == 2 * 2
    group.sample([14, 15], group_size=2)  # while runner 1 waits for a node, runner 0 takes every prompt
    assert group._slots[0].actor.calls[-1] == ("sample", ([14, 15],))
    assert group._slots[1].actor.methods == ["ping"]


def test_a_replacement_placed_in_sync_mode_loads_the_weights_before_it_samples(monkeypatch):
    group, fake = _group(monkeypatch, streaming=False)
    group._weights = (3, "weights-v3")
    fake.errors["sample-runner1-1"] = NodeDiedError("The node running this actor died.")
    group.sample([10, 11], group_size=1)
    replacement = group._slots[1].actor
    assert replacement.calls[:3] == [("ping", ()), ("weight_sync", (LoadWeights(3, "weights-v3"),)),
                                     ("sample", ([11],))]


def test_no_runner_placed_within_the_timeout_is_an_error_naming_the_requests(monkeypatch):
    group, fake = _group(monkeypatch, streaming=False)
    for index, name in ((0, "sample-runner0-1"), (1, "sample-runner1-1")):
        fake.errors[name] = NodeDiedError("The node running this actor died.")
    fake.unplaced.update({"runner0b", "runner1c"})
    with pytest.raises(EnvRunnerGroupError, match=r"No env runner runs: none of the 2 replacements was placed within "
                                                  r"sample_timeout_s=60 s\. Expected a node with room for one \("
                                                  r"num_cpus=0\.5, num_gpus=0, custom resources \{'rollout': 1\}\)"):
        group.sample([10, 11], group_size=1)


def test_the_iteration_reports_healthy_and_configured_runners():
    metrics = IterationMetrics(smoothing_window=4)
    counts = StreamCounts(episodes=1, generated_tokens=2, env_steps=1, skipped={}, lost=2, restarts=1, started=3,
                          in_flight=1, pending=0, healthy_runners=1, configured_runners=2)
    episode = ep("x")
    out = metrics.update([episode], lags=[0], generated_tokens=2, counts=counts, learner_version=1,
                         learner_metrics={}, times=IterationTimes(0.0, 0.1, 0.1, 0.5))
    assert (out["env_runners/num_healthy"], out["env_runners/num_configured"]) == (1.0, 2.0)


@pytest.mark.parametrize("bad", [{"CPU": 1}, {"GPU": 1}, {"rollout": -1}, {"": 1}, {"rollout": "1"}, ["rollout"]])
def test_custom_resources_that_ray_would_refuse_or_never_place_are_config_errors(bad):
    from flashrl.algorithms import FlashReinforceConfig
    from flashrl.algorithms.flash_reinforce.config import ConfigError

    for section, name in (("env_runners", "custom_resources_per_env_runner"), ("learners", "custom_resources_per_learner")):
        config = getattr(FlashReinforceConfig().environment("flashrl/Math-v0"), section)(**{name: bad})
        with pytest.raises(ConfigError) as caught:
            config.validate()
        assert str(caught.value).count(f"{name}: expected a dict of Ray custom resource name (not CPU, GPU, "
                                       f"memory) -> amount >= 0, got {bad!r}") == 1


def test_custom_resources_reach_the_actors_bundles():
    from flashrl.algorithms import FlashReinforceConfig

    config = (FlashReinforceConfig().environment("flashrl/Math-v0")
              .env_runners(num_env_runners=2, num_cpus_per_env_runner=0.5, custom_resources_per_env_runner={"rollout": 1})
              .learners(num_learners=1, custom_resources_per_learner={"train": 0.5}))
    assert config.resource_bundles() == [{"CPU": 0.5}, {"CPU": 1.0, "train": 0.5},
                                         {"CPU": 0.5, "rollout": 1}, {"CPU": 0.5, "rollout": 1}]  # Tune's bundles
    assert config.env_runner_spec().custom_resources_per_env_runner == {"rollout": 1}


def test_runners_that_never_start_are_an_error_naming_their_custom_resources(monkeypatch):
    from ray.exceptions import GetTimeoutError

    group, fake = _group(monkeypatch)

    def never(ref, timeout=None):
        raise GetTimeoutError("timed out")

    monkeypatch.setattr(fake, "get", never)
    with pytest.raises(EnvRunnerGroupError, match=r"did not start their engines within 900 s\. If the cluster is "
                                                  r"small, check that the actors' CPU requests fit \("
                                                  r"num_cpus_per_env_runner=0\.5, custom_resources_per_env_runner="
                                                  r"\{'rollout': 1\}: a node must offer them\)"):
        group._get(["setup-runner0-1"], "start their engines", timeout_s=900.0)
