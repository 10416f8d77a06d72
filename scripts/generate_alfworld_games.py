"""Generate ALFWorld-format games offline (no download) and check each one is won by its walkthrough.

Writes ``game.tw-pddl`` + ``traj_data.json`` folders into the cache that ``flashrl/ALFWorld-v0`` reads
(``$FLASHRL_ALFWORLD_CACHE`` or the user cache dir; ``--cache-dir`` overrides), or, with ``--out``, a
plain ``<out>/<split>/<index>-<task type>/`` tree that ALFWorld's own tools and
``ALFWorldEnv(games=...)`` read like official data. Prints one line per game and a summary.

    python scripts/generate_alfworld_games.py --split train --num-games 120 --seed 0
    python scripts/generate_alfworld_games.py --split valid_unseen --num-games 30 --out /data/alfworld_gen
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from flashrl.envs.alfworld import SPLITS, TASK_TYPES, GeneratorConfig, generate_game, generated_games
from flashrl.envs.alfworld.generator import derive_seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--split", choices=SPLITS, default="train")
    parser.add_argument("--num-games", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--task-types", nargs="+", default=None, help=f"names, aliases or 1-6; default all of {TASK_TYPES}"
    )
    parser.add_argument("--max-receptacles", type=int, default=GeneratorConfig.max_receptacles)
    parser.add_argument("--num-distractors", type=int, default=GeneratorConfig.num_distractors)
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="cache folder (default: the env's cache)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="write a plain folder tree here instead of the cache"
    )
    args = parser.parse_args()

    types = [int(t) if t.isdigit() else t for t in args.task_types] if args.task_types else None
    config = GeneratorConfig(max_receptacles=args.max_receptacles, num_distractors=args.num_distractors)
    start = time.perf_counter()
    if args.out is None:
        collection = generated_games(
            split=args.split,
            num_games=args.num_games,
            seed=args.seed,
            task_types=types,
            config=config,
            cache_dir=args.cache_dir,
        )
        paths = [g.path for g in collection.games]
    else:
        from flashrl.envs.alfworld.games import resolve_task_types

        resolved = resolve_task_types(types)
        paths = []
        for index in range(args.num_games):
            task_type = resolved[index % len(resolved)]
            seed = derive_seed(args.seed, f"{args.split}/{task_type}", index)
            game = generate_game(task_type, seed=seed, split=args.split, config=config)
            paths.append(game.write(args.out / args.split / f"{index:05d}-{task_type}"))
    counts: Counter[str] = Counter()
    steps = []
    for path in paths:
        game = json.loads(path.read_text(encoding="utf-8"))
        traj = json.loads((path.parent / "traj_data.json").read_text(encoding="utf-8"))
        counts[traj["task_type"]] += 1
        steps.append(len(game["walkthrough"]))
        print(f"{traj['scene']['floor_plan']:>13}  {len(game['walkthrough']):>2} steps  {path.parent}")
    print(
        f"\n{len(paths)} games in {time.perf_counter() - start:.1f} s; walkthrough steps "
        f"min {min(steps)} mean {sum(steps) / len(steps):.1f} max {max(steps)}"
    )
    for task_type, n in sorted(counts.items()):
        print(f"  {task_type:<34} {n}")


if __name__ == "__main__":
    main()
