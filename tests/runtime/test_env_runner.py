"""EnvRunner in-process (no Ray): the episode stream, versions, back-pressure, counted skips, seeds."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter

import pytest
import torch

from flashrl.env_runners import EnvRunner, RunnerReport, skip_reason, stream_seed
from flashrl.episode import Episode
from flashrl.weight_sync.messages import LoadWeights


def _runner(config, **kwargs) -> EnvRunner:
    spec = config.env_runner_spec()
    return EnvRunner(spec, runner_index=0, num_runners=1, model_path=config.model, **kwargs)


async def _collect(runner: EnvRunner, n: int, timeout_s: float = 60.0) -> list[RunnerReport]:
    reports, got, deadline = [], 0, time.monotonic() + timeout_s
    while got < n:
        assert time.monotonic() < deadline, f"only {got}/{n} episodes within {timeout_s} s"
        report = await runner.poll(n - got, 1.0)
        reports.append(report)
        got += len(report.episodes)
    return reports


def test_stream_delivers_token_exact_episodes_with_versions(tiny_config):
    config = tiny_config(env="flashrl-test/Parity-v0")
    runner = _runner(config)

    async def scenario():
        await runner.start()
        first = await _collect(runner, 4)
        # New weights (a perturbed copy) while the runner keeps sampling.
        weights = {k: v.clone() for k, v in runner._engine.model.state_dict().items()}
        weights["model.norm.weight"] += 0.5
        assert await runner.weight_sync(LoadWeights(3, weights)) == 3
        # An older version is ignored (coalescing keeps the newest).
        assert await runner.weight_sync(LoadWeights(2, weights)) == 3
        later = await _collect(runner, 8)
        await runner.stop()
        return first, later

    first, later = asyncio.run(scenario())
    episodes = [ep for r in first for ep in r.episodes]
    assert len(episodes) == 4
    for ep in episodes:
        assert isinstance(ep, Episode)
        assert ep.policy_versions == [0]
        n_gen = ep.num_generated_tokens
        assert 1 <= n_gen <= config.max_new_tokens
        # The sampled tokens carry their recorded log-probs; prompt tokens carry 0.0.
        assert all(lp < 0 for lp, m in zip(ep.behavior_logprobs, ep.loss_mask) if m)
        assert all(lp == 0.0 for lp, m in zip(ep.behavior_logprobs, ep.loss_mask) if not m)
        assert ep.reward in (0.0, 1.0)
        assert ep.info["runner_index"] == 0 and ep.info["duration_s"] > 0
    # Episodes started after the update were sampled by version 3 (the earliest may predate it).
    versions = [ep.policy_versions[0] for r in later for ep in r.episodes]
    assert versions[-1] == 3
    assert set(versions) <= {0, 3}
    # The counter is the data cursor: every started episode has a distinct index.
    indices = [ep.info["episode_index"] for r in first + later for ep in r.episodes]
    assert len(set(indices)) == len(indices)
    assert first[-1].started >= 4


def test_back_pressure_bounds_buffer_and_in_flight(tiny_config):
    config = tiny_config(
        env="flashrl-test/Parity-v0", episodes_in_flight_per_env_runner=3, max_buffered_episodes_per_env_runner=2
    )
    runner = _runner(config)

    async def scenario():
        await runner.start()
        deadline = time.monotonic() + 60
        while len(runner._buffer) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # the stream is paused now: nothing new may start
        state = (len(runner._buffer), len(runner._tasks), runner._counter)
        report = await runner.poll(10, 1.0)
        await runner.stop()
        return state, report

    (buffered, in_flight, started), report = asyncio.run(scenario())
    assert buffered <= 2 + 3  # what was in flight when the buffer filled may still land
    assert in_flight == 0
    assert started == buffered
    assert len(report.episodes) == buffered


@pytest.mark.parametrize(
    ("env", "reason"), [("flashrl-test/NanReward-v0", "non_finite"), ("flashrl-test/Broken-v0", "env_error")]
)
def test_bad_episodes_are_dropped_and_counted(tiny_config, env, reason):
    config = tiny_config(env=env)
    runner = _runner(config)

    async def scenario():
        report = await runner.sample([0, 1, 2], group_size=2)
        await runner.stop()
        return report

    report = asyncio.run(scenario())
    assert report.episodes == []
    assert report.skipped == {reason: 6}


def test_prompt_that_fills_the_context_is_dropped_as_empty(tiny_config):
    config = tiny_config(env="flashrl-test/Parity-v0", max_episode_tokens=10, max_new_tokens=4)
    runner = _runner(config)

    async def scenario():
        report = await runner.sample([0, 1], group_size=1)
        await runner.stop()
        return report

    report = asyncio.run(scenario())
    assert report.episodes == []
    assert report.skipped == {"empty": 2}


def test_skip_reason_rules():
    ok = Episode("p", [1, 2, 3], [False, True, True], [0.0, -1.0, -2.0], reward=1.0, policy_versions=[0])
    assert skip_reason(ok, max_episode_tokens=3) is None
    assert skip_reason(ok, max_episode_tokens=2) == "over_long"
    # an agent's episode of two contexts: the budget holds for each segment, not for their sum
    two = Episode("p", [1, 2, 3, 4, 5, 6], [False, True, True, False, True, True], [0.0, -1.0, -1.0, 0.0, -1.0, -1.0],
                  reward=1.0, segment_starts=[0, 3])
    assert skip_reason(two, max_episode_tokens=3) is None
    assert skip_reason(two, max_episode_tokens=2) == "over_long"
    empty = Episode("p", [1, 2], [False, False], [0.0, 0.0], reward=1.0)
    assert skip_reason(empty, max_episode_tokens=8) == "empty"
    bad = Episode("p", [1, 2], [False, True], [0.0, float("-inf")], reward=1.0)
    assert skip_reason(bad, max_episode_tokens=8) == "non_finite"
    positive = Episode("p", [1, 2], [False, True], [0.0, 0.25], reward=1.0)
    assert skip_reason(positive, max_episode_tokens=8) == "invalid_logprob"
    aborted = Episode("p", [1, 2], [False, True], [0.0, -1.0], reward=1.0, info={"finish_reasons": ["stop", "abort"]})
    assert skip_reason(aborted, max_episode_tokens=8) == "aborted"


def test_an_episode_is_a_function_of_its_index(tiny_config):
    """Same seed and index -> the same task and the same sampled tokens, on any runner; replicas differ."""
    config = tiny_config(env="flashrl-test/Parity-v0", max_new_tokens=12)

    async def play(runner_index: int):
        spec = config.env_runner_spec()
        runner = EnvRunner(spec, runner_index=runner_index, num_runners=2, model_path=config.model)
        report = await runner.sample([5, 6], group_size=2)
        await runner.stop()
        return {(ep.info["episode_index"], ep.info["replica"]): ep for ep in report.episodes}

    a, b = asyncio.run(play(0)), asyncio.run(play(1))
    assert set(a) == {(5, 0), (5, 1), (6, 0), (6, 1)}
    for key in a:
        assert a[key].token_ids == b[key].token_ids
        # Log-probs agree up to float32 rounding: the engine may batch the requests differently.
        torch.testing.assert_close(torch.tensor(a[key].behavior_logprobs), torch.tensor(b[key].behavior_logprobs))
    assert a[(5, 0)].prompt_id == a[(5, 1)].prompt_id  # a group shares its prompt ...
    assert a[(5, 0)].token_ids != a[(5, 1)].token_ids  # ... but not its samples
    assert stream_seed(0, 0, 5) == stream_seed(0, 0, 5) != stream_seed(0, 0, 6)


async def _set_up_with_zero_weights(runner: EnvRunner) -> dict[str, torch.Tensor]:
    """Start the runner's engine; all-zero weights of its model's shapes."""
    await runner.setup()
    return {k: torch.zeros_like(v) for k, v in runner._engine.model.state_dict().items()}


def test_weights_reach_the_engine(tiny_config):
    config = tiny_config(env="flashrl-test/Parity-v0")
    runner = _runner(config)

    async def scenario():
        weights = await _set_up_with_zero_weights(runner)
        await runner.weight_sync(LoadWeights(1, weights))
        served = runner._engine.model.state_dict()["model.norm.weight"].clone()
        await runner.stop()
        return served

    assert torch.count_nonzero(asyncio.run(scenario())) == 0


def test_a_weight_push_racing_stop_loads_nothing(tiny_config):
    # A broadcast the algorithm sent just before it stopped the runners: it must not raise on the
    # released engine (it did: AttributeError on None), and a push after stop starts no engine.
    config = tiny_config(env="flashrl-test/Parity-v0")
    runner = _runner(config)

    async def scenario():
        weights = await _set_up_with_zero_weights(runner)
        async with runner.weight_inbox.lock:  # a load in progress: the push waits for the lock
            push = asyncio.create_task(runner.weight_sync(LoadWeights(1, weights)))
            await asyncio.sleep(0.05)
            await runner.stop()
        raced = await push
        late = await runner.weight_sync(LoadWeights(2, weights))
        return raced, late, runner._engine

    assert asyncio.run(scenario()) == (-1, -1, None)


class _BadEngine:
    """A real engine whose completions are rewritten: the bad output an engine may produce."""

    def __init__(self, engine, corrupt) -> None:
        self._engine, self._corrupt = engine, corrupt

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, prompt_token_ids, sampling):
        return self._corrupt(await self._engine.generate(prompt_token_ids, sampling))


def _nan_logprob(c):
    return dataclasses.replace(c, logprobs=[float("nan"), *c.logprobs[1:]])


def _positive_logprob(c):
    return dataclasses.replace(c, logprobs=[0.5, *c.logprobs[1:]])


def _aborted(c):
    return dataclasses.replace(c, finish_reason="abort")


BAD_OUTPUTS = [(_nan_logprob, "non_finite"), (_positive_logprob, "invalid_logprob"), (_aborted, "aborted")]


@pytest.mark.parametrize(("corrupt", "reason"), BAD_OUTPUTS)
def test_bad_engine_output_is_skipped_and_counted_on_demand(tiny_config, corrupt, reason):
    config = tiny_config(env="flashrl-test/Parity-v0")
    runner = _runner(config)

    async def scenario():
        await runner.setup()
        runner._engine = _BadEngine(runner._engine, corrupt)
        report = await runner.sample([0, 1, 2], group_size=2)
        await runner.stop()
        return report

    report = asyncio.run(scenario())
    assert report.episodes == []
    assert report.skipped == {reason: 6}
    assert report.generated_tokens > 0  # the tokens were generated (and are counted) all the same


@pytest.mark.parametrize(("corrupt", "reason"), BAD_OUTPUTS)
def test_bad_engine_output_never_stops_the_stream(tiny_config, corrupt, reason):
    """Every other completion is bad: the stream goes on, delivers the good ones and counts the rest."""
    config = tiny_config(env="flashrl-test/Parity-v0")
    runner = _runner(config)
    calls = iter(range(10**6))

    def every_other(c):
        return corrupt(c) if next(calls) % 2 else c

    async def scenario():
        await runner.setup()
        runner._engine = _BadEngine(runner._engine, every_other)
        await runner.start()
        reports = await _collect(runner, 6)
        await runner.stop()
        return reports

    reports = asyncio.run(scenario())
    skipped = sum((r.skipped for r in reports), Counter())
    assert set(skipped) == {reason} and skipped[reason] >= 1
    episodes = [ep for r in reports for ep in r.episodes]
    assert len(episodes) >= 6
    assert all(ep.is_finite and "abort" not in ep.info["finish_reasons"] for ep in episodes)


def test_poll_that_times_out_returns_an_empty_report(tiny_config):
    """An idle poll is a heartbeat, not an error (asyncio.TimeoutError differs from TimeoutError < 3.11)."""
    config = tiny_config(env="flashrl-test/Parity-v0")
    runner = _runner(config)

    async def scenario():
        await runner.setup()
        report = await runner.poll(4, 0.05)  # not streaming: nothing can arrive
        await runner.stop()
        return report

    report = asyncio.run(scenario())
    assert report.episodes == [] and report.started == 0


class _SlowUpdates:
    """A real engine whose weight updates take a while (a large model's): the stream must wait."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def update_weights(self, weights, version):
        await asyncio.sleep(0.5)
        await self._engine.update_weights(weights, version)


def test_start_loads_the_weights_before_the_first_episode(tiny_config):
    config = tiny_config(env="flashrl-test/Parity-v0")
    runner = _runner(config)

    async def scenario():
        await runner.setup()
        weights = {k: v.clone() for k, v in runner._engine.model.state_dict().items()}
        runner._engine = _SlowUpdates(runner._engine)
        await runner.start(7, weights)
        reports = await _collect(runner, 4)
        await runner.stop()
        return reports

    episodes = [ep for r in asyncio.run(scenario()) for ep in r.episodes]
    assert [ep.policy_versions for ep in episodes] == [[7]] * len(episodes)


def test_start_limit_bounds_the_started_episodes(tiny_config):
    config = tiny_config(env="flashrl-test/Parity-v0", episodes_in_flight_per_env_runner=4)
    runner = _runner(config)

    async def scenario():
        await runner.start(start_limit=3)
        first = await _collect(runner, 3)
        await asyncio.sleep(0.5)  # the stream is held at the limit: nothing new may start
        held = (runner._counter, len(runner._tasks))
        await runner.set_start_limit(2)  # limits only grow: an older grant arriving late is ignored
        await runner.set_start_limit(5)
        second = await _collect(runner, 2)
        await asyncio.sleep(0.5)
        final = runner._counter
        await runner.stop()
        return first, held, second, final

    first, held, second, final = asyncio.run(scenario())
    assert sum(len(r.episodes) for r in first) == 3
    assert held == (3, 0)
    assert sum(len(r.episodes) for r in second) == 2
    assert final == 5
