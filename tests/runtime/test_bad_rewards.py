"""A reward that is not a real number, or that float32 cannot hold, is dropped and counted as bad_reward.

Before, ``float(reward)`` read the text "0.5" as 0.5 (and a bool as 1.0), and a reward of 1e39 passed
the runner's float64 check, became inf in the learner's float32 and had every batch skipped.
"""

from __future__ import annotations

import asyncio
import logging

import gymnasium as gym
import numpy as np
import pytest

from flashrl.env_runners import EnvRunner
from flashrl.env_runners.rollout import MAX_REWARD, REWARD_ERROR, reward_value, skip_reason
from flashrl.env_runners.types import RUNNER_SKIP_REASONS
from flashrl.episode import Episode

from .conftest import ParityEnv

REWARD_ENV = "flashrl-test/Rewards-v0"
NOT_A_NUMBER = "a reward is a real number (int or float); got {}. Return float(...) from step, e.g. 1.0 for a solved task"
OUT_OF_RANGE = ("the reward {} is outside float32's finite range (|reward| <= 3.4028235e+38), where the learner "
                "holds it; scale the rewards down")


class RewardsEnv(ParityEnv):
    """One turn per entry of ``rewards``; step t returns ``rewards[t]`` as it is."""

    def __init__(self, rewards: list[object]) -> None:
        super().__init__()
        self.rewards = rewards
        self.max_turns = len(rewards)

    def _step_action(self, action: str):
        last = self.turn + 1 == len(self.rewards)
        return ([] if last else [{"role": "user", "content": "Again."}]), self.rewards[self.turn], last, False, {}


if REWARD_ENV not in gym.registry:
    gym.register(REWARD_ENV, entry_point=RewardsEnv)


@pytest.mark.parametrize(("reward", "problem"), [
    ("0.5", NOT_A_NUMBER.format("str '0.5'")),
    (True, NOT_A_NUMBER.format("bool True")),
    (np.bool_(False), NOT_A_NUMBER.format("bool np.False_")),
    (1 + 0j, NOT_A_NUMBER.format("complex (1+0j)")),
    (None, NOT_A_NUMBER.format("NoneType None")),
    (np.array([0.5, 0.5]), "a reward is one number; got an array of shape (2,)"),
    (np.array([], dtype=np.float32), "a reward is one number; got an array of shape (0,)"),
    (np.array(["0.5"]), NOT_A_NUMBER.format("ndarray array(['0.5'], dtype='<U3')")),
    (1e39, OUT_OF_RANGE.format("1e+39")),
    (-1e39, OUT_OF_RANGE.format("-1e+39")),
    (10**39, OUT_OF_RANGE.format("1000000000000000000000000000000000000000")),
])
def test_what_is_not_a_reward_says_why(reward: object, problem: str) -> None:
    value, why = reward_value(reward)
    assert np.isnan(value) and why == problem


@pytest.mark.parametrize(("reward", "value"), [
    (1, 1.0), (0.5, 0.5), (np.float32(0.25), 0.25), (np.int64(-2), -2.0), (np.array(0.5), 0.5),
    (np.array([[0.75]]), 0.75), (MAX_REWARD, 3.4028234663852886e38), (-MAX_REWARD, -3.4028234663852886e38),
])
def test_real_numbers_within_float32_are_rewards(reward: object, value: float) -> None:
    assert reward_value(reward) == (value, None)


def test_nan_and_inf_stay_non_finite() -> None:
    assert reward_value(float("inf")) == (float("inf"), None)
    episode = Episode("p", [1, 2], [False, True], [0.0, -1.0], reward=float("nan"))
    assert skip_reason(episode, max_episode_tokens=8) == "non_finite"


def test_skip_reason_refuses_a_refused_reward_and_a_sum_past_float32() -> None:
    assert "bad_reward" in RUNNER_SKIP_REASONS

    def episode(reward: float, info: dict[str, str] | None = None) -> Episode:
        return Episode("p", [1, 2], [False, True], [0.0, -1.0], reward=reward, info=info or {})

    assert skip_reason(episode(0.0, {REWARD_ERROR: "turn 1: ..."}), max_episode_tokens=8) == "bad_reward"
    assert skip_reason(episode(2 * 2e38), max_episode_tokens=8) == "bad_reward"
    assert skip_reason(episode(MAX_REWARD), max_episode_tokens=8) is None


def _sample(tiny_config, rewards: list[object], n: int = 2):
    config = tiny_config(env=REWARD_ENV, env_config={"rewards": rewards})
    runner = EnvRunner(config.env_runner_spec(), runner_index=0, num_runners=1, model_path=config.model)

    async def scenario():
        report = await runner.sample(list(range(n)), group_size=1)
        await runner.stop()
        return report

    return asyncio.run(scenario())


@pytest.mark.parametrize("rewards", [["0.5"], [1 + 0j], [None], [True], [1e39], [0.0, "1"], [2e38, 2e38]],
                         ids=["text", "complex", "none", "bool", "1e39", "text-in-turn-2", "sum-past-float32"])
def test_the_runner_drops_and_counts_bad_rewards(tiny_config, rewards: list[object]) -> None:
    report = _sample(tiny_config, rewards)
    assert report.episodes == []
    assert report.skipped == {"bad_reward": 2}


def test_a_bad_step_reward_is_logged_with_its_prompt_id(tiny_config, caplog) -> None:
    # Before: "<Env>.step returned a bad reward in turn 1: ..." without the prompt it came from.
    with caplog.at_level(logging.WARNING, logger="flashrl"):
        _sample(tiny_config, ["0.5"], n=1)
    lines = [r.getMessage() for r in caplog.records if "returned a bad reward" in r.getMessage()]
    assert len(lines) == 1 and "in turn 1 (prompt id '" in lines[0] and "Return float(...) from step" in lines[0]


def test_the_runner_keeps_numpy_rewards(tiny_config) -> None:
    report = _sample(tiny_config, [np.float32(0.25), np.array([0.5])])
    assert report.skipped == {}
    assert [episode.reward for episode in report.episodes] == [0.75, 0.75]
