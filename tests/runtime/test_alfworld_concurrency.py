"""ALFWorld through an EnvRunner with many episodes in flight: none is lost as an env error.

The runner steps its in-flight envs from a thread pool. Before each ALFWorld env played its games
in its own worker process, 5 or 6 of 6 such episodes were dropped as ``env_error`` (textworld's
shared parser state broke under threads), and nothing failed loudly: env errors are counted and
dropped by design. A random-weight model replies with noise, which ALFWorld answers with
"Nothing happens.", so every episode plays until ``max_turns``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from flashrl.env_runners import EnvRunner

pytestmark = pytest.mark.alfworld

IN_FLIGHT = 8
MAX_TURNS = 2


def test_eight_alfworld_episodes_in_flight_lose_none(tiny_config, tmp_path: Path) -> None:
    from flashrl.envs.alfworld import TASK_TYPES, generated_games

    cache = tmp_path / "alfworld"
    games = generated_games(split="train", num_games=len(TASK_TYPES), seed=0, cache_dir=cache).games
    config = tiny_config(
        env="flashrl/ALFWorld-v0",
        env_config={"num_games": len(games), "cache_dir": str(cache), "max_turns": MAX_TURNS},
        episodes_in_flight_per_env_runner=IN_FLIGHT,
        max_new_tokens=8,
        max_episode_tokens=2048,
    )
    spec = config.env_runner_spec()
    runner = EnvRunner(spec, runner_index=0, num_runners=1, model_path=config.model)

    async def scenario():
        try:
            return await asyncio.wait_for(runner.sample(list(range(IN_FLIGHT))), timeout=900)
        finally:
            await runner.stop()

    report = asyncio.run(scenario())
    assert dict(report.skipped) == {}  # in particular no env_error
    assert len(report.episodes) == IN_FLIGHT
    prompt_ids = {f"alfworld-gen-v1/seed0/train/{i:05d}-{t}" for i, t in enumerate(TASK_TYPES)}
    for episode in report.episodes:
        assert episode.prompt_id in prompt_ids
        assert len(episode.policy_versions) == MAX_TURNS  # every turn played, to the turn limit
        assert episode.reward == 0.0 and episode.success is False
    assert report.env_steps == IN_FLIGHT * MAX_TURNS
