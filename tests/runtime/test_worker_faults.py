"""Every way Ray reports a worker gone replaces that EnvRunner (or fails the learner group, which the
algorithm restarts), with the books kept; stopping after such a failure does not raise.

The Ray calls are replaced by test doubles at the place the groups make them, so each kind of
``ray.exceptions.RayError`` can be injected without killing processes.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import ray
from ray.exceptions import (
    NodeDiedError,
    ObjectLostError,
    OutOfMemoryError,
    RayActorError,
    RayTaskError,
    WorkerCrashedError,
)

from flashrl.env_runners import EnvRunnerGroup, EnvRunnerGroupError
from flashrl.env_runners import group as group_module
from flashrl.env_runners.env_errors import EnvErrorStreak
from flashrl.env_runners.group import REPEATED_ERROR_LIMIT, _RunnerSlot, is_death
from flashrl.env_runners.types import RunnerReport
from flashrl.learners import LearnerGroup, LearnerGroupError

DEATHS = {
    "OutOfMemoryError": lambda: OutOfMemoryError("Task was killed due to the node running low on memory."),
    "WorkerCrashedError": lambda: WorkerCrashedError(),
    "NodeDiedError": lambda: NodeDiedError("The node running this actor died."),
    "ObjectLostError": lambda: ObjectLostError("ab" * 14, None, "EnvRunner.poll"),
    "RayActorError": lambda: RayActorError(actor_init_failed=False),
}
ALL_KINDS = {
    **DEATHS,
    "RayTaskError": lambda: RayTaskError("EnvRunner.poll", "Traceback ...", RuntimeError("engine failed")),
}


class _Method:
    def __init__(self, actor: _Actor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any) -> str:
        self.actor.calls.append(self.name)
        return f"{self.name}-{self.actor.name}-{self.actor.calls.count(self.name)}"


class _Actor:
    """An EnvRunner actor handle's double: each ``method.remote()`` returns a named reference."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)


class _Ray:
    """The ``ray`` functions group.py calls: ``get`` raises ``errors[ref]``, every reference is ready."""

    def __init__(self, errors: dict[str, BaseException]) -> None:
        self.errors = errors
        self.killed: list[str] = []

    def wait(self, refs: list[Any], num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
        return list(refs[:num_returns]), list(refs[num_returns:])

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        for one in ref if isinstance(ref, list) else [ref]:
            if one in self.errors:
                raise self.errors[one]
        if isinstance(ref, list):
            return [None] * len(ref)
        runner = int(ref.split("-")[2][-1])
        return RunnerReport(runner_index=runner, episodes=[], in_flight=1, buffered=0, started=9)

    def kill(self, actor: _Actor, no_restart: bool = True) -> None:
        self.killed.append(actor.name)


def _group(monkeypatch, errors: dict[str, BaseException]) -> tuple[EnvRunnerGroup, _Ray]:
    """A streaming group of two runners (doubles); runner 0 has 3 episodes in flight and 2 buffered."""
    fake = _Ray(errors)
    monkeypatch.setattr(group_module, "ray", fake)
    group = EnvRunnerGroup.__new__(EnvRunnerGroup)  # no actors: the bookkeeping with doubles
    group.spec = SimpleNamespace(train_batch_size=4, restart_failed_env_runners=True, max_num_env_runner_restarts=3,
                                 sample_timeout_s=60.0)
    group.num_runners, group.generation, group.num_restarts, group.num_lost_episodes = 2, 2, 0, 0
    group._repeats, group._weights, group._weights_source, group._weight_calls = None, None, None, {}
    group._budgeted, group._streaming = False, True
    created: list[tuple[int, int]] = []

    def new_actor(index: int, start_counter: int) -> _Actor:
        created.append((index, start_counter))
        return _Actor(f"runner{index}b")

    group._new_actor = new_actor
    group.created = created
    group._slots = {
        0: _RunnerSlot(actor=_Actor("runner0"), started=7, in_flight=3, buffered=2, poll="poll-runner0-1"),
        1: _RunnerSlot(actor=_Actor("runner1"), started=5, in_flight=1, buffered=0, poll="poll-runner1-1"),
    }
    return group, fake


@pytest.mark.parametrize("kind", list(ALL_KINDS))
def test_every_ray_error_of_a_poll_replaces_the_runner_and_counts_its_episodes_lost(monkeypatch, kind):
    group, fake = _group(monkeypatch, {"poll-runner0-1": ALL_KINDS[kind]()})
    reports = group.next_reports(timeout_s=1.0)
    assert [r.runner_index for r in reports] == [1]  # the other runner's report still arrives
    assert group.num_restarts == 1
    assert group.num_lost_episodes == 5  # its 3 in flight + 2 buffered, from its last report
    assert fake.killed == ["runner0"]
    assert group.created == [(0, 7)]  # the replacement goes on from the failed runner's data cursor
    replacement = group._slots[0]
    assert replacement.actor.name == "runner0b" and replacement.started == 7
    assert replacement.actor.calls == ["ping", "start", "poll"]  # it streams once placed (here: at once)
    assert group.in_flight == 1  # runner 1's episode; the replacement has none yet


@pytest.mark.parametrize("kind", list(DEATHS))
def test_a_failed_ping_or_weight_load_replaces_the_runner_too(monkeypatch, kind):
    group, _ = _group(monkeypatch, {"ping-runner1-1": DEATHS[kind]()})
    assert group.check_alive() == 1
    assert group.created == [(1, 5)]
    group, _ = _group(monkeypatch, {"weight_sync-runner0-1": DEATHS[kind]()})
    group._streaming = False
    group.broadcast_weights(1, "weights", wait=True)
    assert group.num_restarts == 1 and group.created == [(0, 7)]


@pytest.mark.parametrize("kind", list(DEATHS))
def test_deaths_are_restarted_within_the_bound_then_the_run_stops_naming_them(monkeypatch, kind):
    group, _ = _group(monkeypatch, {})
    fake = group_module.ray
    for n in range(3):
        fake.errors = {group._slots[0].poll: DEATHS[kind]()}
        group.next_reports(timeout_s=1.0)
        assert group.num_restarts == n + 1  # deaths never count as a repeated (deterministic) error
    fake.errors = {group._slots[0].poll: DEATHS[kind]()}
    with pytest.raises(EnvRunnerGroupError, match=rf"EnvRunner 0 failed \({kind}.*after 3 restarts"):
        group.next_reports(timeout_s=1.0)


@pytest.mark.parametrize("kind", list(ALL_KINDS))
def test_stop_after_a_failure_cleans_up_without_raising(monkeypatch, kind):
    group, fake = _group(monkeypatch, {"stop-runner0-1": ALL_KINDS[kind]()})
    group.stop()
    assert fake.killed == ["runner0", "runner1"] and group._slots == {}


def test_which_errors_are_deaths():
    assert all(is_death(make()) for make in DEATHS.values())
    assert not is_death(ALL_KINDS["RayTaskError"]())
    assert not is_death(RayActorError(actor_init_failed=True, error_msg="init"))
    assert not is_death(ray.exceptions.GetTimeoutError("slow"))
    assert not is_death(ValueError("not Ray's"))


def test_an_env_error_streak_stops_the_run_at_once_without_a_restart():
    group = EnvRunnerGroup.__new__(EnvRunnerGroup)
    group._repeats = None
    streak = EnvErrorStreak("the same environment error ended 20 episodes in a row: KeyError: 'answer'")
    err = RayTaskError("EnvRunner.poll", "Traceback ...", streak)
    with pytest.raises(EnvRunnerGroupError, match=r"EnvRunner 0 stopped the run: the same environment error .*"
                                                  r"KeyError: 'answer'"):
        group._stop_on_a_repeated_error(0, err)
    assert REPEATED_ERROR_LIMIT > 1  # not the streak of restarts: the first such error stops the run


# ------------------------------------------------------------------------------------------
# learners
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(DEATHS))
def test_every_ray_error_of_a_learner_call_fails_the_group_so_the_algorithm_restarts_it(monkeypatch, kind):
    group = LearnerGroup.__new__(LearnerGroup)  # no actors: the call path with doubles
    group.timeout_s, group._broken, group._local, group.local = 60.0, None, None, False
    group._actors = ["learner0", "learner1"]
    killed = []
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (refs[:1], refs[1:]))

    def get(ref, timeout=None):
        if ref == "update-1":
            raise DEATHS[kind]()
        return ref

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append(actor))
    with pytest.raises(LearnerGroupError, match=rf"learner actor rank 1 died during 'update' \({kind}\)"):
        group._call("update", ["update-0", "update-1"])
    assert group.failure is not None and kind in group.failure  # FlashReinforce restarts a group with a failure
    assert killed == ["learner0", "learner1"]
    group.shutdown()  # after the failure: no raise
