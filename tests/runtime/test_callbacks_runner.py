"""The EnvRunner's hooks in-process (no Ray): exact counts, their metrics in the report, errors not swallowed."""

from __future__ import annotations

import asyncio

import pytest

from flashrl.callbacks import FlashReinforceCallbacks
from flashrl.cli import evaluation_config
from flashrl.env_runners import EnvRunner


class Counting(FlashReinforceCallbacks):
    def __init__(self) -> None:
        self.ended: list[tuple[int, bool, str | None]] = []
        self.sampled: list[int] = []

    def on_episode_end(self, *, episode, env_runner, metrics_logger, env, env_index, is_evaluation, split,
                       **kwargs):
        assert env_runner.callbacks is self and env is not None
        self.ended.append((env_index, is_evaluation, split))
        metrics_logger.log_value("ended", 1, reduce="sum")
        metrics_logger.log_value("reward", episode.reward)

    def on_sample_end(self, *, env_runner, metrics_logger, samples, is_evaluation, **kwargs):
        self.sampled.append(len(samples))
        for episode in samples:
            episode.info["seen_by_callback"] = True  # samples are the episodes handed out: mutable


class Failing(FlashReinforceCallbacks):
    def on_episode_end(self, **kwargs):
        raise RuntimeError("callback bug")


def _runner(tiny_config, callbacks, env="flashrl-test/Parity-v0") -> EnvRunner:
    config = tiny_config(env=env).callbacks(callbacks)
    return EnvRunner(config.env_runner_spec(), runner_index=0, num_runners=1, model_path=config.model)


def test_sample_fires_each_hook_once_per_episode_and_per_call(tiny_config):
    runner = _runner(tiny_config, Counting)

    async def scenario():
        report = await runner.sample([3, 5], group_size=2, evaluation=True)
        await runner.stop()
        return report

    report = asyncio.run(scenario())
    callbacks = runner.callbacks
    assert isinstance(callbacks, Counting)
    assert sorted(callbacks.ended) == [(3, True, None), (3, True, None), (5, True, None), (5, True, None)]
    assert callbacks.sampled == [4]
    assert all(ep.info["seen_by_callback"] for ep in report.episodes)
    kind, values = report.callback_metrics["ended"]
    assert (kind, values) == ("sum", [1.0] * 4)
    assert sorted(report.callback_metrics["reward"][1]) == sorted(ep.reward for ep in report.episodes)


def test_stream_metrics_ride_with_the_polls_and_dropped_episodes_fire_nothing(tiny_config):
    runner = _runner(tiny_config, Counting)
    dropped = _runner(tiny_config, Counting, env="flashrl-test/NanReward-v0")

    async def scenario():
        await runner.start()
        reports, delivered = [], 0
        while delivered < 6:
            reports.append(await runner.poll(6 - delivered, 1.0))
            delivered += len(reports[-1].episodes)
        await runner.stop()
        nan = await dropped.sample([0, 1], group_size=1)
        await dropped.stop()
        return reports, nan

    reports, nan = asyncio.run(scenario())
    delivered = sum(len(r.episodes) for r in reports)
    # on_sample_end: once per poll that handed episodes out, with exactly those episodes.
    assert runner.callbacks.sampled == [len(r.episodes) for r in reports if r.episodes]
    ended_reported = sum(sum(r.callback_metrics["ended"][1]) for r in reports if "ended" in r.callback_metrics)
    assert delivered <= ended_reported <= len(runner.callbacks.ended)  # ended before handed out
    assert all(not evaluation for _, evaluation, _ in runner.callbacks.ended)
    # Dropped episodes (NaN rewards) are counted as skipped, never passed to on_episode_end.
    assert nan.skipped["non_finite"] == 2 and dropped.callbacks.ended == [] and dropped.callbacks.sampled == [0]


def test_an_error_in_a_runner_hook_is_not_swallowed(tiny_config):
    runner = _runner(tiny_config, Failing)

    async def scenario():
        try:
            await runner.sample([0], group_size=1)
        finally:
            await runner.stop()

    with pytest.raises(RuntimeError, match="callback bug"):
        asyncio.run(scenario())


def test_flashrl_eval_runs_without_the_training_callbacks():
    config = evaluation_config({"env": "flashrl/Math-v0", "callbacks_class": "some_script:Callbacks"})
    assert config.callbacks_class is None and config.env == "flashrl/Math-v0"
