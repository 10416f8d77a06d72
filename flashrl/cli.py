"""The `flashrl` command: train a tuned example, launch it on a cluster, evaluate a checkpoint, show a rollout,
fetch the small model.

    flashrl train --list
    flashrl train qwen25_math_1p5b --dry-run              # any tuned example, with its own flags
    flashrl train tuned_examples/my_preset.py --lr 3e-6   # or a script path
    flashrl eval runs/x/checkpoint_final                  # the checkpoint's env, splits and protocol
    flashrl eval Qwen/Qwen2.5-Math-1.5B --env flashrl/Math-v0 --env-config '{"tasks": "test.jsonl"}'
    flashrl eval runs/x/checkpoint_final --num-samples-per-prompt 4 --temperature 0.7 --top-p 0.7  # avg@4
    flashrl models fetch                                  # SmolLM2-135M-Instruct, offline-built
    flashrl show runs/x/tensorboard/rollouts/iteration_000020.jsonl --index 2   # one dumped episode
    flashrl launch slurm qwen25_math_1p5b --num-nodes 2 > job.sbatch        # a cluster job of the preset
    flashrl launch kuberay --image my/flashrl:1 qwen25_math_1p5b > job.yaml

`train` runs the tuned example exactly as `python tuned_examples/<name>.py ...` would: the flags after
the name are the script's (see `flashrl train <name> --help`).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["InProcessRunner", "evaluate_with_runner", "evaluation_config", "find_tuned_examples", "main"]

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


def _launch(args: argparse.Namespace) -> int:
    """Render a tuned example as a cluster job (`flashrl.recipes.launch`) to stdout or --out."""
    from flashrl.recipes.launch import LaunchError, launch_job, render

    script = _resolve_script(args.preset)
    try:
        text = render(args.target, launch_job(script, args.script_args), image=args.image)
    except LaunchError as err:
        print(f"flashrl launch {args.target}: error: {err}", file=sys.stderr)
        return 2
    if args.out is None:
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------- eval
def evaluation_config(base: dict[str, Any] | None = None, **fields: Any) -> Any:
    """A `FlashReinforceConfig` for evaluation: `base` (a checkpoint's config) with `fields` set.

    Fields of `base` this flashrl does not know (a checkpoint of another version) are ignored, and
    `fields` that are None keep the base's value.
    """

    from flashrl.algorithms import FlashReinforceConfig

    # The training run's callbacks are not evaluation's: an evaluation runs without them.
    known = set(FlashReinforceConfig.setting_names()) - {"callbacks_class"}
    config = FlashReinforceConfig.from_dict({k: v for k, v in (base or {}).items() if k in known})
    return config.update_from_dict({k: v for k, v in fields.items() if v is not None})


class InProcessRunner:
    """One `EnvRunner` in this process, with the blocking sampling calls of an `EnvRunnerGroup`.

    What `flashrl.env_runners.evaluation.run_evaluation` needs (`evaluation_size`, `sample`), without
    Ray: `flashrl eval` then runs the training run's evaluation code on it. One event loop
    (`asyncio.Runner`) serves every call, so the runner's engine lives in one loop as in an actor.
    """

    def __init__(self, spec: Any, model_path: str) -> None:
        import asyncio

        from flashrl.env_runners import EnvRunner

        self._loop = asyncio.Runner()
        self._runner = EnvRunner(spec, runner_index=0, num_runners=1, model_path=model_path)

    def evaluation_size(self, split: str | None = None) -> int | None:
        return self._loop.run(self._runner.evaluation_size(split))

    def sample(
        self, indices: Sequence[int], *, group_size: int, evaluation: bool = False, split: str | None = None
    ) -> list[Any]:
        report = self._loop.run(
            self._runner.sample(list(indices), group_size=group_size, evaluation=evaluation, split=split)
        )
        return [report]

    def close(self) -> None:
        """Stop the runner's engine, then close the loop (leftover tasks cancelled, as `asyncio.run` does)."""
        try:
            self._loop.run(self._runner.stop())
        finally:
            self._loop.close()


def evaluate_with_runner(config: Any, model_path: str) -> tuple[dict[str, float], dict[str | None, list[Any]]]:
    """Run the evaluation protocol of `FlashReinforce.evaluate()` on an in-process `EnvRunner`.

    The same `run_evaluation` (`flashrl.env_runners.evaluation`) as the training run's episode
    stream, with the same prompt indices, so a checkpoint scores the same prompts the same way here
    as in training; returns the metrics and, per split, the runner's reports (every scored episode).
    """
    from flashrl.env_runners.evaluation import run_evaluation

    config.validate()
    spec = config.env_runner_spec()
    runner = InProcessRunner(spec, model_path)
    try:
        result = run_evaluation(runner, spec, num_samples=config.evaluation_num_samples_per_prompt)
    finally:
        runner.close()
    return result.metrics, result.reports


def _eval(args: argparse.Namespace) -> int:
    from flashrl.algorithms.flash_reinforce.config import ConfigError
    from flashrl.checkpoints import CheckpointError, read_config
    from flashrl.models import resolve_model

    model, base = args.checkpoint, None
    marker = Path(args.checkpoint).expanduser() / "flashrl_checkpoint.json"
    if marker.is_file():
        try:
            base = read_config(args.checkpoint)
        except CheckpointError as err:
            raise SystemExit(f"flashrl eval: {err}") from err
        model = str(Path(args.checkpoint).expanduser() / "policy")
        if not Path(model, "config.json").is_file() and not _is_adapter(model):
            raise SystemExit(
                f"flashrl eval: {args.checkpoint} has no policy/ folder (saved with export_policy=False, or "
                "checkpoint_export_policy=False); evaluate a checkpoint saved with the policy, e.g. checkpoint_final."
            )
    elif not args.env:
        raise SystemExit(
            "flashrl eval: --env is required when the model is not a flashrl checkpoint "
            "(e.g. --env flashrl/Math-v0)."
        )
    for flag, value in (("--env-config", args.env_config), ("--engine-options", args.engine_options),
                        ("--splits", args.splits)):
        if value is not None and not isinstance(value, dict):
            raise SystemExit(f"flashrl eval: {flag} must be a JSON object, got {value!r}.")
    if base is not None and not args.trust_checkpoint_code:
        _refuse_checkpoint_code(args, base)
    if base is not None and _is_adapter(model):  # the adapter is merged into its base: a plain model to serve
        base = {k: v for k, v in base.items() if not k.startswith("lora_")}
    evaluation_env_config = None
    if args.env_config is not None:  # on top of the checkpoint's evaluation overrides
        evaluation_env_config = {**(base or {}).get("evaluation_env_config", {}), **args.env_config}
    try:
        config = evaluation_config(
            base,
            env=args.env,
            evaluation_env_config=evaluation_env_config,
            evaluation_splits=args.splits,
            evaluation_num_episodes=args.num_episodes,
            evaluation_num_samples_per_prompt=args.num_samples_per_prompt,
            evaluation_temperature=args.temperature,
            evaluation_top_p=args.top_p,
            engine=args.engine or (None if base else "torch"),
            engine_options=args.engine_options if args.engine_options is not None else (None if base else {}),
            max_new_tokens=args.max_new_tokens,
            max_episode_tokens=args.max_episode_tokens,
            episodes_in_flight_per_env_runner=args.concurrency,
            seed=args.seed,
        )
        with tempfile.TemporaryDirectory(prefix="flashrl-eval-") as tmp:
            model_path = _merged_adapter(model, args.base_model or (base or {}).get("model"), Path(tmp)) if (
                _is_adapter(model)) else resolve_model(model)
            metrics, results = evaluate_with_runner(config, model_path)
    except (ConfigError, FileNotFoundError) as err:
        raise SystemExit(f"flashrl eval: {err}") from err
    if args.details:
        _write_details(args.details, results, config.evaluation_datasource_key)
    summary = {
        "model": model,
        "env": config.env,
        "env_config": config.env_config,
        "evaluation_env_config": config.evaluation_env_config,
        "evaluation_splits": config.evaluation_splits,
        **metrics,
    }
    print(json.dumps(summary, indent=2, default=str))
    return 0


def _is_adapter(model: str) -> bool:
    """Whether ``model`` is an adapter-only policy: a LoRA run's exported adapter (its checkpoint's policy/)."""
    return Path(model, "adapter_config.json").is_file() and not Path(model, "config.json").is_file()


def _merged_adapter(folder: str, base_model: str | None, tmp: Path) -> str:
    """The adapter in ``folder`` merged into its base model (``--base-model``, else the checkpoint config's
    model, else the one the adapter names), written under ``tmp``: the plain model the engine then serves."""
    from flashrl.checkpoints.export import merge_adapter_folder
    from flashrl.models import resolve_model

    named = json.loads(Path(folder, "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
    wanted = base_model or named
    fix = "Fix: pass the model the adapter was trained on with --base-model (a local folder, hub id or built-in name)."
    if not wanted:
        raise SystemExit(f"flashrl eval: {folder} is a LoRA adapter naming no base model. {fix}")
    try:
        base_path = resolve_model(wanted)
    except (FileNotFoundError, RuntimeError) as err:
        raise SystemExit(
            f"flashrl eval: {folder} is a LoRA adapter; expected its base model {wanted!r} to be a local folder, "
            f"hub id or built-in name, got: {err} {fix}"
        ) from err
    return merge_adapter_folder(folder, base_path, tmp / "merged")


def _refuse_checkpoint_code(args: argparse.Namespace, base: dict[str, Any]) -> None:
    """Exit naming each setting of the checkpoint's config that names code (`FlashReinforce.from_checkpoint`
    says why), except those the flags give again; ``--trust-checkpoint-code`` skips this."""
    from flashrl.algorithms.flash_reinforce.config import refuse_checkpoint_code
    from flashrl.checkpoints.stored_code import UntrustedCodeError

    stored = {k: v for k, v in base.items() if k != "callbacks_class"}  # evaluation runs without callbacks
    if args.env_config is not None and isinstance(stored.get("evaluation_env_config"), dict):
        stored["evaluation_env_config"] = {k: v for k, v in stored["evaluation_env_config"].items()
                                           if k not in args.env_config}  # the flag's keys replace these
    given = {name: value for name, value in (("env", args.env), ("evaluation_splits", args.splits),
                                             ("engine_options", args.engine_options)) if value is not None}
    try:
        refuse_checkpoint_code(args.checkpoint, stored, given=given, fix=(
            "give them again (--env, --env-config for evaluation_env_config, --splits, --engine-options), or "
            f"evaluate its policy as a plain model with your own settings (flashrl eval {args.checkpoint}/policy "
            "--env ... --env-config ...), or, if you trust whoever wrote this checkpoint, add "
            "--trust-checkpoint-code"))
    except UntrustedCodeError as err:
        raise SystemExit(f"flashrl eval: {err}") from err


def _write_details(path: str, results: dict[str | None, list[Any]], datasource_key: str | None) -> None:
    """One JSON line per scored episode: split, prompt index, replica, prompt id, return, benchmark."""
    with open(path, "w", encoding="utf-8") as f:
        for split, reports in results.items():
            for report in reports:
                for ep in report.episodes:
                    row = {
                        "split": split,
                        "index": ep.info["episode_index"],
                        "replica": ep.info["replica"],
                        "prompt_id": ep.prompt_id,
                        "reward": ep.reward,
                    }
                    if datasource_key and datasource_key in ep.info:
                        row["data_source"] = ep.info[datasource_key]
                    f.write(json.dumps(row, default=str) + "\n")


# --------------------------------------------------------------------------------------------- show
def _show(args: argparse.Namespace) -> int:
    from flashrl.metrics.rollouts import format_rollout, read_rollouts
    from flashrl.terminal_text import escape_terminal

    try:
        records = read_rollouts(args.file)
    except (OSError, ValueError, TypeError) as err:  # the error may quote the file's text
        print(escape_terminal(f"flashrl show: {err}"), file=sys.stderr)
        return 1
    if not records:
        print(f"flashrl show: {args.file} holds no episode.", file=sys.stderr)
        return 1
    if not -len(records) <= args.index < len(records):
        print(
            f"flashrl show: --index: expected 0..{len(records) - 1} (the file holds {len(records)} episodes), "
            f"got {args.index}.",
            file=sys.stderr,
        )
        return 2
    index = args.index % len(records)
    print(f"{args.file}: episode {index} of 0..{len(records) - 1}")
    print(format_rollout(records[index]))
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
    # allow_abbrev=False everywhere: a misspelt or shortened flag is an error, never another flag.
    parser = argparse.ArgumentParser(
        prog="flashrl", description="FlashREINFORCE: train, evaluate, show rollouts, fetch models.",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="run a tuned example (a preset) with overrides",
        description="Run tuned_examples/<preset>.py; the flags after the preset are its own.",
        allow_abbrev=False,
    )
    train.add_argument("--list", action="store_true", help="list the presets")
    train.add_argument("preset", nargs="?", help="preset name (see --list) or a path to a .py script")
    train.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="flags of the preset (--dry-run, --lr, ...)"
    )
    train.set_defaults(func=_train)

    launch = sub.add_parser(
        "launch",
        help="render a tuned example as a SLURM or KubeRay job",
        description="Render an sbatch script (slurm) or a KubeRay RayJob manifest (kuberay) that runs the tuned "
        "example on a Ray cluster of its node plan; the flags after the preset are its own (--num-nodes, "
        "--gpus-per-node, ... change the plan). See docs/training.md, 'Running on a cluster'.",
        allow_abbrev=False,
    )
    launch.add_argument("target", choices=("slurm", "kuberay"), help="where the job runs")
    launch.add_argument("--image", default=None, help="kuberay: a container image with flashrl installed")
    launch.add_argument("--out", default=None, help="write the file here (default: stdout)")
    launch.add_argument("preset", help="preset name (see flashrl train --list) or a path to a .py script")
    launch.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="flags of the preset (--num-nodes, --lr, ...)"
    )
    launch.set_defaults(func=_launch)

    ev = sub.add_parser(
        "eval",
        help="evaluate a checkpoint (or any model) on an environment",
        description="The evaluation of FlashReinforce.evaluate() (same prompts, same protocol) on an "
        "in-process EnvRunner. Flags left out take the checkpoint's settings (or the config defaults).",
        allow_abbrev=False,
    )
    ev.add_argument(
        "checkpoint", help="a flashrl checkpoint folder, a Hugging Face folder, a hub id or built-in name"
    )
    ev.add_argument("--env", default=None, help="Gymnasium id (default: the checkpoint's env)")
    ev.add_argument(
        "--base-model", default=None,
        help="for a LoRA adapter (a LoRA run's checkpoint or exported adapter): the model it was trained on "
        "(default: the checkpoint's model, else the one the adapter names); the adapter is merged into it",
    )
    ev.add_argument(
        "--env-config", type=json.loads, default=None,
        help="JSON object of env keyword arguments (on top of the checkpoint's evaluation_env_config)",
    )
    ev.add_argument(
        "--splits", type=json.loads, default=None,
        help='JSON object of named splits, e.g. \'{"seen": {"split": "valid_seen"}}\' (evaluation_splits)',
    )
    ev.add_argument("--num-episodes", type=int, default=None, help="prompts per split (evaluation_num_episodes)")
    ev.add_argument(
        "--num-samples-per-prompt", type=int, default=None, help="k of avg@k (evaluation_num_samples_per_prompt)"
    )
    ev.add_argument("--engine", choices=("torch", "vllm"), default=None,
                    help="inference engine (default: the checkpoint's, else torch)")
    ev.add_argument(
        "--engine-options",
        type=json.loads,
        default=None,
        help='JSON object of engine options, e.g. \'{"device": "cuda"}\' for the torch engine',
    )
    ev.add_argument("--temperature", type=float, default=None, help="evaluation_temperature; 0 = greedy")
    ev.add_argument("--top-p", type=float, default=None, help="evaluation_top_p")
    ev.add_argument(
        "--max-new-tokens", type=int, default=None, help="tokens per turn (default: checkpoint's or 256)"
    )
    ev.add_argument(
        "--max-episode-tokens", type=int, default=None, help="context budget (default: checkpoint's or 2048)"
    )
    ev.add_argument("--concurrency", type=int, default=None, help="episodes played at once")
    ev.add_argument("--seed", type=int, default=None, help="evaluation seed (default: the checkpoint's or 0)")
    ev.add_argument("--details", default=None, help="write one JSON line per scored episode to this file")
    ev.add_argument(
        "--trust-checkpoint-code", action="store_true",
        help="run and import the code the checkpoint's config names (commands, 'module:name' paths, vLLM's "
        "engine_args); without it such settings are refused unless given again: only for checkpoints you trust",
    )
    ev.set_defaults(func=_eval)

    show = sub.add_parser(
        "show",
        help="print one episode of a rollout dump readably",
        description="Print one episode of a rollout dump (.reporting(rollout_dump_every=N)): its prompt, every "
        "turn with its role, reward, policy versions, drift, accepted and info.",
        allow_abbrev=False,
    )
    show.add_argument("file", help="a rollout dump (<TensorBoard folder>/rollouts/iteration_<N>.jsonl)")
    show.add_argument("--index", type=int, default=0, help="which episode of the file (default 0; -1 = last)")
    show.set_defaults(func=_show)

    models = sub.add_parser("models", help="obtain models", allow_abbrev=False)
    models_sub = models.add_subparsers(dest="models_command", required=True)
    fetch = models_sub.add_parser(
        "fetch", help="build a built-in model in the cache (or download a hub id)", allow_abbrev=False
    )
    fetch.add_argument("name", nargs="?", default="smollm2-135m-instruct", help="built-in name or hub id")
    models_sub.add_parser("list", help="list the built-in models", allow_abbrev=False)
    models.set_defaults(func=_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "eval":
        for flag in ("num_episodes", "num_samples_per_prompt", "concurrency"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                build_parser().error(f"--{flag.replace('_', '-')}: expected an integer >= 1, got {value}")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
