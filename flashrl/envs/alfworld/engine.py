"""The real ALFWorld text engine: textworld's ``PddlEnv`` behind ALFWorld's ``AlfredDemangler``.

textworld's API is not Gymnasium's (``step`` returns ``(state, score, done)``); :class:`TextWorldGame`
turns it into small typed results. Object ids such as ``cabinet_bar__plus_00_dot_68...`` are shown
as ``cabinet 1`` by ``AlfredDemangler(shuffle=False)``, which numbers instances in sorted-id order:
stored walkthroughs are written in those names, so the demangler must never shuffle.

**Threads.** textworld's PDDL engine is not thread-safe: its grammar and PDDL parsers are tatsu parser
objects shared at module level (``_PARSER`` in ``textworld/envs/pddl/textgen/__init__.py`` and in
``textworld/envs/pddl/logic/__init__.py``, textworld 1.6), and the planner (``fast_downward/interface.py``)
rewrites ``sys.argv``. Two games loaded or stepped at once from two threads fail inside that parsing
(``IndexError: pop from empty list``, tatsu ``FailedToken``). Every :class:`TextWorldGame` call
therefore holds one process-wide lock (uncontended in a process that plays one game at a time) and
restores ``sys.argv``; :class:`~flashrl.envs.alfworld.ALFWorldEnv` plays each env's games in its own
worker process (:mod:`flashrl.envs.alfworld.host`), so envs in threads run in parallel.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashrl.envs.alfworld.assets import require_alfworld

_ENGINE_LOCK = threading.RLock()


@contextlib.contextmanager
def _engine_section() -> Iterator[None]:
    """Hold the process-wide engine lock and give ``sys.argv`` back as it was (see the module doc)."""
    with _ENGINE_LOCK:
        argv = list(sys.argv)
        try:
            yield
        finally:
            sys.argv[:] = argv


@dataclass(frozen=True)
class GameStep:
    """What the engine reports after ``reset`` or one command."""

    feedback: str
    """The game's text (the intro after ``reset``)."""
    admissible_commands: tuple[str, ...]
    """Commands that change the game from here, sorted (anything else answers "Nothing happens.")."""
    won: bool
    """Whether the task's goal holds."""
    valid: bool = True
    """Whether the command was admissible (always True after ``reset``)."""


def load_game_data(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a ``*.tw-pddl`` game file and check it has the keys the engine needs."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"Cannot read ALFWorld game file {path}: {exc}") from exc
    missing = [k for k in ("pddl_domain", "grammar", "pddl_problem") if k not in data]
    if not isinstance(data, dict) or missing:
        raise ValueError(
            f"{path} is not an ALFWorld game file: missing keys {missing}; expected a JSON object with "
            "'pddl_domain', 'grammar' and 'pddl_problem' (and optionally 'walkthrough', 'solvable')."
        )
    return data


def _make_env(walkthrough: bool) -> Any:
    require_alfworld()
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler
    from textworld.envs import PddlEnv

    infos = textworld.EnvInfos(
        won=True, admissible_commands=True, extras=["walkthrough"] if walkthrough else []
    )
    return AlfredDemangler(PddlEnv(infos), shuffle=False)


class TextWorldGame:
    """One loaded ALFWorld game, played through the real textworld PDDL engine.

    ``load`` takes a game file path or its parsed JSON; ``reset`` starts it over; ``step`` plays one
    command. Only exact admissible commands change the game (textworld's rule).

    Args:
        plan: Also report a walkthrough at ``reset`` (:attr:`walkthrough`): the game file's stored one,
            or else one the planner computes (slow on big scenes: see :func:`plan_walkthrough`).
    """

    def __init__(self, *, plan: bool = False) -> None:
        with _engine_section():
            self._env = _make_env(walkthrough=plan)
        self._plan = plan
        self._data: dict[str, Any] | None = None
        self._last: GameStep | None = None
        self.walkthrough: list[str] | None = None
        """Commands that win from the start (set by ``reset`` when made with ``plan=True``)."""

    @property
    def data(self) -> dict[str, Any]:
        """The loaded game's JSON."""
        if self._data is None:
            raise RuntimeError("No game loaded; call load() first.")
        return self._data

    def load(self, game: str | os.PathLike[str] | dict[str, Any]) -> None:
        data = copy.deepcopy(game) if isinstance(game, dict) else load_game_data(game)
        with _engine_section():
            self._env.load(data)
        self._data = data
        self._last = None

    def reset(self) -> GameStep:
        if self._data is None:
            raise RuntimeError("No game loaded; call load() first.")
        with _engine_section():  # the state is read inside too: it may be computed lazily
            state = self._env.reset()
            if self._plan:
                self.walkthrough = [str(c) for c in state["extra.walkthrough"]]
            self._last = GameStep(
                feedback=str(state.feedback).strip(),
                admissible_commands=tuple(state["admissible_commands"]),
                won=bool(state["won"]),
            )
        return self._last

    def step(self, command: str) -> GameStep:
        if self._last is None:
            raise RuntimeError("The game was not reset; call reset() first.")
        valid = command.strip() in self._last.admissible_commands
        with _engine_section():
            state, _score, _done = self._env.step(command)
            self._last = GameStep(
                feedback=str(state.feedback).strip(),
                admissible_commands=tuple(state["admissible_commands"]),
                won=bool(state["won"]),
                valid=valid,
            )
        return self._last

    def close(self) -> None:
        with _engine_section():
            self._env.close()


def plan_walkthrough(game: str | os.PathLike[str] | dict[str, Any]) -> list[str]:
    """Ask the planner (Fast Downward) for commands that win ``game`` from its start.

    Costs grow steeply with scene size (seconds to tens of seconds for full ALFRED scenes): call it
    once per game and store the result, never per step. Returns ``[]`` when no plan exists.
    """
    data = copy.deepcopy(game) if isinstance(game, dict) else load_game_data(game)
    data["walkthrough"] = None  # make textworld replan instead of echoing a stored one
    engine = TextWorldGame(plan=True)
    try:
        engine.load(data)
        engine.reset()
        return list(engine.walkthrough or [])
    finally:
        engine.close()
