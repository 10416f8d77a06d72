"""The untrained model on candidate multi-turn task families: where does it start?

A CPU agentic job can only learn where the untrained policy already succeeds sometimes (signal) but
not mostly (headroom): about 5-40%. This plays ``--num-tasks`` held-out tasks of each family of
:mod:`flashrl.envs.tool_tasks` on ``flashrl/PythonTool-v0`` (real sandbox) with SmolLM2-135M-Instruct,
greedy and sampled (temperature 1), through an in-process ``EnvRunner`` and its engine, with the
evaluation protocol of ``flashrl eval`` (``flashrl/cli.py``: prompt ``i`` is task ``i``, seeds derived
from ``--seed``): what is measured here is what training would see. Each family is one evaluation
split of one runner, so the engine starts once per temperature.

Small generated ALFWorld games (``ALFWORLD_FAMILIES``: four receptacles, no distractors, walkthroughs
of at most 4 commands, admissible commands shown) run the same way on ``flashrl/ALFWorld-v0``; one
invocation plays families of one env.

Per family and temperature: success rate, mean turns, tool calls per episode, the share of episodes
that called the tool, and how episodes ended (``answered``: a boxed answer; ``turn_limit``; ``context``:
the token budget ran out; dropped episodes by the runner's skip reason).

    python benchmarks/agentic_baselines.py                              # vLLM CPU build, 64 tasks
    python benchmarks/agentic_baselines.py --num-tasks 16 --engine torch  # a quick smoke test

Writes ``benchmarks/results/agentic_baselines.json`` (machine, commit, seeds, settings, every row).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from _reports import fmt, machine, table, write_json

from flashrl.envs.tool_tasks import ANSWER_HINT, TOOL_GENERATORS, ToolTaskFamily, held_out_rows

ENV = "flashrl/PythonTool-v0"
ALFWORLD_ENV = "flashrl/ALFWorld-v0"
MODEL = "smollm2-135m-instruct"

#: The candidates: the default tool prompt, a one-shot worked example, a short prompt; two task sizes.
FAMILIES: tuple[ToolTaskFamily, ...] = (
    ToolTaskFamily("mul2_default", "products_2digit", "default"),
    ToolTaskFamily("mul2_one_shot", "products_2digit", "one_shot"),
    ToolTaskFamily("mul2_short", "products_2digit", "short"),
    ToolTaskFamily("mul3_one_shot", "products_3digit", "one_shot"),
    ToolTaskFamily("sum6_one_shot", "sums_6x3digit", "one_shot"),
    # two replies: the call, then the answer (the second reply is verified at the turn limit)
    ToolTaskFamily("mul2_one_shot_t2", "products_2digit", "one_shot", max_turns=2),
    # ... and every tool output ends with an instruction to answer (shown in the worked example too)
    ToolTaskFamily("mul2_hint_t2", "products_2digit", "one_shot_hint", max_turns=2, observation_suffix=ANSWER_HINT),
    ToolTaskFamily("mul3_hint_t2", "products_3digit", "one_shot_hint", max_turns=2, observation_suffix=ANSWER_HINT),
    ToolTaskFamily("sum6_hint_t2", "sums_6x3digit", "one_shot_hint", max_turns=2, observation_suffix=ANSWER_HINT),
)



@dataclass(frozen=True)
class AlfworldFamily:
    """Small generated ALFWorld games: few receptacles, short walkthroughs, admissible commands shown.

    Held-out games: split ``valid_unseen`` (ALFRED's held-out floor plans) of the generator's seed 0;
    a training job would draw from ``train``.
    """

    name: str
    task_types: tuple[str, ...]
    max_turns: int
    max_receptacles: int = 4
    num_distractors: int = 0
    max_walkthrough_steps: int = 4

    def env_config(self, num_tasks: int) -> dict[str, Any]:
        from flashrl.envs.alfworld.generator import GeneratorConfig

        generator = GeneratorConfig(max_receptacles=self.max_receptacles, num_distractors=self.num_distractors,
                                    max_walkthrough_steps=self.max_walkthrough_steps)
        return {"split": "valid_unseen", "num_games": num_tasks, "task_types": list(self.task_types), "seed": 0,
                "generator": generator, "max_turns": self.max_turns, "order": "sequential"}


#: Four-receptacle rooms, no distractor objects, tasks the planner solves in at most 4 commands.
ALFWORLD_FAMILIES: tuple[AlfworldFamily, ...] = (
    AlfworldFamily("alfworld_place_r4_t8", ("pick_and_place_simple",), max_turns=8),
    AlfworldFamily("alfworld_light_r4_t8", ("look_at_obj_in_light",), max_turns=8),
)


def env_of(family: ToolTaskFamily | AlfworldFamily) -> str:
    return ALFWORLD_ENV if isinstance(family, AlfworldFamily) else ENV


def termination(episode: Any) -> str:
    """How a delivered episode ended: a boxed answer, the env's turn limit, or the token budget."""
    if episode.terminated:
        return "answered"
    if episode.info.get("turn_limit_reached"):
        return "turn_limit"
    return "context"


def transcript(episode: Any, tokenizer: Any, max_chars: int = 1500) -> str:
    """The episode's text after the prompt (model replies and tool answers), for reading what it did."""
    first = episode.loss_mask.index(True) if True in episode.loss_mask else len(episode.token_ids)
    return tokenizer.decode(episode.token_ids[first:])[:max_chars]


def summarize(report: Any, num_tasks: int) -> dict[str, Any]:
    """One row: rates over the ``num_tasks`` played (a dropped episode counts as a failure)."""
    episodes = report.episodes
    ended = Counter(termination(ep) for ep in episodes)
    ended.update({f"dropped:{k}": v for k, v in report.skipped.items()})
    successes = sum(bool(ep.success) for ep in episodes)
    tool_calls = [int(ep.info.get("tool_calls", 0)) for ep in episodes]
    n = max(len(episodes), 1)
    return {
        "num_tasks": num_tasks,
        "num_delivered": len(episodes),
        "success_rate": successes / num_tasks,
        "mean_turns": sum(len(ep.policy_versions) for ep in episodes) / n,
        "tool_calls_per_episode": sum(tool_calls) / n,
        "share_with_tool_call": sum(c > 0 for c in tool_calls) / n,
        "success_with_tool_call": sum(bool(ep.success) and c > 0 for ep, c in zip(episodes, tool_calls)) / num_tasks,
        "mean_generated_tokens": sum(ep.num_generated_tokens for ep in episodes) / n,
        "termination": dict(sorted(ended.items())),
    }


def make_config(args: argparse.Namespace, temperature: float, splits: dict[str, dict[str, Any]], env: str) -> Any:
    from flashrl.cli import evaluation_config

    first = next(iter(splits.values()))
    return evaluation_config(
        env=env,
        env_config=first,
        evaluation_env_config=first,
        evaluation_splits=splits,
        evaluation_num_episodes=args.num_tasks,
        evaluation_temperature=temperature,
        engine=args.engine,
        max_new_tokens=args.max_new_tokens,
        max_episode_tokens=args.max_episode_tokens,
        episodes_in_flight_per_env_runner=args.concurrency,
        model=MODEL,
        dtype="float32",
        seed=args.seed,
    )


async def play(config: Any, model_path: str, names: list[str], done: Callable[[str, Any, float], None]) -> float:
    """Play each split on one runner (one engine start), handing ``done`` its report and wall time.

    Returns the engine's start time in seconds.
    """
    from flashrl.env_runners import EnvRunner

    runner = EnvRunner(config.env_runner_spec(), runner_index=0, num_runners=1, model_path=model_path)
    try:
        start = time.perf_counter()
        await runner.setup()
        engine_start = time.perf_counter() - start
        for name in names:
            start = time.perf_counter()
            report = await runner.sample(list(range(config.evaluation_num_episodes)), evaluation=True, split=name)
            done(name, report, time.perf_counter() - start)
    finally:
        await runner.stop()
    return engine_start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--num-tasks", type=int, default=64, help="held-out tasks per family")
    parser.add_argument("--families", nargs="+", default=[f.name for f in FAMILIES],
                        choices=[f.name for f in FAMILIES + ALFWORLD_FAMILIES],
                        help="all of one env (PythonTool or ALFWorld): one runner plays them")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--engine", default="vllm", choices=["vllm", "torch"])
    parser.add_argument("--max-new-tokens", type=int, default=128, help="per reply")
    parser.add_argument("--max-episode-tokens", type=int, default=1024, help="whole episode (engine context)")
    parser.add_argument("--concurrency", type=int, default=16, help="episodes in flight")
    parser.add_argument("--seed", type=int, default=0, help="the runner's seed (sampling seeds)")
    parser.add_argument("--task-seed", type=int, default=2026, help="seed of the held-out task draws")
    parser.add_argument("--output", default="benchmarks/results/agentic_baselines.json")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from flashrl.models import resolve_model

    model_path = resolve_model(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    families = [f for f in FAMILIES + ALFWORLD_FAMILIES if f.name in args.families]
    envs = {env_of(f) for f in families}
    if len(envs) != 1:
        parser.error(f"--families must all be of one env; got families of {sorted(envs)}. Run each env on its own.")
    env = envs.pop()
    rows_by_family = {
        f.name: held_out_rows(TOOL_GENERATORS[f.generator], args.num_tasks, seed=args.task_seed)
        for f in families if isinstance(f, ToolTaskFamily)
    }
    splits = {
        f.name: f.env_config(rows_by_family[f.name]) if isinstance(f, ToolTaskFamily) else f.env_config(args.num_tasks)
        for f in families
    }
    results: list[dict[str, Any]] = []
    engine_start_s: dict[str, float] = {}

    def record(complete: bool) -> str:
        # written after every family, so a run stopped early keeps what it measured
        return write_json(args.output, {
            "benchmark": "agentic_baselines",
            "complete": complete,
            "model": MODEL,
            "env": env,
            "engine": args.engine,
            "machine": machine(),
            "settings": {
                "num_tasks": args.num_tasks, "temperatures": args.temperatures, "max_new_tokens": args.max_new_tokens,
                "max_episode_tokens": args.max_episode_tokens, "episodes_in_flight": args.concurrency,
                "seed": args.seed, "task_seed": args.task_seed, "dtype": "float32",
            },
            "engine_start_s": engine_start_s,
            "families": {f.name: {**asdict(f), "first_task_ids": [r["id"] for r in rows_by_family.get(f.name, [])[:3]]}
                         for f in families},
            "results": results,
        })

    for temperature in args.temperatures:
        print(f"temperature {temperature:g}:", flush=True)
        config = make_config(args, temperature, splits, env)

        def done(name: str, report: Any, seconds: float, temperature: float = temperature) -> None:
            family = next(f for f in families if f.name == name)
            results.append({
                **asdict(family),
                "family": family.name,
                "temperature": temperature, "wall_s": seconds, "load_average": list(os.getloadavg()),
                **summarize(report, args.num_tasks),
                "example": transcript(report.episodes[0], tokenizer) if report.episodes else None,
            })
            r = results[-1]
            print(f"  {name}: success {r['success_rate']:.2f}, {r['termination']}, {seconds:.0f} s", flush=True)
            record(complete=False)

        engine_start_s[f"{temperature:g}"] = asyncio.run(play(config, model_path, list(splits), done))

    headers = ["family", "T", "success", "turns", "tool calls", "w/ tool", "ended (answered/turn_limit/other)", "s"]
    lines = []
    for r in results:
        t = r["termination"]
        other = sum(v for k, v in t.items() if k not in ("answered", "turn_limit"))
        lines.append([r["family"], f"{r['temperature']:g}", fmt(r["success_rate"], ".2f"), fmt(r["mean_turns"], ".2f"),
                      fmt(r["tool_calls_per_episode"], ".2f"), fmt(r["share_with_tool_call"], ".2f"),
                      f"{t.get('answered', 0)}/{t.get('turn_limit', 0)}/{other}", f"{r['wall_s']:.0f}"])
    print(table(headers, lines))
    path = record(complete=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # the guard vLLM's spawned engine core needs
    sys.exit(main())
