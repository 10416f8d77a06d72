"""The env contract's success signal (``info["success"]``) becomes the batch's explicit failure labels."""

from __future__ import annotations

import pytest

from flashrl.envs.base import LanguageEnv
from flashrl.envs.math import MathEnv
from flashrl.episode import Episode
from flashrl.learners import TrainBatch

TASK = {"task": {"question": "What is 2 + 2?", "answer": "4"}}


def _episode(info: dict) -> Episode:
    return Episode("p", [1, 2], [False, True], [0.0, -0.3], 0.0, info=info)


def test_math_env_success_is_correctness_not_a_positive_reward():
    # A wrong boxed answer earns the format bonus (reward 0.25 > 0) but is a failure.
    env = MathEnv(format_reward=0.25, template="boxed")
    env.reset(options=TASK)
    _, wrong_reward, _, _, wrong = env.step("\\boxed{5}")
    env.reset(options=TASK)
    _, right_reward, _, _, right = env.step("\\boxed{4}")
    assert (wrong_reward, wrong["success"]) == (0.25, False)
    assert (right_reward, right["success"]) == (1.25, True)
    batch = TrainBatch.from_episodes([_episode(wrong), _episode(right)], pad_token_id=0)
    assert batch.failures.tolist() == [True, False]


class _BadSuccessEnv(LanguageEnv):
    def _reset_task(self, options):
        return [{"role": "user", "content": "hi"}], {"prompt_id": "p"}

    def _step_action(self, action):
        return [], 1.0, True, False, {"success": 1}


def test_the_base_env_rejects_a_non_bool_success():
    env = _BadSuccessEnv()
    env.reset()
    with pytest.raises(TypeError, match=r"info\['success'\] = 1 \(int\); expected a bool"):
        env.step("hello")
