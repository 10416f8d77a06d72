"""The evaluation protocol: avg@k / pass@k by hand, per split and per benchmark, its sampling, step 0."""

from __future__ import annotations

import math

import pytest

from flashrl.env_runners import RunnerReport
from flashrl.env_runners.evaluation import evaluation_metrics
from flashrl.episode import Episode

SOURCES_ENV = "flashrl-test/Sources-v0"
SPLITS = {"a": {"split": "a"}, "b": {"split": "b"}}


def _episode(index: int, replica: int, reward: float, source: str | None = None) -> Episode:
    info = {"episode_index": index, "replica": replica}
    if source is not None:
        info["data_source"] = source
    return Episode(f"p{index}", [1, 2], [False, True], [0.0, -0.5], reward=reward, info=info)


def _report(episodes, skipped=None) -> RunnerReport:
    from collections import Counter

    return RunnerReport(0, episodes, 0, 0, 0, skipped=Counter(skipped or {}))


def test_avg_and_pass_at_k_by_hand():
    # Prompt 0: returns 1, 0 -> mean 0.5, best 1; prompt 1: 0, 0 -> 0, 0; prompt 2: one sample kept, 1.
    episodes = [_episode(0, 0, 1.0), _episode(0, 1, 0.0), _episode(1, 0, 0.0), _episode(1, 1, 0.0),
                _episode(2, 0, 1.0)]
    m = evaluation_metrics({None: [_report(episodes, {"aborted": 1})]}, num_samples=2, datasource_key="data_source")
    assert m["evaluation/avg@2"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert m["evaluation/pass@2"] == pytest.approx(2 / 3)
    assert m["evaluation/episode_return_mean"] == pytest.approx(2 / 5)
    assert (m["evaluation/num_prompts"], m["evaluation/num_episodes"], m["evaluation/num_skipped"]) == (3, 5, 1)
    agent_keys = ("evaluation/termination/", "evaluation/episode_info/")
    # no datasource field on any episode: no per-benchmark keys
    assert not any(k.count("/") > 1 and not k.startswith(agent_keys) for k in m)


def test_what_the_agent_did_is_measured_on_the_held_out_episodes():
    # 3 episodes: 2, 1 and 3 model turns; tool calls 1, 0 and 2; one truncated at the turn limit.
    def played(index, turns, tool_calls, truncated, reward):
        info = {"episode_index": index, "replica": 0, "tool_calls": tool_calls}
        return Episode(f"p{index}", [1] * (2 * turns + 1), [False] + [True, False] * turns,
                       [0.0] * (2 * turns + 1), reward=reward, policy_versions=[0] * turns,
                       terminated=not truncated, truncated=truncated, info=info)

    episodes = [played(0, 2, 1, False, 1.0), played(1, 1, 0, False, 0.0), played(2, 3, 2, True, 0.0)]
    m = evaluation_metrics({"a": [_report(episodes)]}, num_samples=1, datasource_key=None)
    for prefix in ("evaluation/", "evaluation/a/"):
        assert m[prefix + "episode_turns_mean"] == 2.0 and m[prefix + "episode_turns_max"] == 3.0
        assert m[prefix + "episode_info/tool_calls_mean"] == 1.0
        assert m[prefix + "termination/truncated"] == 1.0 and m[prefix + "termination/terminated"] == 2.0
        assert m[prefix + "episode_generated_tokens_mean"] == 2.0


def test_per_split_and_per_benchmark_keys():
    a = [_episode(0, 0, 1.0, "gsm"), _episode(1, 0, 0.0, "gsm"), _episode(2, 0, 1.0)]
    b = [_episode(0, 0, 0.5, "math")]
    m = evaluation_metrics({"a": [_report(a)], "b": [_report(b)]}, num_samples=1, datasource_key="data_source")
    assert m["evaluation/a/avg@1"] == pytest.approx(2 / 3) and m["evaluation/b/avg@1"] == 0.5
    assert m["evaluation/a/gsm/avg@1"] == 0.5 and m["evaluation/a/gsm/num_prompts"] == 2
    assert m["evaluation/a/unknown/avg@1"] == 1.0  # others have the field, this one not
    # Across splits, index 0 of a and index 0 of b are two prompts.
    assert m["evaluation/num_prompts"] == 4 and m["evaluation/avg@1"] == pytest.approx(2.5 / 4)
    assert m["evaluation/math/avg@1"] == 0.5 and m["evaluation/gsm/num_prompts"] == 2
    off = evaluation_metrics({"a": [_report(a)]}, num_samples=1, datasource_key=None)
    assert "evaluation/a/gsm/avg@1" not in off
    assert math.isnan(evaluation_metrics({None: [_report([])]}, num_samples=1, datasource_key=None)["evaluation/avg@1"])


class _Recorder:
    """A real engine that records the sampling settings of every request."""

    def __init__(self, engine) -> None:
        self._engine, self.requests = engine, []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, prompt_token_ids, sampling):
        self.requests.append(sampling)
        return await self._engine.generate(prompt_token_ids, sampling)


def test_splits_k_samples_and_the_evaluation_sampling_in_process(tiny_config):
    """flashrl eval's path (an in-process EnvRunner): each split's tasks once, k samples, eval sampling."""
    import asyncio

    from flashrl.cli import evaluate_with_runner
    from flashrl.env_runners import EnvRunner

    config = tiny_config(
        env=SOURCES_ENV, evaluation_splits=SPLITS, evaluation_num_episodes=10, evaluation_num_samples_per_prompt=2,
        evaluation_temperature=0.7, evaluation_top_p=0.7, temperature=1.0, top_p=1.0,
    )
    metrics, results = evaluate_with_runner(config, config.model)
    # Split a: rewards 1, 0, 1 (each task twice) -> 2/3; split b: 0, 0.5 -> 0.25; all: 2.5 / 5.
    assert metrics["evaluation/a/avg@2"] == pytest.approx(2 / 3)
    assert metrics["evaluation/b/avg@2"] == pytest.approx(0.25)
    assert metrics["evaluation/avg@2"] == pytest.approx(0.5)
    assert metrics["evaluation/episode_return_mean"] == pytest.approx(0.5)
    assert metrics["evaluation/a/gsm/avg@2"] == 0.5 and metrics["evaluation/a/math/avg@2"] == 1.0
    assert metrics["evaluation/math/num_prompts"] == 3
    assert (metrics["evaluation/a/num_episodes"], metrics["evaluation/b/num_episodes"]) == (6, 4)
    scored = {split: sorted((ep.info["episode_index"], ep.info["replica"], ep.prompt_id)
                            for r in reports for ep in r.episodes) for split, reports in results.items()}
    assert scored["b"] == [(0, 0, "b-0"), (0, 1, "b-0"), (1, 0, "b-1"), (1, 1, "b-1")]

    runner = EnvRunner(config.env_runner_spec(), runner_index=0, num_runners=1, model_path=config.model)

    async def sampling():
        await runner.setup()
        recorder = runner._engine = _Recorder(runner._engine)
        await runner.sample([0], group_size=1, evaluation=True, split="a")
        await runner.sample([0], group_size=1)
        with pytest.raises(ValueError, match="one of the evaluation_splits"):
            await runner.sample([0], evaluation=True, split="c")
        await runner.stop()
        return recorder.requests

    evaluation, training = asyncio.run(sampling())
    assert (evaluation.temperature, evaluation.top_p) == (0.7, 0.7)
    assert (training.temperature, training.top_p) == (1.0, 1.0)


def test_math_reports_each_benchmark_of_its_task_file(tiny_config, tmp_path):
    """The Math env carries a row's `datasource` into the episode info: one avg@k per benchmark."""
    import json

    from flashrl.cli import evaluate_with_runner

    sources = ["gsm8k", "aime25", "gsm8k", "aime25", "gsm8k"]
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i), "datasource": s})
                            + "\n" for i, s in enumerate(sources)))
    config = tiny_config(env="flashrl/Math-v0", env_config={"tasks": str(path)}, evaluation_num_episodes=10,
                         evaluation_num_samples_per_prompt=2, evaluation_datasource_key="datasource")
    metrics, results = evaluate_with_runner(config, config.model)
    episodes = [ep for reports in results.values() for r in reports for ep in r.episodes]
    assert len(episodes) == 10  # five tasks, each once, two samples
    for ep in episodes:  # the benchmark of the row the episode played
        assert ep.info["datasource"] == sources[ep.info["episode_index"]]
    assert (metrics["evaluation/gsm8k/num_prompts"], metrics["evaluation/aime25/num_prompts"]) == (3, 2)
    for source in ("gsm8k", "aime25"):
        rewards = [ep.reward for ep in episodes if ep.info["datasource"] == source]
        assert metrics[f"evaluation/{source}/avg@2"] == pytest.approx(sum(rewards) / len(rewards))
    assert "evaluation/unknown/avg@2" not in metrics


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_evaluation_at_start_and_every_n_updates(ray_session, tiny_config):
    config = tiny_config(
        env=SOURCES_ENV, env_config={"split": "a"}, train_batch_size=2, tensorboard=False, console_every=0,
        evaluation_at_start=True, evaluation_interval=2, evaluation_splits=SPLITS, evaluation_num_episodes=3,
    )
    algo = config.build_algo()
    try:
        results = [algo.train() for _ in range(3)]
    finally:
        algo.stop()
    first, second, third = results
    assert first["evaluation/learner_version"] == 0  # the initial policy, before the first update
    assert first["evaluation/a/avg@1"] == pytest.approx(2 / 3) and first["evaluation/b/avg@1"] == 0.25
    assert second["evaluation/learner_version"] == 2  # every 2 updates, after the update
    assert not any(k.startswith("evaluation/") for k in third)
    assert first["evaluation/episode_return_mean"] == pytest.approx((1 + 0 + 1 + 0 + 0.5) / 5)
