"""Deterministic env errors fail fast with the user's traceback; an env's bad text or hung close is
counted, not fatal to the runner (in-process EnvRunner on the tiny model and the torch engine)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import gymnasium as gym
import pytest

from flashrl.env_runners import EnvRunner
from flashrl.env_runners.env_check import EnvCheckError, build_env_once
from flashrl.env_runners.env_errors import ENV_ERROR_LIMIT, EnvErrorStreak, user_traceback

from .conftest import ParityEnv

HANG_S = 30.0
"""How long a hung close blocks (far past the 0.3 s limit and the few seconds two tiny episodes take)."""
RELEASE = threading.Event()  # set at the end so a "hung" close returns and the test process can exit


def _lookup_answer(task: dict[str, str]) -> str:
    return task["answer"]  # the user's bug: the row has no "answer"


class RaisingRewardEnv(ParityEnv):
    """Like ParityEnv, but the reward function raises KeyError on every step."""

    def _step_action(self, action: str):
        return [], float(action == _lookup_answer({"question": "1+1"})), True, False, {}


class RewardFnEnv(ParityEnv):
    """Takes its reward function as an argument and calls it (it does not declare it as user code)."""

    def __init__(self, reward_fn: Any = None) -> None:
        super().__init__()
        self.reward_fn = reward_fn

    def _step_action(self, action: str):
        return [], float(self.reward_fn(action)), True, False, {}


class SurrogateRowEnv(ParityEnv):
    """A dataset row with a lone surrogate: every prompt carries "\\ud800"."""

    def _reset_task(self, options: dict[str, Any]):
        messages, info = super()._reset_task(options)
        return [{"role": "user", "content": messages[0]["content"] + " \ud800"}], info


class SurrogateToolEnv(ParityEnv):
    """Two turns; the first observation (a tool's output) carries a lone surrogate."""

    def __init__(self) -> None:
        super().__init__()
        self.max_turns = 2

    def _step_action(self, action: str):
        if self.turn == 0:
            return [{"role": "user", "content": "tool output: \udcff"}], 0.0, False, False, {}
        return super()._step_action(action)


class BlockingCloseEnv(ParityEnv):
    """step raises; close then blocks far past the test's time limit."""

    def _step_action(self, action: str):
        raise RuntimeError("simulated environment failure")

    def close(self) -> None:
        RELEASE.wait(HANG_S)
        super().close()


class HangingStepEnv(ParityEnv):
    """step blocks far past the test's time limit (a verifier that never answers)."""

    def _step_action(self, action: str):
        RELEASE.wait(HANG_S)
        return [], 0.0, True, False, {}


ENVS = {
    "flashrl-test/HangingStep-v0": HangingStepEnv,
    "flashrl-test/RaisingReward-v0": RaisingRewardEnv,
    "flashrl-test/RewardFn-v0": RewardFnEnv,
    "flashrl-test/SurrogateRow-v0": SurrogateRowEnv,
    "flashrl-test/SurrogateTool-v0": SurrogateToolEnv,
    "flashrl-test/BlockingClose-v0": BlockingCloseEnv,
}
for _id, _cls in ENVS.items():
    if _id not in gym.registry:
        gym.register(_id, entry_point=_cls)


def _runner(config, **kwargs) -> EnvRunner:
    return EnvRunner(config.env_runner_spec(), runner_index=0, num_runners=1, model_path=config.model, **kwargs)


# ------------------------------------------------------------------------------------------
# before the run: build_env_once steps one env
# ------------------------------------------------------------------------------------------
def test_the_quoted_traceback_names_what_the_error_was_raised_from():
    import httpx2  # what the openai package itself depends on
    import openai

    def agent_call():
        request = httpx2.Request("POST", "http://127.0.0.1:9/v1/chat/completions")
        try:
            raise httpx2.ReadTimeout("timed out", request=request)
        except httpx2.ReadTimeout as err:
            raise openai.APITimeoutError(request=request) from err  # as the openai client does

    try:
        agent_call()
    except openai.APITimeoutError as err:
        text = user_traceback(err)
    lines = text.splitlines()
    assert lines[-2:] == ["openai.APITimeoutError: Request timed out.", "Caused by httpx2.ReadTimeout: timed out"]
    assert "in agent_call" in text
    assert user_traceback(ValueError("plain")).splitlines()[-1] == "ValueError: plain"  # no cause, no line
    try:
        raise RuntimeError("outer") from KeyError("inner")
    except RuntimeError as err:
        assert user_traceback(err).splitlines()[-1] == "Caused by KeyError: 'inner'"


def test_the_env_check_of_the_setup_stops_a_hung_step_within_env_timeout_s(tiny_config):
    # Before: build_algo() waited for the step forever, printing nothing, although env_timeout_s was set.
    from flashrl.algorithms.flash_reinforce.algorithm import _check_envs

    config = tiny_config(env="flashrl-test/HangingStep-v0").env_runners(env_timeout_s=0.3)
    began = time.monotonic()
    try:
        with pytest.raises(EnvCheckError) as caught:
            _check_envs(config)
    finally:
        RELEASE.set()
    assert time.monotonic() - began < 10
    text = str(caught.value)
    assert "expected flashrl-test/HangingStep-v0's step('0') to return within env_timeout_s=0.3 s" in text
    assert "raise env_timeout_s if it is only slow" in text
    RELEASE.clear()


def test_a_raising_reward_fails_the_env_check_with_its_traceback():
    with pytest.raises(EnvCheckError) as caught:
        build_env_once("flashrl-test/RaisingReward-v0", {})
    text = str(caught.value)
    assert "whose step('0') raised KeyError: 'answer'" in text
    assert 'return task["answer"]' in text and "in _lookup_answer" in text  # the user's frame, quoted
    assert "Fix: correct env_config, the env's code (e.g. its reward function) or its data." in text


def test_a_reward_fn_given_as_a_plain_string_fails_the_env_check_naming_it():
    with pytest.raises(EnvCheckError) as caught:
        build_env_once("flashrl-test/RewardFn-v0", {"reward_fn": "my_rewards:score"})
    text = str(caught.value)
    assert "{'reward_fn': 'my_rewards:score'}" in text
    assert "raised TypeError: 'str' object is not callable" in text and "self.reward_fn(action)" in text


def test_a_lone_surrogate_in_a_row_fails_the_env_check_naming_it():
    with pytest.raises(EnvCheckError, match=r"whose reset raised ValueError: env.reset returned messages\[0\]\['content'\] "
                                            r"with text that is not valid Unicode: .*got '\\ud800'"):
        build_env_once("flashrl-test/SurrogateRow-v0", {})


def test_a_working_env_passes_the_env_check():
    assert build_env_once("flashrl-test/Parity-v0", {}) is None
    assert build_env_once("flashrl-test/Sources-v0", {"split": "b"}) == 2


# ------------------------------------------------------------------------------------------
# at run time
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("env", ["flashrl-test/SurrogateRow-v0", "flashrl-test/SurrogateTool-v0"])
def test_a_lone_surrogate_from_the_env_is_counted_not_fatal(tiny_config, env):
    runner = _runner(tiny_config(env=env))

    async def scenario():
        report = await runner.sample([0, 1, 2], group_size=1)
        await runner.stop()
        return report

    report = asyncio.run(scenario())
    assert report.episodes == []
    assert report.skipped == {"env_error": 3}


def test_a_close_that_blocks_does_not_wedge_the_runner(tiny_config):
    runner = _runner(tiny_config(env="flashrl-test/BlockingClose-v0").env_runners(env_timeout_s=0.3))

    async def scenario():
        await runner.setup()  # the engine start is not what is timed
        began = time.monotonic()
        report = await runner.sample([0, 1], group_size=1)
        return report, time.monotonic() - began

    try:
        report, waited = asyncio.run(scenario())
    finally:
        RELEASE.set()
    assert report.skipped == {"env_error": 2}
    assert waited < HANG_S  # each close was cut off at 0.3 s, off the event loop (blocking it: >= 60 s)
    RELEASE.clear()


def test_a_later_fatal_error_of_an_episode_in_flight_does_not_replace_the_first(tiny_config):
    # Episodes in flight when the first fatal error stops the stream may fail too (CI once reported the streak's
    # 21st episode where the 20th had stopped the run): the run stops with the first cause.
    runner = _runner(tiny_config())
    first, later = RuntimeError("the first cause"), RuntimeError("an episode in flight failed too")

    async def fail(error: BaseException) -> None:
        raise error

    async def scenario():
        runner._changed, runner._arrived = asyncio.Event(), asyncio.Event()
        tasks = [asyncio.get_running_loop().create_task(fail(error)) for error in (first, later)]
        runner._tasks.update(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:  # in the order they finished, as their done callbacks run
            runner._on_done(task)
        return runner._arrived.is_set()

    assert asyncio.run(scenario())  # a waiting poll wakes up to raise it
    assert runner._fatal is first and not runner._tasks


def test_the_same_env_error_in_a_row_stops_the_runner_with_the_first_traceback(tiny_config):
    runner = _runner(tiny_config(env="flashrl-test/RaisingReward-v0", episodes_in_flight_per_env_runner=1))

    async def scenario():
        below = await runner.sample(list(range(ENV_ERROR_LIMIT - 1)), group_size=1)
        try:
            await runner.sample([ENV_ERROR_LIMIT - 1], group_size=1)
        finally:
            await runner.stop()
        return below

    with pytest.raises(EnvErrorStreak) as caught:
        below = asyncio.run(scenario())
    text = str(caught.value)
    assert f"the same environment error ended {ENV_ERROR_LIMIT} episodes in a row" in text
    assert "env 'flashrl-test/RaisingReward-v0', episode 0, prompt id 'parity-" in text  # the first of them
    assert "KeyError: 'answer'" in text and 'return task["answer"]' in text
    # below the limit: dropped and counted
    runner = _runner(tiny_config(env="flashrl-test/RaisingReward-v0"))

    async def counted():
        report = await runner.sample(list(range(ENV_ERROR_LIMIT - 1)), group_size=1)
        await runner.stop()
        return report

    below = asyncio.run(counted())
    assert below.skipped == {"env_error": ENV_ERROR_LIMIT - 1}


def test_an_episode_through_the_env_starts_the_count_again(tiny_config):
    from flashrl.env_runners.env_errors import EnvErrorBooks, EnvErrorRecord

    books = EnvErrorBooks(limit=3)
    record = EnvErrorRecord("e", 0, "p", "KeyError: 'answer'", "Traceback ...")
    assert books.error(record) is None and books.error(record) is None
    books.success()
    assert books.error(record) is None and books.error(record) is None
    other = EnvErrorRecord("e", 5, "q", "ValueError: x", "Traceback ...")
    assert books.error(other) is None  # a different error starts a new streak
    assert books.error(other) is None
    assert isinstance(books.error(other), EnvErrorStreak)


def test_the_sample_timeout_message_quotes_the_last_env_error(tiny_config):
    from types import SimpleNamespace

    from flashrl.env_runners.batching import BatchAssembler
    from flashrl.env_runners.stream import EpisodeStream

    runner = _runner(tiny_config(env="flashrl-test/RaisingReward-v0"))

    async def scenario():
        report = await runner.sample([0], group_size=1)
        await runner.stop()
        return report

    report = asyncio.run(scenario())
    assert report.skipped == {"env_error": 1}
    assert report.last_env_error.startswith("env 'flashrl-test/RaisingReward-v0', episode 0, prompt id 'parity-")
    assert report.last_env_error.endswith("KeyError: 'answer'")
    stream = EpisodeStream.__new__(EpisodeStream)  # the message only
    stream.group = SimpleNamespace(spec=SimpleNamespace(sample_timeout_s=600.0, train_batch_size=4), in_flight=4,
                                   last_env_error=report.last_env_error)
    text = str(stream._stalled(BatchAssembler(4, pending_capacity=8, learner_version=0), 0, 0, 0))
    assert text.startswith("No finished episode arrived for 600 s (sample_timeout_s); 0/4 collected, 4 in flight.")
    assert text.endswith(f"fix the env instead; the last one was in {report.last_env_error}")


def test_env_text_is_checked_where_it_nests():
    from flashrl.env_runners.env_errors import check_text

    check_text([{"role": "tool", "content": [{"type": "text", "text": "ok é 😀"}]}], "step")  # valid: no raise
    with pytest.raises(ValueError, match=r"env.step returned messages\[0\]\['content'\]\[1\]\['text'\] with text that "
                                         r"is not valid Unicode: expected UTF-8-encodable text, got '\\udcff' at "
                                         r"position 3 \(surrogates not allowed\)"):
        check_text([{"role": "tool", "content": [{"text": "a"}, {"text": "abc\udcffdef"}]}], "step")
    with pytest.raises(TypeError, match=r"env.reset returned messages\[0\]\['content'\] as bytes: expected str"):
        check_text([{"role": "user", "content": b"\xff\xfe"}], "reset")
