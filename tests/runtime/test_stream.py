"""EpisodeStream on a scripted runner group: batches, the admission budget, staleness, stalls, books.

`ScriptedGroup` has the `EnvRunnerGroup` interface the stream uses and answers `next_reports` from a
script, so every grant, drop and error message can be checked exactly, without Ray.
"""

from __future__ import annotations

import time
from collections import Counter, deque

import pytest

from flashrl.env_runners import EnvRunnerGroupError, EnvRunnerSpec, EpisodeStream, RunnerReport
from flashrl.episode import Episode


def ep(prompt: str, version: int = 0, *, reward: float = 0.0, info: dict | None = None) -> Episode:
    return Episode(prompt, [1, 2, 3], [False, True, True], [0.0, -0.5, -0.25], reward=reward,
                   policy_versions=[version], info=dict(info or {}))


def report(*episodes: Episode, skipped: dict | None = None, tokens: int = 0, steps: int = 0) -> RunnerReport:
    return RunnerReport(0, list(episodes), 0, 0, 0, skipped=Counter(skipped or {}), generated_tokens=tokens,
                        env_steps=steps)


class ScriptedGroup:
    """The runner group's interface, answering polls from `script` (a list of report lists)."""

    def __init__(self, script=(), *, num_env_runners: int = 1, **spec) -> None:
        spec = {"env": "scripted-v0", "train_batch_size": 2, "sample_timeout_s": 0.05, **spec}
        self.spec = EnvRunnerSpec(num_env_runners=num_env_runners, **spec)
        self.model_path = "unused"
        self.script = deque(script)
        self.streaming = False
        self.started_at: int | None | str = "never"
        self.grants: list[int | None] = []
        self.num_lost_episodes = 0
        self.num_restarts = 0
        self.in_flight = 0
        self.started_counters = [0] * num_env_runners
        self.num_runners = self.num_healthy = num_env_runners
        self.samples: list[tuple] = []
        self.stopped = False

    def start_streaming(self, allowed=None) -> None:
        self.streaming, self.started_at = True, allowed

    def grant(self, allowed) -> None:
        self.grants.append(allowed)

    def next_reports(self, timeout_s: float) -> list[RunnerReport]:
        if not self.script:  # as the real group: nothing ready within the timeout
            time.sleep(timeout_s)
            return []
        return list(self.script.popleft())

    def sample(self, indices, *, group_size, evaluation=False, split=None):
        self.samples.append((list(indices), group_size, evaluation, split))
        return [self.script.popleft()]

    def evaluation_size(self, split=None):
        return {None: None, "a": 3, "b": 2}[split]

    def stop(self) -> None:
        self.stopped = True


def test_a_batch_takes_distinct_prompts_in_arrival_order_and_books_the_rest():
    group = ScriptedGroup(
        [[report(ep("x"), ep("x"), tokens=7, steps=2)], [report(ep("y"), ep("z"), tokens=5)]]
    )
    stream = EpisodeStream(group)
    batch = stream.next_batch(learner_version=0)
    assert [e.prompt_id for e in batch.episodes] == ["x", "y"]
    assert batch.group_ids is None and (batch.generated_tokens, batch.env_steps) == (12, 2)
    assert [e.prompt_id for e in stream.pending] == ["x", "z"]  # the repeat and the overflow wait
    assert stream.totals == {"episodes": 2, "generated_tokens": 12, "env_steps": 2}
    assert group.started_at is None and set(group.grants) == {None}  # no async_queue_size: no budget
    # The waiting episodes open the next batch, before anything new arrives.
    again = stream.next_batch(learner_version=1)
    assert [e.prompt_id for e in again.episodes] == ["x", "z"] and not stream.pending
    assert again.reports == [] and stream.totals["episodes"] == 4


def test_the_admission_budget_counts_trained_skipped_lost_and_blocked_episodes():
    # Q = 1, B = 2: started - (trained + skipped + lost + blocked) <= 2.
    group = ScriptedGroup(
        [[report(ep("a"), skipped={"aborted": 1})], [report(ep("a"), ep("b"))]], async_queue_size=1
    )
    group.num_lost_episodes = 3
    stream = EpisodeStream(group)
    stream.next_batch(learner_version=0)
    # Start: nothing settled but the 3 lost -> 3 + 2. After report 1: + 1 aborted. After report 2: the
    # second "a" waits blocked (its prompt is in the batch) -> + 1. At the end the batch's 2 are
    # consumed and the waiting "a" fits the next, empty batch: 3 + 1 + 2 + 2.
    assert group.started_at == 5
    assert group.grants == [6, 7, 8]
    assert stream.allowed_starts(blocked=0) == 3 + 1 + 2 + 2  # the same, now booked as trained
    assert stream.totals["skipped/aborted"] == 1
    assert EpisodeStream(ScriptedGroup()).allowed_starts(blocked=5) is None


def test_stale_episodes_are_dropped_counted_and_name_the_fix_when_they_stall_the_batch():
    old = [[report(ep("a", version=3))] for _ in range(1000)]
    group = ScriptedGroup(old, async_queue_size=1)
    stream = EpisodeStream(group, wait_slice_s=0.01)
    with pytest.raises(EnvRunnerGroupError) as err:
        stream.next_batch(learner_version=5)
    message = str(err.value)
    assert "The batch has not grown for 0.05 s (sample_timeout_s)" in message
    assert "0 repeated one of the 0 prompts already in the batch" in message
    assert "async_queue_size=1" in message and "0/2 collected" in message
    assert "raise async_queue_size (or None)" in message
    dropped = 1000 - len(group.script)
    assert stream.totals["skipped/stale"] == dropped > 0 and not stream.pending


def test_too_few_distinct_prompts_stall_with_the_prompt_count_and_keep_the_batch_pending():
    group = ScriptedGroup([[report(ep("a"))]] + [[report(ep("a"))] for _ in range(1000)], train_batch_size=3)
    stream = EpisodeStream(group, wait_slice_s=0.01)
    with pytest.raises(EnvRunnerGroupError, match="fewer distinct prompts than train_batch_size") as err:
        stream.next_batch(learner_version=0)
    assert "repeated one of the 1 prompts already in the batch and 0 were stale" in str(err.value)
    assert "1/3 collected" in str(err.value)
    # Nothing is dropped silently: the partial batch and the waiting episodes stay pending (bounded).
    assert all(e.prompt_id == "a" for e in stream.pending)
    assert stream.pending_capacity == 2 * 3
    overflow = stream.totals["skipped/pending_overflow"]
    assert len(stream.pending) == stream.pending_capacity + 1 and overflow > 0


def test_no_arrival_within_the_timeout_says_what_is_in_flight():
    group = ScriptedGroup([])
    group.in_flight = 6
    stream = EpisodeStream(group, wait_slice_s=0.01)
    with pytest.raises(EnvRunnerGroupError) as err:
        stream.next_batch(learner_version=0)
    assert str(err.value) == (
        "No finished episode arrived for 0.05 s (sample_timeout_s); 0/2 collected, 6 in flight. "
        "Raise sample_timeout_s for slow environments, or lower max_new_tokens."
    )


def test_a_stall_of_dropped_episodes_counts_each_outcome_and_names_its_setting():
    # Before: "Raise sample_timeout_s for slow environments, or lower max_new_tokens", whatever ended the episodes.
    drops = [[report(skipped={"env_timeout": 3, "empty": 1})], [report(skipped={"env_timeout": 2, "bad_reward": 1})]]
    group = ScriptedGroup(drops, env_timeout_s=5.0, agent_wall_time_s=30.0)
    group.in_flight = 4
    stream = EpisodeStream(group, wait_slice_s=0.01)
    with pytest.raises(EnvRunnerGroupError) as err:
        stream.next_batch(learner_version=0)
    message = str(err.value)
    assert "0/2 collected, 4 in flight; meanwhile 7 episodes ended dropped: 5 env_timeout (an env call past " \
           "env_timeout_s=5.0, or an agent past agent_wall_time_s=30.0); 1 bad_reward (" in message
    assert "; 1 empty (no model call" in message
    assert "Raise sample_timeout_s" not in message and "not slow" in message


def test_sync_group_rounds_walk_the_prompt_cursor_and_sort_by_index_and_replica():
    order = ((1, 1), (0, 1), (1, 0), (0, 0))
    played = [ep(f"p{i}", info={"episode_index": i, "replica": r}) for i, r in order]
    group = ScriptedGroup([report(*played, skipped={"empty": 2}), report()], train_batch_size=4)
    stream = EpisodeStream(group, rollout_mode="sync_group", group_size=2)
    batch = stream.next_batch(learner_version=0)
    assert [(e.info["episode_index"], e.info["replica"]) for e in batch.episodes] == sorted(order)
    assert batch.group_ids == [0, 0, 1, 1]
    assert group.samples == [([0, 1], 2, False, None)] and stream.cursor == 2
    assert stream.totals == {"episodes": 4, "skipped/empty": 2, "generated_tokens": 0, "env_steps": 0}
    with pytest.raises(EnvRunnerGroupError, match="Every one of the 4 episodes of this round was dropped"):
        stream.next_batch(learner_version=1)
    assert group.samples[-1] == ([2, 3], 2, False, None)


def test_bad_arguments_say_what_was_expected():
    with pytest.raises(ValueError, match="expected rollout_mode in .* got 'sync'"):
        EpisodeStream(ScriptedGroup(), rollout_mode="sync")
    with pytest.raises(ValueError, match="train_batch_size=2 to be a multiple of group_size"):
        EpisodeStream(ScriptedGroup(), rollout_mode="sync_group", group_size=3)


def test_evaluation_over_the_splits_at_start_once_and_every_n_iterations():
    splits = {"a": {"split": "a"}, "b": {"split": "b"}}
    a = [ep(f"a-{i}", reward=r, info={"episode_index": i, "replica": 0}) for i, r in enumerate([1, 0, 1])]
    b = [ep(f"b-{i}", reward=r, info={"episode_index": i, "replica": 0}) for i, r in enumerate([0, 0.5])]
    group = ScriptedGroup([report(*a), report(*b)], evaluation_splits=splits, evaluation_num_episodes=10)
    stream = EpisodeStream(group, evaluation_interval=2, evaluation_at_start=True)
    assert stream.evaluate_at_start(iteration=0, learner_version=1) == {}  # a resumed run
    metrics = stream.evaluate_at_start(iteration=0, learner_version=0)
    # Each finite split played once per task, in order, with k = 1 sample per prompt.
    assert group.samples == [([0, 1, 2], 1, True, "a"), ([0, 1], 1, True, "b")]
    assert metrics["evaluation/a/avg@1"] == pytest.approx(2 / 3) and metrics["evaluation/b/avg@1"] == 0.25
    assert metrics["evaluation/avg@1"] == pytest.approx(2.5 / 5)
    assert metrics["evaluation/learner_version"] == 0.0
    assert metrics["timers/evaluation_s"] >= 0
    assert [e.prompt_id for e in stream.last_evaluation["b"][0].episodes] == ["b-0", "b-1"]
    assert stream.evaluate_at_start(iteration=0, learner_version=0) == {}  # once
    assert [stream.evaluation_due(i) for i in range(1, 5)] == [False, True, False, True]
    assert not EpisodeStream(ScriptedGroup()).evaluation_due(2)  # evaluation_interval None


def test_state_round_trips_the_books_and_counts_what_is_unsaved_as_lost():
    group = ScriptedGroup([[report(ep("x"), ep("x"), ep("y"), skipped={"over_long": 1}, tokens=9, steps=3)]])
    group.num_lost_episodes, group.num_restarts, group.in_flight = 2, 1, 4
    group.started_counters = [11]
    stream = EpisodeStream(group)
    stream.next_batch(learner_version=0)
    state = stream.state()
    assert state == {
        "sync_cursor": 0,
        "runner_cursors": [11],
        "data_passes": None,  # an infinite task source has no passes
        "totals": {"skipped/over_long": 1, "episodes": 2, "generated_tokens": 9, "env_steps": 3},
        "num_lost_episodes": 2 + 4 + 1,  # lost + in flight + the pending "x"
        "num_restarts": 1,
    }
    counts = stream.counts()
    assert (counts.episodes, counts.pending, counts.started, counts.lost) == (2, 1, 11, 2)
    assert counts.skipped["over_long"] == 1 and counts.skipped["stale"] == 0

    fresh_group = ScriptedGroup()
    counters = []
    fresh_group.set_counters = counters.append
    fresh = EpisodeStream(fresh_group)
    fresh.pending.append(ep("z"))
    fresh.set_state(state)
    assert counters == [[11]] and not fresh.pending
    assert (fresh_group.num_lost_episodes, fresh_group.num_restarts, fresh.cursor) == (7, 1, 0)
    assert fresh.totals == state["totals"]
    with pytest.raises(KeyError, match=r"missing \['runner_cursors'\]"):
        fresh.set_state({"sync_cursor": 0})
