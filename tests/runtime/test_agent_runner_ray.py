"""``flashrl/Agent-v0`` end to end through real Ray actors on CPU (the tiny model, the torch engine): the
driver checks the env, the agent function reaches the EnvRunner actors by value, its episodes train."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.ray

B = 4
TASKS = [{"id": f"t{i}", "question": f"{i} + {i}", "answer": str(2 * i)} for i in range(8)]


async def two_turns(client: Any, task: dict[str, Any]) -> None:
    """Asks, then asks again after its own reply (one context: the second prompt extends the first call)."""
    messages = [{"role": "user", "content": task["question"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Your final answer?"}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)


def by_answer(task: dict[str, Any], transcript: list[dict[str, Any]]) -> float:
    return float(task["answer"] in (transcript[-1]["content"] or ""))


def test_an_agent_env_trains_and_evaluates_through_ray(ray_session: Any, tiny_config: Any) -> None:
    config = tiny_config(
        env="flashrl/Agent-v0",
        env_config={"tasks": TASKS, "agent": two_turns, "reward_fn": by_answer, "success_threshold": 1.0},
        evaluation_interval=1,
        evaluation_num_episodes=2,
        tensorboard=False,
    )
    algo = config.build_algo()
    try:
        results = [algo.train() for _ in range(2)]
    finally:
        algo.stop()
    for i, r in enumerate(results, start=1):
        assert r["learners/version"] == i
        assert r["num_episodes"] == B
        assert r["env_runners/episode_turns_min"] == r["env_runners/episode_turns_max"] == 2.0  # the agent's calls
        assert r["evaluation/num_episodes"] == 2
        assert r.get("env_runners/num_skipped_env_error_lifetime", 0.0) == 0.0


async def summarising(client: Any, task: dict[str, Any]) -> float:
    """Asks, then starts over with a summary of its first reply: two segments per episode; rewards itself."""
    first = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task["question"]}], max_tokens=4)
    note = first.choices[0].message.content or ""
    second = await client.chat.completions.create(model="policy", max_tokens=4, messages=[
        {"role": "user", "content": f"{task['question']} (you first said {note!r})"}])
    return float(task["answer"] in (second.choices[0].message.content or ""))


def test_a_multi_segment_agent_trains_on_two_runners_and_two_learners(ray_session: Any, tiny_config: Any) -> None:
    config = tiny_config(
        env="flashrl/Agent-v0",
        env_config={"tasks": TASKS, "agent": summarising},
        num_env_runners=2,
        num_cpus_per_env_runner=0.5,
        num_learners=2,
        num_cpus_per_learner=0.5,
        tensorboard=False,
        console_every=0,
    )
    algo = config.build_algo()
    try:
        results = [algo.train() for _ in range(2)]
    finally:
        algo.stop()
    for i, r in enumerate(results, start=1):
        assert r["learners/applied"] == 1.0 and r["learners/version"] == i
        assert r["num_episodes"] == B
        # every episode: two calls, the second not extending the first, so two segments
        assert r["env_runners/episode_info/calls_mean"] == 2.0
        assert r["env_runners/episode_info/segments_mean"] == 2.0
        assert r.get("env_runners/num_skipped_env_error_lifetime", 0.0) == 0.0


async def never_calls(client: Any, task: dict[str, Any]) -> float:
    return 1.0  # a cached answer: the model is never asked


def test_an_agent_that_never_calls_the_model_stops_train_within_a_minute(ray_session: Any, tiny_config: Any) -> None:
    # Before: train() waited out sample_timeout_s (600 s), then blamed slow environments.
    import time

    from flashrl.env_runners import EnvRunnerGroupError

    config = tiny_config(env="flashrl/Agent-v0", env_config={"tasks": TASKS, "agent": never_calls}, tensorboard=False)
    algo = config.build_algo()
    try:
        start = time.perf_counter()
        with pytest.raises(EnvRunnerGroupError) as caught:
            algo.train()
        assert time.perf_counter() - start < 60
    finally:
        algo.stop()
    text = str(caught.value)
    assert "made no model call in 20 episodes in a row" in text and "never_calls" in text and "prompt id 't" in text
