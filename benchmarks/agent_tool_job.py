"""The CPU tool job as an agent written on the official `openai` client (`flashrl/Agent-v0`), on 2 CPU cores.

The tuned example of this task is `tuned_examples/smollm2_python_tool_cpu.py` (the env form: the README's
agentic job, the paired comparison's tool task). This is the same job in the agent form, the job that
`benchmarks/agentic_learning.py --job agent` (and `--job agent_summarising`) and
`benchmarks/agent_prompt_probe.py` measure (docs/agents.md, "The laptop demonstration"); until the two
forms were made one tool job it was `tuned_examples/smollm2_tool_agent_cpu.py`, the name its recorded
reports keep. It runs on its own too:

    python benchmarks/agent_tool_job.py                      # the whole run
    python benchmarks/agent_tool_job.py --agent summarising  # the agent that rewrites its context
    python benchmarks/agent_tool_job.py --dry-run            # the plan, nothing started

The task is the CPU tool job's (`smollm2_python_tool_cpu.py`: "What is a * b?", a and b in 11..99, the same
2048 training and 64 held-out products, the same sandbox, the same verifier), but the episode is not a
flashrl environment: it is the user's agent below, an `async def agent(client, task)` that talks to the
policy only through `client`, an `openai.AsyncOpenAI` bound to this episode's endpoint in the EnvRunner
(`flashrl/Agent-v0`, docs/agents.md). The agent passes a `python` tool schema; the model answers with
native tool calls (`<tool_call>` blocks, which the endpoint returns as `tool_calls`); the agent runs
each call's code in flashrl's sandbox and sends the output back as a `tool` message; its second reply
is graded. Every call is recorded token-exactly and trained on.

Two agents:

* `multiply` (default): one conversation; the second call extends the first (one segment per episode).
* `summarising`: after the tool ran, the agent starts over with a fresh context that holds only the
  question and a one-line summary of what the code printed: the second call's prompt does not extend
  the first one's tokens, so each episode has two segments, recomputed by the learner on their own
  contexts, and still weighs 1/B (docs/design.md §1).

Writes under --output: TensorBoard logs, progress.jsonl, curves.png, checkpoints/ (every 10 updates or
10 minutes, the newest 2), checkpoint_final/, result.json.
"""

import argparse
import asyncio
import dataclasses
import json
import os
import sys

from flashrl.algorithms import FlashReinforceConfig
from flashrl.envs.math.verifier import verify_answer
from flashrl.envs.python_tool import (
    DEFAULT_SANDBOX,
    PYTHON_TOOL_DESCRIPTION,
    PYTHON_TOOL_PARAMETERS,
    format_observation,
)
from flashrl.envs.sandbox import Sandbox
from flashrl.recipes import run_preset

# the tool job's tasks, not a copy (tuned examples are scripts, not a package)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tuned_examples"))
from smollm2_python_tool_cpu import PRESET as TOOL_PRESET
from smollm2_python_tool_cpu import TEMPERATURE, products  # noqa: F401 - TEMPERATURE: the probe samples at it
from smollm2_python_tool_cpu import make_config as tool_job_config

SYSTEM_PROMPT = (
    "You can call a python tool that runs code and returns what it printed (use print). When you know the "
    "answer, reply with the final answer in \\boxed{} and no tool call."
)


def worked_example(a: int, b: int) -> list[dict]:
    """One solved question as real chat turns: the question, a native `python` tool call, its output, the answer."""
    call = {"id": f"example_{a}_{b}", "type": "function",
            "function": {"name": "python", "arguments": json.dumps({"code": f"print({a} * {b})"})}}
    return [{"role": "user", "content": f"What is {a} * {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": f"Exit status: 0\nstdout:\n```\n{a * b}\n```"},
            {"role": "assistant", "content": f"\\boxed{{{a * b}}}"}]


EXAMPLES = worked_example(37, 64) + worked_example(52, 19)
"""Two worked examples before the question (in neither the training nor the held-out products). The model
has no tool-call format of its own: with the tool job's one-shot text in the system prompt instead, it made
0 native calls in 24 samples; with these two examples, 16 (docs/agents.md, "The laptop demonstration")."""
TOOLS = [{"type": "function", "function": {
    "name": "python", "description": PYTHON_TOOL_DESCRIPTION,
    "parameters": {"type": "object", "properties": PYTHON_TOOL_PARAMETERS, "required": ["code"]},
}}]
MODEL = "policy"
"""The model name the endpoint serves (the runner's `agent_model_name`)."""
_sandbox = None


def run_python(arguments: str) -> str:
    """Run a `python` tool call's code in the sandbox; what the tool answers."""
    global _sandbox
    try:
        code = json.loads(arguments)["code"]
    except (ValueError, KeyError, TypeError) as err:
        return f"Error: the arguments must be a JSON object with a string 'code' ({type(err).__name__}: {err})."
    if not isinstance(code, str):
        return "Error: 'code' must be a string."
    if _sandbox is None:
        _sandbox = Sandbox(DEFAULT_SANDBOX)
    return format_observation(_sandbox.run(code), max_chars=1024, wall_time_s=DEFAULT_SANDBOX.wall_time_s)


async def tool_outputs(message) -> list[dict]:
    """One `tool` message per call of ``message``."""
    outputs = []
    for call in message.tool_calls or []:
        output = await asyncio.to_thread(run_python, call.function.arguments)
        outputs.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return outputs


async def graded(message, task) -> dict:
    text = message.content or ""
    reward = (await asyncio.to_thread(verify_answer, text, task["answer"])).reward  # blocking: not on the loop
    return {"reward": reward, "success": reward == 1.0}


async def multiply(client, task):
    """Ask, run the tool calls, ask again: two calls, the second extending the first."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLES, {"role": "user", "content": task["question"]}]
    first = (await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)).choices[0].message
    if not first.tool_calls:
        return await graded(first, task)
    messages += [first.model_dump(exclude_none=True), *await tool_outputs(first)]
    second = (await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)).choices[0].message
    return await graded(second, task)


async def summarising(client, task):
    """As `multiply`, but the second call starts from a fresh context holding a summary of the first."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLES, {"role": "user", "content": task["question"]}]
    first = (await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)).choices[0].message
    if not first.tool_calls:
        return await graded(first, task)
    printed = " ".join(out["content"] for out in await tool_outputs(first))
    summary = [{"role": "system", "content": SYSTEM_PROMPT},
               {"role": "user", "content": f"{task['question']}\nYour code printed: {printed}"}]
    second = (await client.chat.completions.create(model=MODEL, messages=summary, tools=TOOLS)).choices[0].message
    return await graded(second, task)


AGENTS = {"multiply": multiply, "summarising": summarising}

PRESET = dataclasses.replace(
    TOOL_PRESET,  # the tool job's success bar, budget, machine and pins
    name="smollm2_tool_agent_cpu",
    description="SmolLM2-135M-Instruct as an openai-client agent with a Python tool (native tool calls), vLLM CPU build",
    sources={
        "tasks, temperature 0.7, success 0.35, batch 16, lr 3e-6, delta 0.05, bf16, 2048-token passes": "the CPU "
        "tool job's values (tuned_examples/smollm2_python_tool_cpu.py, which cites their measurements)",
        "two model calls per episode": "the tool job's two replies (a tool call, then the answer)",
    },
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--agent", choices=sorted(AGENTS), default="multiply", help="which agent to train")


WALL_TIME_S = 600.0
"""An episode's wall time (the default of the runner's `agent_wall_time_s`). On 2 cores an episode waits behind the others in flight and
the learner's update; at 120 s, 124 of the 468 episodes the first seed started were dropped
(`benchmarks/results/agent_learning_wall120.json`; that run did not record why, docs/agents.md)."""


def agent_env_config(agent, rows: list[dict]) -> dict:
    return {"tasks": rows, "agent": agent}


def make_config(args) -> FlashReinforceConfig:
    """The tool job's config (its runners, learner, training and evaluation), with this agent env instead."""
    train, held_out = products()
    agent = AGENTS[getattr(args, "agent", "multiply")]
    return (
        tool_job_config(args)
        .environment("flashrl/Agent-v0", env_config=agent_env_config(agent, train))
        .env_runners(
            max_episode_tokens=768,  # the tool job's 640 + the two worked examples (about 130 tokens)
            # the endpoint's settings (recorded runs gave them in env_config: the same values, docs/agents.md)
            agent_model_name=MODEL,
            agent_max_calls=2,
            agent_wall_time_s=WALL_TIME_S,
        )
        .evaluation(evaluation_env_config=agent_env_config(agent, held_out))
    )


if __name__ == "__main__":
    sys.exit(run_preset(PRESET, make_config, add_arguments=add_arguments))
