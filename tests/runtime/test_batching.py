"""BatchAssembler: B distinct prompts in arrival order, a bounded waiting queue, the lag bound."""

from __future__ import annotations

from flashrl.env_runners.batching import BatchAssembler
from flashrl.episode import Episode


def ep(prompt: str, version: int = 0) -> Episode:
    return Episode(prompt, [1, 2], [False, True], [0.0, -0.5], reward=0.0, policy_versions=[version])


def test_distinct_prompts_in_arrival_order_and_the_rest_waits():
    a = BatchAssembler(3, pending_capacity=10, learner_version=0)
    a.offer_all([ep("x"), ep("x"), ep("y"), ep("z"), ep("w")])
    assert a.full and [e.prompt_id for e in a.batch] == ["x", "y", "z"]
    assert [e.prompt_id for e in a.later] == ["x", "w"]
    assert a.repeated == 1 and a.take_skipped() == {}
    assert a.blocked() == 1  # the second x; w could join a batch without w
    assert a.blocked(set()) == 0  # the next batch is empty: x and w both fit


def test_the_waiting_queue_is_bounded_and_drops_the_oldest_counted():
    a = BatchAssembler(2, pending_capacity=3, learner_version=0)
    a.offer_all([ep("x")] + [ep("x", version=v) for v in range(1, 6)])
    assert [e.prompt_id for e in a.batch] == ["x"]
    assert [e.min_policy_version for e in a.later] == [3, 4, 5]
    assert a.take_skipped() == {"pending_overflow": 2}
    assert a.take_skipped() == {}  # taken once
    assert a.blocked() == 3


def test_episodes_beyond_the_lag_bound_are_dropped_counted():
    a = BatchAssembler(4, pending_capacity=10, learner_version=5, max_lag=2)
    a.offer_all([ep("a", 5), ep("b", 3), ep("c", 2), ep("d", 0)])
    assert [e.prompt_id for e in a.batch] == ["a", "b"]
    assert a.take_skipped() == {"stale": 2}
    unbounded = BatchAssembler(4, pending_capacity=10, learner_version=5)
    unbounded.offer_all([ep("a", 5), ep("d", 0)])
    assert len(unbounded.batch) == 2
