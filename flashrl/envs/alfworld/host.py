"""The games of one :class:`~flashrl.envs.alfworld.ALFWorldEnv`, played in that env's worker process.

textworld's engine keeps module-level parser state (see :mod:`flashrl.envs.alfworld.engine`), so an
env's engines live in a :class:`~flashrl.envs.worker_process.WorkerProcess` of their own: a
:class:`GameHost` built there keeps the env's loaded games (least recently used first) and answers
the env's ``reset`` / ``step`` / ``plan`` calls. Everything it returns is plain picklable data.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from flashrl.envs.alfworld.engine import GameStep, TextWorldGame, load_game_data, plan_walkthrough


class GameHost:
    """Loaded games by file, and the one being played.

    Args:
        max_loaded_games: Games kept loaded (loading parses the grammar and translates the PDDL, the
            slow part, so recently played games stay loaded); the least recently used is closed.
    """

    def __init__(self, max_loaded_games: int) -> None:
        self.max_loaded_games = max_loaded_games
        self._engines: OrderedDict[Path, TextWorldGame] = OrderedDict()
        self._engine: TextWorldGame | None = None

    def reset(self, path: Path) -> tuple[GameStep, list[str] | None]:
        """Start the game in ``path`` over: its first state and the file's stored walkthrough (or None)."""
        engine = self._engines.pop(path, None)
        if engine is None:
            engine = TextWorldGame()
            engine.load(path)
            while len(self._engines) >= self.max_loaded_games:
                self._engines.popitem(last=False)[1].close()
        self._engines[path] = engine
        self._engine = engine
        state = engine.reset()
        stored = engine.data.get("walkthrough")
        return state, [str(c) for c in stored] if stored else None

    def step(self, command: str) -> GameStep:
        """Play ``command`` in the game last reset."""
        if self._engine is None:
            raise RuntimeError("No game was reset in this worker; call reset() first.")
        return self._engine.step(command)

    def plan(self, path: Path) -> list[str]:
        """Winning commands for the game in ``path`` from its start, from the planner."""
        return plan_walkthrough(load_game_data(path))

    def loaded_games(self) -> list[Path]:
        """The loaded games' files, least recently used first."""
        return list(self._engines)

    def close(self) -> None:
        while self._engines:
            self._engines.popitem()[1].close()
        self._engine = None
