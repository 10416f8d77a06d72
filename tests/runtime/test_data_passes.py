"""Training data in seeded passes without replacement: the order, max_samples, the horizon, blending,
and (with real EnvRunner actors) one pass played exactly once and a resumed run continuing its pass."""

from __future__ import annotations

import json

import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.algorithms.flash_reinforce.config import ConfigError
from flashrl.env_runners.data_passes import DataPasses, DataPassesError
from flashrl.envs.math.tasks import MathTask, TaskList, blend_tasks


def _write_tasks(path, n: int) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1), "id": f"t{i}"}) + "\n" for i in range(n))
    return str(path)


# ------------------------------------------------------------------------------------------ the order
def test_each_pass_is_a_permutation_and_the_passes_differ():
    passes = DataPasses(7, seed=3)
    first = [passes.task_index(k) for k in range(7)]
    second = [passes.task_index(k) for k in range(7, 14)]
    assert sorted(first) == list(range(7)) and sorted(second) == list(range(7))
    assert first != second
    assert [DataPasses(7, seed=3).task_index(k) for k in range(14)] == first + second  # a function of the seed
    assert [DataPasses(7, seed=4).task_index(k) for k in range(7)] != first
    assert passes.position(15) == (2, 1)


def test_runners_interleaved_cover_a_pass_exactly_once():
    # runner i of n plays global indices c * n + i: two runners, 5 tasks, cursors 3 and 2 -> indices 0..4
    passes = DataPasses(5, seed=0)
    started = [c * 2 + i for i, cursor in enumerate([3, 2]) for c in range(cursor)]
    assert sorted(passes.task_index(k) for k in started) == [0, 1, 2, 3, 4]
    # lowest unstarted index: min(3 * 2 + 0, 2 * 2 + 1) = 5 -> pass 1, position 0
    assert passes.progress([3, 2]) == {"size": 5, "seed": 0, "started": 5, "passes_completed": 1,
                                       "pass_position": 0}
    # cursors 4 and 1: min(8, 3) = 3 -> pass 0 at position 3
    assert passes.progress([4, 1])["passes_completed"] == 0 and passes.progress([4, 1])["pass_position"] == 3


def test_max_samples_cuts_and_a_resume_over_another_set_fails():
    assert DataPasses.for_env(10, max_samples=4, seed=0) == DataPasses(4, 0)
    assert DataPasses.for_env(3, max_samples=4, seed=0) == DataPasses(3, 0)
    assert DataPasses.for_env(None, max_samples=None, seed=0) is None
    DataPasses(4, 0).check_resume({"size": 4, "seed": 0})
    with pytest.raises(DataPassesError, match="over 5 tasks with seed 0, this run's over 4 tasks"):
        DataPasses(4, 0).check_resume({"size": 5, "seed": 0})


# ------------------------------------------------------------------------------------------ blending
def _tasks(prefix: str, n: int) -> TaskList:
    return TaskList([MathTask(f"{prefix}{i}?", "1", f"{prefix}{i}") for i in range(n)], name=prefix)


def test_blend_interleaves_as_hugging_face_all_exhausted():
    # Recorded from datasets.interleave_datasets([a, b], probabilities=[0.5, 0.5], seed=42,
    # stopping_strategy="all_exhausted") over rows a0..a4 and b0, b1 (datasets 4.x).
    blended = blend_tasks([_tasks("a", 5), _tasks("b", 2)], [0.5, 0.5], seed=42)
    assert [t.prompt_id for t in blended] == ["b0", "a0", "b1", "b0", "a1", "b1", "b0", "b1", "a2", "a3", "a4"]
    # Molt's max_count: each source cut to its first 3, concatenated, the blend cut to its first 3
    assert [t.prompt_id for t in blend_tasks([_tasks("a", 5), _tasks("b", 2)], max_count=3)] == ["a0", "a1", "a2"]
    assert [t.prompt_id for t in blend_tasks([_tasks("a", 2), _tasks("b", 2)])] == ["a0", "a1", "b0", "b1"]
    with pytest.raises(ValueError, match="summing to 1"):
        blend_tasks([_tasks("a", 2), _tasks("b", 2)], [0.5, 0.6])


def test_math_env_blends_files_by_weight(tmp_path):
    from flashrl.envs.math import MathEnv

    a, b = _write_tasks(tmp_path / "a.jsonl", 5), _write_tasks(tmp_path / "b.jsonl", 2)
    env = MathEnv([a, b], prompt_probs=[0.5, 0.5], blend_seed=42)
    # the rows of a (5) and b (2), in the recorded blend order
    assert [t.metadata["source"].rsplit("/", 1)[1] for t in env.tasks] == [
        "b.jsonl:1", "a.jsonl:1", "b.jsonl:2", "b.jsonl:1", "a.jsonl:2", "b.jsonl:2", "b.jsonl:1", "b.jsonl:2",
        "a.jsonl:3", "a.jsonl:4", "a.jsonl:5"]
    assert len(MathEnv([a, b], max_samples_per_source=2).tasks) == 2


# ------------------------------------------------------------------------------------------ the horizon
def test_the_horizon_follows_the_real_set_size():
    config = FlashReinforceConfig(train_batch_size=4, num_epochs=3, max_samples=7, lr_schedule="cosine_with_min_lr")
    config.environment("flashrl/Math-v0")
    config.validate()  # total_updates is derived, so the cosine schedule needs none
    assert config.schedule_horizon(10) == 6  # ceil(min(10, 7) / 4) = 2 rounds x 3 passes
    assert config.schedule_horizon(5) == 6  # ceil(5 / 4) = 2 x 3
    assert config.schedule_horizon(4) == 3
    assert config.learner_spec(model="m", train_size=9).total_updates == 6
    with pytest.raises(ConfigError, match="num_epochs: expected a finite training set"):
        config.schedule_horizon(None)
    config.total_updates = 10
    with pytest.raises(ConfigError, match="total_updates: expected None with num_epochs=3"):
        config.validate()
    sync = FlashReinforceConfig(train_batch_size=8, rollout_mode="sync_group", group_size=4, num_epochs=2)
    assert sync.schedule_horizon(5) == 6  # 2 prompts per batch: ceil(5 / 2) = 3 x 2


# ------------------------------------------------------------------------------------------ real runners
def _config(tiny_config, path: str, **overrides):
    return tiny_config(
        env_config={"tasks": path, "id_field": "id"}, num_env_runners=2, episodes_in_flight_per_env_runner=2, async_queue_size=1,
        tensorboard=False, console_every=0, **overrides,
    )


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_two_runners_play_one_pass_exactly_once(ray_session, tiny_config, tmp_path):
    from flashrl.env_runners import EnvRunnerGroup

    config = _config(tiny_config, _write_tasks(tmp_path / "train.jsonl", 10), max_samples=8)
    from flashrl.models import resolve_model

    group = EnvRunnerGroup(config.env_runner_spec(), model_path=resolve_model(config.model))
    try:
        group.setup()
        group.start_streaming(allowed=8)  # the admission budget: exactly one pass starts
        episodes, skipped = [], 0
        for _ in range(120):
            for report in group.next_reports(2.0):
                episodes += report.episodes
                skipped += sum(report.skipped.values())
            if len(episodes) + skipped >= 8:
                break
        assert skipped == 0
        assert sorted(ep.info["episode_index"] for ep in episodes) == list(range(8))
        # each of the first 8 tasks once: the 10 are cut to max_samples
        assert sorted(ep.info["task_index"] for ep in episodes) == list(range(8))
        assert sorted(ep.prompt_id for ep in episodes) == [f"t{i}" for i in range(8)]
        assert {ep.info["data_pass"] for ep in episodes} == {0}
        assert {ep.info["runner_index"] for ep in episodes} == {0, 1}
        assert group.started_counters == [4, 4]
    finally:
        group.stop()


@pytest.mark.ray
@pytest.mark.slow  # two algorithms with two runners each: 70 s on a quiet 2-core machine, minutes under load
@pytest.mark.timeout(900)
def test_a_resumed_run_continues_its_pass(ray_session, tiny_config, tmp_path):
    from flashrl.algorithms import FlashReinforce
    from flashrl.checkpoints import read_checkpoint

    config = _config(tiny_config, _write_tasks(tmp_path / "train.jsonl", 12), num_epochs=2)
    trained: list = []

    def recording(algo):
        collect = algo.stream.next_batch

        def next_batch(version):
            batch = collect(version)
            trained.extend(batch.episodes)
            return batch

        algo.stream.next_batch = next_batch
        return algo

    algo = recording(config.build_algo())
    try:
        assert algo.total_updates == 6  # ceil(12 / 4) x 2 passes, from the real set
        algo.train()
        path = algo.save_to_path(str(tmp_path / "ckpt"))
    finally:
        algo.stop()
    state = read_checkpoint(path).algorithm_state
    cursors = state["runner_cursors"]
    passes = DataPasses(12, seed=0)
    assert state["data_passes"] == passes.progress(cursors)
    assert state["data_passes"]["started"] == sum(cursors) and state["data_passes"]["passes_completed"] == 0
    before = {passes.task_index(c * 2 + i) for i, cursor in enumerate(cursors) for c in range(cursor)}
    assert {ep.info["task_index"] for ep in trained} <= before
    first_run = len(trained)

    resumed = recording(FlashReinforce.from_checkpoint(path))
    try:
        for _ in range(6):
            resumed.train()
            after = [ep for ep in trained[first_run:] if ep.info["data_pass"] == 0]
            if before | {ep.info["task_index"] for ep in after} == set(range(12)):
                break
    finally:
        resumed.stop()
    after_tasks = [ep.info["task_index"] for ep in after]
    # the resumed run plays the rest of pass 0 (none of what had started before the checkpoint), each once
    assert not before & set(after_tasks) and len(after_tasks) == len(set(after_tasks))
    assert before | set(after_tasks) == set(range(12))
    # and every episode of the run, both parts, is a distinct (pass, task): no prompt twice in a pass
    pairs = [(ep.info["data_pass"], ep.info["task_index"]) for ep in trained]
    assert len(pairs) == len(set(pairs))
    assert min(ep.info["episode_index"] for ep in trained[first_run:]) >= min(c * 2 + i for i, c in enumerate(cursors))
