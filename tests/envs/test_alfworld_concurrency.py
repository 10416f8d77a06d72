"""ALFWorld envs reset and stepped from several threads at once, as an EnvRunner's thread pool does.

textworld's PDDL engine shares parser state within a process: before each env got its own worker
process, six envs stepped from six threads failed with ``IndexError: pop from empty list``, tatsu
``FailedToken`` and ``TypeError`` from inside that parsing. Here every thread's transcript must equal
what one env alone plays.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from flashrl.envs.alfworld import TASK_TYPES, ALFWorldEnv, TextWorldGame, generated_games
from flashrl.envs.worker_process import EnvWorkerCrashedError

pytestmark = pytest.mark.alfworld

NUM_ENVS = len(TASK_TYPES)
RANDOM_STEPS = 6


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(tmp_path_factory.mktemp("alfworld_cache"))
    generated_games(split="train", num_games=NUM_ENVS, seed=0, cache_dir=path)
    return path


def _transcript(env: ALFWorldEnv, index: int, barrier: threading.Barrier | None) -> list[Any]:
    """Reset game ``index``, play seeded random admissible commands, then reset and win by the plan.

    With a barrier, every thread resets and takes each random step at the same moment.
    """
    rng = random.Random(index)
    out: list[Any] = []
    if barrier is not None:
        barrier.wait()
    messages, info = env.reset(options={"game_index": index})
    out.append((messages, info))
    commands, done = info["admissible_commands"], False
    for _ in range(RANDOM_STEPS):
        if barrier is not None:
            barrier.wait()  # every thread takes part in every round, so none waits forever
        if done:
            continue
        result = env.step("> " + rng.choice(commands))
        out.append(result)
        commands, done = result[4]["admissible_commands"], result[2] or result[3]
    messages, info = env.reset(options={"game_index": index})
    out.append((messages, info))
    out += [env.step(f"> {command}") for command in info["walkthrough"]]
    return out


def test_envs_in_threads_play_exactly_as_one_env_alone(cache_dir: Path) -> None:
    alone = ALFWorldEnv(num_games=NUM_ENVS, cache_dir=cache_dir, max_loaded_games=NUM_ENVS)
    expected = [_transcript(alone, i, None) for i in range(NUM_ENVS)]
    alone.close()
    envs = [ALFWorldEnv(num_games=NUM_ENVS, cache_dir=cache_dir) for _ in range(NUM_ENVS)]
    barrier = threading.Barrier(NUM_ENVS, timeout=600)
    try:
        with ThreadPoolExecutor(NUM_ENVS) as pool:
            got = list(pool.map(lambda i: _transcript(envs[i], i, barrier), range(NUM_ENVS)))
    finally:
        for env in envs:
            env.close()
    for index in range(NUM_ENVS):
        assert got[index] == expected[index], f"game {index} ({TASK_TYPES[index]}) played differently"
        last = got[index][-1]
        assert (last[1], last[2], last[4]["won"]) == (1.0, True, True)  # each won by its walkthrough


def test_engines_in_threads_of_one_process_are_serialised(cache_dir: Path) -> None:
    """Without env workers (the generator and the planner run the engine in-process) a lock guards it."""
    games = generated_games(split="train", num_games=4, seed=0, cache_dir=cache_dir).games

    def win(path: Path) -> tuple[bool, int]:
        engine = TextWorldGame()
        try:
            engine.load(path)
            engine.reset()
            plan = engine.data["walkthrough"]
            state = None
            for command in plan:
                state = engine.step(command)
            return bool(state and state.won), len(plan)
        finally:
            engine.close()

    with ThreadPoolExecutor(len(games)) as pool:
        results = list(pool.map(win, [g.path for g in games]))
    assert all(won for won, _ in results), results


def test_close_ends_the_worker_and_a_crashed_worker_is_replaced(cache_dir: Path) -> None:
    env = ALFWorldEnv(num_games=1, cache_dir=cache_dir)
    assert env.loaded_games == []  # no worker before the first reset
    _, info = env.reset(options={"game_index": 0})
    assert env._worker is not None
    pid = env._worker.pid
    assert pid is not None and pid != os.getpid()
    assert env.loaded_games == [env.games[0].path]
    os.kill(pid, signal.SIGKILL)  # a crash of the engine process (the OOM killer, a segfault)
    with pytest.raises(EnvWorkerCrashedError, match=r"exited with code -9: step\(\) got no answer"):
        env.step("look")
    with pytest.raises(EnvWorkerCrashedError, match=r"call reset\(\) to start a new game"):
        env.step("look")
    _, again = env.reset(options={"game_index": 0})  # a new worker, the same game
    assert again == info
    assert env._worker is not None and env._worker.pid != pid
    rewards = [env.step(command)[1] for command in info["walkthrough"]]
    assert rewards[-1] == 1.0
    worker = env._worker
    env.close()
    assert env._worker is None and not worker.alive and worker._process.returncode == 0
