"""``flashrl/ALFWorld-v0``: ALFWorld's text household tasks, played through the real engine."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flashrl.envs.alfworld.commands import parse_command
from flashrl.envs.alfworld.engine import GameStep
from flashrl.envs.alfworld.games import (
    GameCollection,
    GameRecord,
    game_files,
    generated_games,
    official_games,
)
from flashrl.envs.alfworld.generator import GeneratorConfig
from flashrl.envs.alfworld.host import GameHost
from flashrl.envs.base import LanguageEnv, Messages, StepResult
from flashrl.envs.task_order import EpochCursor, Order, check_order
from flashrl.envs.worker_process import EnvWorkerCrashedError, EnvWorkerError, WorkerProcess

#: The system message unless ``system_prompt`` says otherwise.
DEFAULT_SYSTEM_PROMPT = (
    "You are an agent in a text-based household game. Each turn you see what happened and the "
    "admissible commands. Reply with exactly one command, copied from the admissible commands, on the "
    "last line of your reply after '> ' (for example: > go to cabinet 1). You may think before that line."
)

_TASK = re.compile(r"Your task is to:\s*(?P<task>.+?)\s*$", re.DOTALL)


class ALFWorldEnv(LanguageEnv):
    r"""ALFWorld (Shridhar et al., 2021) as a multi-turn chat environment on textworld's PDDL engine.

    ## Description
    Each episode is one ALFWorld game: a household scene described in text and a task of one of six
    types (``pick_and_place_simple``, ``look_at_obj_in_light``, ``pick_clean_then_place_in_recep``,
    ``pick_heat_then_place_in_recep``, ``pick_cool_then_place_in_recep``, ``pick_two_obj_and_place``).
    Games come from ``games`` (official ALFWorld game files: a folder searched for ``*.tw-pddl``
    files with a ``traj_data.json`` beside them, or a list of files; a folder with a ``split``
    subfolder, such as ``$ALFWORLD_DATA/json_2.1.1``, means that subfolder), or else from the
    built-in offline generator (``split``, ``num_games``, ``task_types``, ``seed``), which writes
    ALFWorld-format games into a cache (see :mod:`flashrl.envs.alfworld.games`). With ``games``,
    only ``split`` and ``task_types`` of the generator arguments apply. Every command runs through
    the real engine.

    ## Observation space
    :class:`~flashrl.envs.spaces.ChatMessages`. ``reset`` returns a system message (the reply
    convention) and a user message: the game's intro (the room and "Your task is to: ...") followed
    by the admissible commands, one per line. Each ``step`` returns one user message: the game's
    feedback and the new admissible commands (``show_admissible_commands=False`` leaves them out).

    ## Action space
    :class:`~flashrl.envs.spaces.UnicodeText`: the model's reply. The command is its last line
    starting with ``>`` (else its last non-empty line), normalised as
    :func:`~flashrl.envs.alfworld.commands.parse_command` documents (``put X in Y`` becomes
    ``move X to Y``). A command that is not admissible answers "Nothing happens." and changes nothing.

    ## Reward
    ``1.0`` on the step that completes the task, ``0.0`` otherwise.

    ## Episode end
    Terminates when the task is completed; truncated after ``max_turns`` steps otherwise (then
    ``info["turn_limit_reached"]`` is True). ``step`` after the end raises
    :class:`~flashrl.envs.base.EpisodeEndedError`.

    ## Info
    ``reset``: ``prompt_id``, ``game_file``, ``task_type``, ``task`` (the task sentence),
    ``admissible_commands``, ``walkthrough`` (the game file's stored winning commands, or None),
    ``game_index``. ``step``: ``prompt_id``, ``command`` (as parsed), ``admissible`` (whether it was
    an admissible command), ``feedback``, ``won``, ``success`` (= ``won``), ``admissible_commands``,
    ``turn``.
    :meth:`walkthrough` returns winning commands for the current game, planning them when the file
    stores none.

    ## Threads and processes
    Thread-safe across instances: each env plays its games in its own worker process (started at the
    first ``reset``, ended by ``close``), because textworld's engine shares parser state between the
    games of one process. One instance serves one thread at a time, as any Gymnasium env. A worker
    that crashes or does not answer within ``worker_timeout_s`` raises
    :class:`~flashrl.envs.worker_process.EnvWorkerError` (an env error to the runner, never a hang);
    the next ``reset`` starts a new worker.

    ## Reset options
    ``{"game_index": i}`` plays game ``i`` of :attr:`games`; ``{"game_file": path}`` plays that file.

    ## Arguments
    ``games`` (folder, file or list of files/folders; None to generate), ``split`` (``train``,
    ``valid_seen``, ``valid_unseen``), ``num_games``, ``task_types`` (names, aliases or numbers
    1-6; None for all six), ``seed`` (of the generated collection), ``generator``
    (:class:`~flashrl.envs.alfworld.generator.GeneratorConfig`), ``cache_dir``, ``max_turns``
    (default 50, as in ALFWorld's evaluation), ``show_admissible_commands``, ``system_prompt``,
    ``order`` (``shuffle`` each epoch, ``random`` with replacement, ``sequential``),
    ``max_loaded_games`` (games kept loaded in the engine; loading one takes about a second),
    ``worker_timeout_s`` (longest wait for the worker's answer to one reset or step, and for its
    start), ``render_mode``.

    ## Version history
    * v0: initial version; games played in a worker process per env (same observations, infos and
      rewards), so envs stepped from several threads at once work.
    """

    def __init__(
        self,
        games: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
        *,
        split: str = "train",
        num_games: int = 64,
        task_types: Sequence[str | int] | None = None,
        seed: int = 0,
        generator: GeneratorConfig | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        max_turns: int = 50,
        show_admissible_commands: bool = True,
        system_prompt: str | None = None,
        order: Order = "shuffle",
        max_loaded_games: int = 4,
        worker_timeout_s: float = 120.0,
        render_mode: str | None = None,
    ) -> None:
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"max_turns must be a positive int; got {max_turns!r}.")
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        check_order(order)
        if not isinstance(max_loaded_games, int) or max_loaded_games < 1:
            raise ValueError(f"max_loaded_games must be a positive int; got {max_loaded_games!r}.")
        if not isinstance(worker_timeout_s, (int, float)) or not worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be a positive number of seconds; got {worker_timeout_s!r}.")
        if generator is not None and not isinstance(generator, GeneratorConfig):
            raise TypeError(f"generator must be a GeneratorConfig or None; got {type(generator).__name__}.")
        if games is None:
            collection = generated_games(
                split=split,
                num_games=num_games,
                seed=seed,
                task_types=task_types,
                config=generator,
                cache_dir=cache_dir,
            )
        elif isinstance(games, (str, os.PathLike)):
            path = Path(games).expanduser()
            if path.is_dir() and (path / split).is_dir():
                path = path / split  # an ALFWorld data root: json_2.1.1/{train,valid_seen,valid_unseen}
            collection = (
                official_games(path, task_types=task_types)
                if path.is_dir()
                else game_files([path], task_types=task_types)
            )
        else:
            collection = game_files(list(games), task_types=task_types)
        if not collection.games:
            raise ValueError(
                f"No playable ALFWorld games in {games!r} (skipped: {collection.skipped or 'none found'}). "
                "Point games= at a folder of ALFWorld game files (game.tw-pddl + traj_data.json), "
                "or leave it None to generate games offline."
            )
        self.collection: GameCollection = collection
        self.show_admissible_commands = bool(show_admissible_commands)
        self.system_prompt = DEFAULT_SYSTEM_PROMPT if system_prompt is None else str(system_prompt)
        self.order = order
        self.game: GameRecord | None = None
        self.max_loaded_games = max_loaded_games
        self.worker_timeout_s = float(worker_timeout_s)
        # The engines live in a worker process (see "Threads and processes"), started at first reset.
        self._worker: WorkerProcess | None = None
        self._stored: list[str] | None = None
        """The current game file's stored walkthrough."""
        self._walkthroughs: dict[Path, list[str]] = {}
        self._epoch = EpochCursor()

    @property
    def games(self) -> tuple[GameRecord, ...]:
        """The games this environment plays."""
        return self.collection.games

    # ----------------------------------------------------------------------------- episode
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Messages, dict[str, Any]]:
        if seed is not None:
            self._epoch.restart()  # a new seed restarts the epoch order
        return super().reset(seed=seed, options=options)

    def _reset_task(self, options: dict[str, Any]) -> tuple[Messages, dict[str, Any]]:
        unknown = set(options) - {"game_index", "game_file"}
        if unknown:
            raise ValueError(
                f"Unknown reset options {sorted(unknown)}; ALFWorldEnv accepts 'game_index' and 'game_file'."
            )
        index: int | None = None
        if "game_file" in options:
            path = Path(options["game_file"]).expanduser().resolve()
            known = [i for i, g in enumerate(self.games) if g.path.resolve() == path]
            if known:
                index = known[0]
                self.game = self.games[index]
            else:
                found = game_files([path])
                if not found.games:
                    raise ValueError(
                        f"reset(options={{'game_file': ...}}): {path} was skipped: {found.skipped}."
                    )
                self.game = found.games[0]
        else:
            if "game_index" in options:
                index = int(options["game_index"])
                if not 0 <= index < len(self.games):
                    raise IndexError(f"game_index {index} is out of range for {len(self.games)} games.")
            else:
                index = self._next_index()
            self.game = self.games[index]
        state, self._stored = self._call("reset", self.game.path)
        match = _TASK.search(state.feedback)
        info: dict[str, Any] = {
            "prompt_id": self.game.prompt_id,
            "game_file": str(self.game.path),
            "task_type": self.game.task_type,
            "task": match["task"].rstrip(".") if match else "",
            "admissible_commands": list(state.admissible_commands),
            "walkthrough": None if self._stored is None else list(self._stored),
        }
        if index is not None:
            info["game_index"] = index
        messages = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": self._observation(state)},
        ]
        if not self.system_prompt:
            messages = messages[1:]
        return messages, info

    def _step_action(self, action: str) -> StepResult:
        assert self.game is not None
        command = parse_command(action)
        state = self._call("step", command)
        info: dict[str, Any] = {
            "prompt_id": self.game.prompt_id,
            "command": command,
            "admissible": state.valid,
            "feedback": state.feedback,
            "won": state.won,
            "success": bool(state.won),  # the env contract's success signal (flashrl.envs.base)
            "admissible_commands": list(state.admissible_commands),
        }
        reward = 1.0 if state.won else 0.0
        new_messages = [] if state.won else [{"role": "user", "content": self._observation(state)}]
        return new_messages, reward, state.won, False, info

    def _call(self, method: str, *args: object, timeout_s: float | None = None) -> object:
        """Run ``method`` of this env's :class:`~flashrl.envs.alfworld.host.GameHost` in its worker."""
        if self._worker is None:
            if method == "step":  # the game's state died with the worker that held it
                raise EnvWorkerCrashedError(
                    "ALFWorldEnv.step(): this env's game worker is gone (it failed earlier or the env was "
                    "closed); call reset() to start a new game in a new worker."
                )
            self._worker = WorkerProcess(
                GameHost, self.max_loaded_games, timeout_s=self.worker_timeout_s, name="alfworld-env-worker"
            )
        try:
            return self._worker.call(method, *args, timeout_s=timeout_s)
        except EnvWorkerError:
            self._worker.kill()
            self._worker = None
            raise

    @property
    def loaded_games(self) -> list[Path]:
        """The game files loaded in this env's worker, least recently used first."""
        return [] if self._worker is None else list(self._call("loaded_games"))  # type: ignore[call-overload]

    def _observation(self, state: GameStep) -> str:
        if not self.show_admissible_commands:
            return state.feedback
        return state.feedback + "\n\nAdmissible commands:\n" + "\n".join(state.admissible_commands)

    # ----------------------------------------------------------------------------- plans
    def walkthrough(self, *, timeout_s: float = 600.0) -> list[str]:
        """Commands that win the current game from its start: stored in the file, else planned once.

        Planning (in the env's worker) a full-size official scene can take tens of seconds, hence its
        own ``timeout_s``; generated games store theirs.
        """
        if self.game is None:
            raise RuntimeError("No game yet; call reset() first.")
        if self._stored:
            return list(self._stored)
        if self.game.path not in self._walkthroughs:
            plan = self._call("plan", self.game.path, timeout_s=timeout_s)
            self._walkthroughs[self.game.path] = list(plan)  # type: ignore[call-overload]
        return list(self._walkthroughs[self.game.path])

    def _next_index(self) -> int:
        return self._epoch.next_index(len(self.games), self.order, self.np_random)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        super().close()
