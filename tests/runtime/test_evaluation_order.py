"""Evaluation on a finite held-out list plays every task once, in order (not seeded random draws)."""

from __future__ import annotations

import gymnasium as gym
import pytest

import flashrl.envs  # noqa: F401 - registers the ids
from flashrl.env_runners.rollout import evaluation_reset_options

ROWS = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(5)]


def test_finite_task_list_is_walked_in_order():
    env = gym.make("flashrl/Math-v0", tasks=ROWS)
    questions = []
    for index in range(7):
        options = evaluation_reset_options(env, index)
        assert options == {"task_index": index % 5}
        _, info = env.reset(seed=1000 + index, options=options)
        questions.append(info["question"])
    assert questions == [r["question"] for r in ROWS] + [ROWS[0]["question"], ROWS[1]["question"]]
    env.close()


def test_generator_envs_are_reset_by_seed_only():
    env = gym.make("flashrl/Math-v0", preset="easy_sums")
    assert evaluation_reset_options(env, 3) is None
    env.close()


@pytest.mark.alfworld
def test_alfworld_games_are_walked_in_order_per_split():
    from flashrl.env_runners.rollout import finite_task_count

    for split in ("valid_seen", "valid_unseen"):
        env = gym.make("flashrl/ALFWorld-v0", split=split, num_games=3)
        assert finite_task_count(env) == 3
        played = []
        for index in range(4):
            options = evaluation_reset_options(env, index)
            assert options == {"game_index": index % 3}
            _, info = env.reset(seed=1000 + index, options=options)
            played.append(info["prompt_id"])
        assert played[3] == played[0] and len(set(played[:3])) == 3
        assert all(f"/{split}/" in p for p in played)
        env.close()
