"""Environment steps per second with 1, 4 and 16 episodes in flight, driven from threads as an EnvRunner does.

No model: each thread owns one env and plays it with a fixed policy, resetting when an episode ends.
The EnvRunner calls ``env.reset`` / ``env.step`` in a thread pool, one thread per episode in flight;
this does the same with one thread per env and all threads released together.

* ``alfworld``: ``flashrl/ALFWorld-v0`` on generated games (one worker process per env), random
  admissible commands.
* ``alfworld_in_process_lock``: the same games and policy through :class:`TextWorldGame` in this
  process, where textworld's engine is serialised by one lock: the alternative to worker processes.
* ``python_tool``: ``flashrl/PythonTool-v0``, every reply a code block the sandbox runs (``print(6*7)``).
* ``math``: ``flashrl/Math-v0`` (``easy_sums``), every reply the right answer (the verifier's workers).

Every step's result is checked (ALFWorld: no exception; PythonTool: the printed 42 comes back; Math:
reward 1): the ``errors`` column counts failures, so a row is also a concurrency test. The start
(worker processes, first reset and step) is timed apart (``start_s``). The ratio column is steps/s over the
same env's 1-in-flight steps/s in this run; on a shared, loaded machine only such ratios mean much.

    python benchmarks/env_concurrency.py                       # 1, 4, 16 in flight
    python benchmarks/env_concurrency.py --steps 4 --in-flight 1 4
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _common as common
import gymnasium as gym

import flashrl.envs  # noqa: F401  (registers the ids)

OUTPUT = common.RESULTS / "env_concurrency.json"
FIGURE = common.FIGURES / "env_concurrency.png"
NUM_GAMES = 6  # one generated ALFWorld game of each task type


class Player:
    """One env and its policy; ``step`` plays one env step (resetting first when needed)."""

    def __init__(self, index: int) -> None:
        self.rng = random.Random(index)
        self.index = index
        self.done = True
        self.errors = 0

    def start(self) -> None:
        """Reset and take one step, untimed: worker processes (ALFWorld's, the verifier's) start here."""
        self.reset()
        self.done = False
        self.step()

    def step(self) -> None:
        try:
            if self.done:
                self.reset()
            self.done = self.act()
        except Exception as exc:  # noqa: BLE001  counted: the benchmark reports failures instead of stopping
            self.errors += 1
            self.done = True
            print(f"  error in env {self.index}: {type(exc).__name__}: {str(exc)[:120]}")

    def reset(self) -> None:
        raise NotImplementedError

    def act(self) -> bool:
        """One step; returns whether the episode ended. Raises when the result is wrong."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class ALFWorldPlayer(Player):
    def __init__(self, index: int, cache: Path) -> None:
        super().__init__(index)
        self.env = gym.make("flashrl/ALFWorld-v0", num_games=NUM_GAMES, cache_dir=cache, max_turns=50).unwrapped

    def reset(self) -> None:
        # Any game from 4 (max_loaded_games): every env keeps them loaded after the first time.
        _, info = self.env.reset(options={"game_index": self.rng.randrange(4)})
        self.commands = info["admissible_commands"]

    def act(self) -> bool:
        _, _, terminated, truncated, info = self.env.step("> " + self.rng.choice(self.commands))
        self.commands = info["admissible_commands"]
        return terminated or truncated

    def close(self) -> None:
        self.env.close()


class InProcessALFWorldPlayer(Player):
    def __init__(self, index: int, cache: Path) -> None:
        from flashrl.envs.alfworld import TextWorldGame, generated_games

        super().__init__(index)
        self.games = [g.path for g in generated_games(num_games=NUM_GAMES, cache_dir=cache).games]
        self.engines: dict[Path, Any] = {}  # loaded games stay loaded, as in ALFWorldEnv's worker
        self.make_engine = TextWorldGame
        self.turn = 0

    def reset(self) -> None:
        path = self.rng.choice(self.games[:4])
        if path not in self.engines:
            self.engines[path] = self.make_engine()
            self.engines[path].load(path)
        self.engine = self.engines[path]
        self.state = self.engine.reset()
        self.turn = 0

    def act(self) -> bool:
        self.state = self.engine.step(self.rng.choice(self.state.admissible_commands))
        self.turn += 1
        return self.state.won or self.turn >= 50

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


class PythonToolPlayer(Player):
    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.env = gym.make("flashrl/PythonTool-v0", max_turns=4)

    def reset(self) -> None:
        self.env.reset(seed=self.index)

    def act(self) -> bool:
        new, _, terminated, truncated, _ = self.env.step("```python\nprint(6 * 7)\n```")
        if new and "42" not in new[0]["content"]:
            raise RuntimeError(f"the sandbox did not print 42: {new[0]['content'][:200]!r}")
        return terminated or truncated

    def close(self) -> None:
        self.env.close()


class MathPlayer(Player):
    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.env = gym.make("flashrl/Math-v0", preset="easy_sums")

    def reset(self) -> None:
        _, info = self.env.reset(seed=self.rng.randrange(1 << 30))
        self.answer = info["answer"]

    def act(self) -> bool:
        _, reward, terminated, _, _ = self.env.step(f"The answer is \\boxed{{{self.answer}}}.")
        if reward != 1.0:
            raise RuntimeError(f"the right answer {self.answer} got reward {reward}")
        return terminated

    def close(self) -> None:
        self.env.close()


def measure(make: Callable[[int], Player], in_flight: int, steps_per_env: int) -> dict[str, Any]:
    """Start ``in_flight`` players at once, then time ``steps_per_env`` steps of each, all in threads."""
    players = [make(i) for i in range(in_flight)]
    barrier = threading.Barrier(in_flight + 1, timeout=1800)

    def play(player: Player) -> None:
        barrier.wait()
        for _ in range(steps_per_env):
            player.step()

    try:
        with ThreadPoolExecutor(in_flight) as pool:
            start = time.perf_counter()
            list(pool.map(Player.start, players))
            start_s = time.perf_counter() - start
            futures = [pool.submit(play, p) for p in players]
            barrier.wait()
            begin = time.perf_counter()
            for future in futures:
                future.result()
            wall = time.perf_counter() - begin
    finally:
        for player in players:
            player.close()
    steps = in_flight * steps_per_env
    return {
        "in_flight": in_flight,
        "steps": steps,
        "wall_s": wall,
        "steps_per_s": steps / wall,
        "start_s": start_s,
        "errors": sum(p.errors for p in players),
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for env in dict.fromkeys(r["env"] for r in rows):
        mine = [r for r in rows if r["env"] == env]
        xs = [r["in_flight"] for r in mine]
        left.plot(xs, [r["steps_per_s"] for r in mine], marker="o", label=env)
        right.plot(xs, [r["ratio_to_1"] for r in mine], marker="o", label=env)
    for ax, ylabel in ((left, "env steps / s"), (right, "steps/s over 1 in flight")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["in_flight"] for r in rows}), [str(x) for x in sorted({r["in_flight"] for r in rows})])
        ax.set_xlabel("episodes in flight (threads)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    left.set_yscale("log")
    right.legend(fontsize=8)
    fig.suptitle("Env steps per second vs episodes in flight (2 shared CPU cores)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per env")
    parser.add_argument("--envs", nargs="+", default=["alfworld", "alfworld_in_process_lock", "python_tool", "math"])
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--figure", type=Path, default=FIGURE)
    args = parser.parse_args()

    from flashrl.envs.alfworld import generated_games

    cache = Path(tempfile.mkdtemp(prefix="env_concurrency_"))
    generated_games(num_games=NUM_GAMES, cache_dir=cache)  # generation is not what is measured
    makers: dict[str, Callable[[int], Player]] = {
        "alfworld": lambda i: ALFWorldPlayer(i, cache),
        "alfworld_in_process_lock": lambda i: InProcessALFWorldPlayer(i, cache),
        "python_tool": PythonToolPlayer,
        "math": MathPlayer,
    }
    rows: list[dict[str, Any]] = []
    for env in args.envs:
        for k in args.in_flight:
            print(f"{env}: {k} in flight ...", flush=True)
            rows.append({"env": env, **measure(makers[env], k, args.steps)})
    for row in rows:
        base = next(r for r in rows if r["env"] == row["env"] and r["in_flight"] == min(args.in_flight))
        row["ratio_to_1"] = row["steps_per_s"] / base["steps_per_s"]
    print(
        common.table(
            ["env", "in flight", "steps", "steps/s", "ratio", "start s", "errors"],
            [
                [r["env"], str(r["in_flight"]), str(r["steps"]), f"{r['steps_per_s']:.2f}",
                 f"{r['ratio_to_1']:.2f}", f"{r['start_s']:.1f}", str(r["errors"])]
                for r in rows
            ],
        )
    )
    report = {
        "benchmark": "env_concurrency",
        "settings": {"in_flight": args.in_flight, "steps_per_env": args.steps, "alfworld_games": NUM_GAMES},
        "machine": common.machine(),
        "rows": rows,
    }
    print("wrote", common.write_json(args.output, report))
    plot(rows, args.figure)
    print("wrote", args.figure)


if __name__ == "__main__":
    main()
