"""Where an :class:`~flashrl.envs.alfworld.ALFWorldEnv` gets its games: generated ones in a cache, or
official ALFWorld game files in a folder the user points to.

Generated games live in ``<cache>/generated-v<version>-<config digest>/seed<seed>/<split>/<index>-<task>/``
(``game.tw-pddl`` + ``traj_data.json``); ``<cache>`` is ``$FLASHRL_ALFWORLD_CACHE`` when set, else
``<user cache dir>/flashrl/alfworld``. Missing games are generated on first use (a file lock keeps
concurrent processes from generating the same game twice) and reused afterwards.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flashrl.envs.alfworld.generator import (
    GENERATOR_VERSION,
    SPLITS,
    GeneratorConfig,
    derive_seed,
    generate_game,
)
from flashrl.envs.alfworld.tasks import TASK_TYPES, resolve_task_type

#: Environment variable that overrides the cache folder of generated games.
CACHE_ENV_VAR = "FLASHRL_ALFWORLD_CACHE"


@dataclass(frozen=True)
class GameRecord:
    """One playable game file."""

    path: Path
    """The ``*.tw-pddl`` file."""
    prompt_id: str
    """Stable key of the game (same on every machine)."""
    task_type: str
    """One of :data:`~flashrl.envs.alfworld.tasks.TASK_TYPES`."""


@dataclass(frozen=True)
class GameCollection:
    """The games found or generated, and the files passed over (with the reason) when scanning."""

    games: tuple[GameRecord, ...]
    skipped: dict[str, int]
    """Reason -> number of game files skipped for it (official folders only)."""


def default_cache_dir() -> Path:
    """``$FLASHRL_ALFWORLD_CACHE`` if set, else the user cache dir's ``flashrl/alfworld``."""
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("flashrl")) / "alfworld"


def resolve_task_types(task_types: Sequence[str | int] | None) -> tuple[str, ...]:
    """Canonical task type names (all six when ``None``), in the given order, without duplicates."""
    if task_types is None:
        return TASK_TYPES
    if isinstance(task_types, (str, int)):
        raise TypeError(
            f"task_types must be a sequence of task types; got {task_types!r}. Wrap it in a list."
        )
    resolved = tuple(dict.fromkeys(resolve_task_type(t) for t in task_types))
    if not resolved:
        raise ValueError(f"task_types is empty; give at least one of {list(TASK_TYPES)} (or None for all).")
    return resolved


def generated_games(
    *,
    split: str = "train",
    num_games: int = 64,
    seed: int = 0,
    task_types: Sequence[str | int] | None = None,
    config: GeneratorConfig | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> GameCollection:
    """The first ``num_games`` generated games of ``split`` for ``seed``, generating missing ones.

    Game ``i`` has task type ``task_types[i % len(task_types)]`` (so types are balanced) and is a pure
    function of ``(seed, split, i, task type, config)``.
    """
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; expected one of {list(SPLITS)}.")
    if not isinstance(num_games, int) or isinstance(num_games, bool) or num_games < 1:
        raise ValueError(f"num_games must be a positive int; got {num_games!r}.")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int; got {seed!r}.")
    types = resolve_task_types(task_types)
    config = config or GeneratorConfig()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / f"generated-v{GENERATOR_VERSION}-{config.key()}" / f"seed{seed}" / split
    # Non-default scene sizes make other games: their prompt ids say so.
    tag = f"alfworld-gen-v{GENERATOR_VERSION}" + ("" if config == GeneratorConfig() else f"-{config.key()}")
    records = []
    for index in range(num_games):
        task_type = types[index % len(types)]
        name = f"{index:05d}-{task_type}"
        game_path = folder / name / "game.tw-pddl"
        if not game_path.exists():
            _generate_locked(
                folder, name, task_type, derive_seed(seed, f"{split}/{task_type}", index), split, config
            )
        records.append(GameRecord(game_path, f"{tag}/seed{seed}/{split}/{name}", task_type))
    return GameCollection(tuple(records), {})


def _generate_locked(
    folder: Path, name: str, task_type: str, seed: int, split: str, config: GeneratorConfig
) -> None:
    import filelock

    folder.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(folder / f".{name}.lock"), timeout=600):
        if (folder / name / "game.tw-pddl").exists():  # another process made it meanwhile
            return
        generate_game(task_type, seed=seed, split=split, config=config).write(folder / name)


def official_games(
    folder: str | os.PathLike[str], *, task_types: Sequence[str | int] | None = None
) -> GameCollection:
    """Every playable ALFWorld game under ``folder`` (searched recursively), as ALFWorld selects them.

    A game is a ``*.tw-pddl`` file with a ``traj_data.json`` beside it. Like ALFWorld's own loader,
    this skips (and counts in ``skipped``) games with movable receptacles or sliced objects, games
    marked unsolvable or never checked (no ``solvable`` key), and task types not asked for.
    """
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"ALFWorld games folder {root} does not exist or is not a folder.")
    types = set(resolve_task_types(task_types))
    skipped: Counter[str] = Counter()
    records = []
    for path in sorted(root.rglob("*.tw-pddl")):
        rel = path.parent.relative_to(root).as_posix()
        traj_path = path.parent / "traj_data.json"
        if "movable" in rel or "Sliced" in rel:
            skipped["movable receptacle or sliced object (unsupported by ALFWorld)"] += 1
            continue
        if not traj_path.exists():
            skipped["no traj_data.json beside the game file"] += 1
            continue
        try:
            traj = json.loads(traj_path.read_text(encoding="utf-8"))
            solvable = json.loads(path.read_text(encoding="utf-8")).get("solvable")
        except (OSError, json.JSONDecodeError, AttributeError):
            skipped["unreadable game or traj_data.json"] += 1
            continue
        task_type = traj.get("task_type")
        if task_type not in TASK_TYPES:
            skipped[f"unsupported task type {task_type!r}"] += 1
            continue
        if task_type not in types:
            skipped["task type not selected"] += 1
            continue
        if not solvable:
            skipped["not marked solvable"] += 1
            continue
        prompt_id = f"alfworld/{root.name}/{rel}" if rel != "." else f"alfworld/{root.name}/{path.stem}"
        records.append(GameRecord(path, prompt_id, task_type))
    return GameCollection(tuple(records), dict(skipped))


def game_files(
    paths: Sequence[str | os.PathLike[str]], *, task_types: Sequence[str | int] | None = None
) -> GameCollection:
    """Explicit game files (or folders, scanned with :func:`official_games`)."""
    records: list[GameRecord] = []
    skipped: Counter[str] = Counter()
    types = set(resolve_task_types(task_types))
    for p in paths:
        path = Path(p).expanduser()
        if path.is_dir():
            found = official_games(path, task_types=task_types)
            records += found.games
            skipped.update(found.skipped)
            continue
        if not path.is_file():
            raise FileNotFoundError(f"ALFWorld game file {path} does not exist.")
        traj_path = path.parent / "traj_data.json"
        task_type = "unknown"
        if traj_path.exists():
            task_type = json.loads(traj_path.read_text(encoding="utf-8")).get("task_type", "unknown")
        if task_type in TASK_TYPES and task_type not in types:
            skipped["task type not selected"] += 1
            continue
        records.append(GameRecord(path, f"alfworld/{path.parent.name}/{path.stem}", task_type))
    return GameCollection(tuple(records), dict(skipped))
