"""The tool task families: exact answers, reproducible draws, distinct held-out rows, bad input."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import flashrl.envs  # noqa: F401  (registers the envs)
from flashrl.envs.math.generators import ArithmeticGenerator
from flashrl.envs.python_tool import TOOL_SYSTEM_PROMPT
from flashrl.envs.tool_tasks import (
    ANSWER_HINT,
    ONE_SHOT_SYSTEM_PROMPT,
    TOOL_GENERATORS,
    TOOL_PROMPTS,
    ToolTaskFamily,
    held_out_rows,
)


@pytest.mark.parametrize("name", sorted(TOOL_GENERATORS))
def test_answers_are_exact_and_operands_in_range(name):
    gen = TOOL_GENERATORS[name]
    rng = np.random.default_rng(0)
    for _ in range(200):
        task = gen.sample(rng)
        operands = task.metadata["operands"]
        assert len(operands) == gen.num_operands
        assert all(gen.min_value <= x <= gen.max_value for x in operands)
        expected = int(np.prod(operands)) if gen.operators == ("*",) else sum(operands)
        assert task.answer == str(expected)
        assert task.prompt_id == f"{gen.name}:{task.metadata['expression'].replace(' ', '')}"


def test_first_draws_pinned():
    # Pinned values: a change in a generator's ranges or draw order changes the held-out sets.
    rows = held_out_rows(TOOL_GENERATORS["products_2digit"], 3, seed=1)
    assert rows == [
        {"id": "mul2:53*56", "question": "What is 53 * 56?", "answer": "2968"},
        {"id": "mul2:78*95", "question": "What is 78 * 95?", "answer": "7410"},
        {"id": "mul2:14*23", "question": "What is 14 * 23?", "answer": "322"},
    ]
    assert 53 * 56 == 2968 and 78 * 95 == 7410 and 14 * 23 == 322


def test_held_out_rows_reproducible_and_distinct():
    gen = TOOL_GENERATORS["sums_6x3digit"]
    a = held_out_rows(gen, 64, seed=2026)
    assert a == held_out_rows(gen, 64, seed=2026)
    assert a != held_out_rows(gen, 64, seed=2027)
    assert len({r["id"] for r in a}) == 64
    for row in a:
        terms = [int(x) for x in row["id"].split(":")[1].split("+")]
        assert len(terms) == 6 and row["answer"] == str(sum(terms))


def test_held_out_rows_refuses_more_than_exist():
    tiny = ArithmeticGenerator(1, 2, 2, ("*",), name="tiny")  # 4 distinct tasks
    assert len(held_out_rows(tiny, 4, seed=0)) == 4
    with pytest.raises(ValueError, match="expected 5 distinct tasks, drew only 4"):
        held_out_rows(tiny, 5, seed=0)
    with pytest.raises(ValueError, match="num_tasks must be >= 1"):
        held_out_rows(tiny, 0, seed=0)


def test_family_rejects_unknown_names():
    with pytest.raises(ValueError, match="generator must be one of"):
        ToolTaskFamily("x", "products_9digit", "default")
    with pytest.raises(ValueError, match="prompt must be one of"):
        ToolTaskFamily("x", "products_2digit", "chatty")
    with pytest.raises(ValueError, match="max_turns must be >= 2"):
        ToolTaskFamily("x", "products_2digit", "default", max_turns=1)


def test_one_shot_prompt_extends_the_tool_protocol():
    assert ONE_SHOT_SYSTEM_PROMPT.startswith(TOOL_SYSTEM_PROMPT)
    assert "print(37 * 64)" in ONE_SHOT_SYSTEM_PROMPT and "\\boxed{2368}" in ONE_SHOT_SYSTEM_PROMPT
    assert 37 * 64 == 2368
    assert TOOL_PROMPTS["default"] == TOOL_SYSTEM_PROMPT


def test_family_env_plays_rows_in_order_and_rewards_the_tool_answer():
    rows = held_out_rows(TOOL_GENERATORS["products_2digit"], 2, seed=1)
    family = ToolTaskFamily("mul2_one_shot", "products_2digit", "one_shot")
    env = gym.make("flashrl/PythonTool-v0", **family.env_config(rows))
    try:
        messages, info = env.reset(seed=0, options={"task_index": 1})
        assert messages[0] == {"role": "system", "content": ONE_SHOT_SYSTEM_PROMPT}
        assert "What is 78 * 95?" in messages[1]["content"] and info["prompt_id"] == "mul2:78*95"
        obs, reward, terminated, truncated, step_info = env.step("```python\nprint(78 * 95)\n```")
        assert (reward, terminated, truncated, step_info["tool_calls"]) == (0.0, False, False, 1)
        assert "7410" in obs[0]["content"]
        _, reward, terminated, truncated, step_info = env.step("\\boxed{7410}")
        assert (reward, terminated, truncated, step_info["success"]) == (1.0, True, False, True)
        env.reset(seed=0, options={"task_index": 0})
        _, _, _, _, _ = env.step("no code here")
        _, reward, terminated, truncated, step_info = env.step("\\boxed{2969}")  # off by one
        assert (reward, terminated, step_info["success"]) == (0.0, True, False)
    finally:
        env.close()


def test_hint_family_shows_the_hint_its_worked_example_shows():
    rows = held_out_rows(TOOL_GENERATORS["products_2digit"], 2, seed=1)
    family = ToolTaskFamily("mul2_hint_t2", "products_2digit", "one_shot_hint", max_turns=2,
                            observation_suffix=ANSWER_HINT)
    assert family.env_config(rows)["observation_suffix"] == ANSWER_HINT
    assert "observation_suffix" not in ToolTaskFamily("x", "products_2digit", "one_shot").env_config(rows)
    env = gym.make("flashrl/PythonTool-v0", **family.env_config(rows))
    try:
        messages, _ = env.reset(seed=0, options={"task_index": 0})
        obs, *_ = env.step("```python\nprint(37 * 64)\n```")  # the worked example's own call
        # the example in the system prompt is, character for character, what the env answers
        assert f"User: {obs[0]['content']}\nAssistant: \\boxed{{2368}}" in messages[0]["content"]
        assert obs[0]["content"].endswith("\n\nNow reply with only the result in \\boxed{}.")
        # two replies: the second is graded at the turn limit (the last number when nothing is boxed)
        _, reward, terminated, truncated, info = env.step("53 * 56 = 2968")
        assert (reward, terminated, truncated, info["turn_limit_reached"]) == (1.0, False, True, True)
    finally:
        env.close()
