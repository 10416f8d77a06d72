"""ALFWorld for flashrl: the real textworld engine, official game files or an offline generator.

* :class:`ALFWorldEnv` (registered as ``flashrl/ALFWorld-v0``): the multi-turn chat environment.
* :func:`generate_game` / :func:`generated_games`: ALFWorld-format games for the six task types,
  written from the ``alfworld`` package's own PDDL domain, grammar, goal library and scene layouts,
  with a seeded ``train`` / ``valid_seen`` / ``valid_unseen`` split (no download).
* :func:`official_games`: the playable games of an ALFWorld data folder.

Needs ``pip install 'alfworld==0.4.2' 'textworld[pddl]'`` (the ``alfworld`` extra of flashrl).
"""

from flashrl.envs.alfworld.commands import parse_command
from flashrl.envs.alfworld.engine import GameStep, TextWorldGame, plan_walkthrough
from flashrl.envs.alfworld.env import DEFAULT_SYSTEM_PROMPT, ALFWorldEnv
from flashrl.envs.alfworld.games import (
    CACHE_ENV_VAR,
    GameCollection,
    GameRecord,
    default_cache_dir,
    game_files,
    generated_games,
    official_games,
)
from flashrl.envs.alfworld.generator import SPLITS, GeneratedGame, GeneratorConfig, generate_game
from flashrl.envs.alfworld.tasks import TASK_TYPES, TaskSpec, resolve_task_type

__all__ = [
    "CACHE_ENV_VAR",
    "DEFAULT_SYSTEM_PROMPT",
    "SPLITS",
    "TASK_TYPES",
    "ALFWorldEnv",
    "GameCollection",
    "GameRecord",
    "GameStep",
    "GeneratedGame",
    "GeneratorConfig",
    "TaskSpec",
    "TextWorldGame",
    "default_cache_dir",
    "game_files",
    "generate_game",
    "generated_games",
    "official_games",
    "parse_command",
    "plan_walkthrough",
    "resolve_task_type",
]
