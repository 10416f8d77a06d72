r"""Arithmetic task families that need ``flashrl/PythonTool-v0``'s interpreter, and their prompts.

Candidates for a CPU agentic job on a small model: the questions are beyond what SmolLM2-135M does in
its head (two- and three-digit products, long sums), so an episode is won by writing a ```python
block, reading what it printed and answering in ``\boxed{}``. ``benchmarks/agentic_baselines.py``
measures the untrained model on each (``docs/benchmarks.md``, "Agentic task candidates").

Each family is a generator (an :class:`~flashrl.envs.math.generators.ArithmeticGenerator`, so a
seeded draw reproduces its task) plus a system prompt; :func:`held_out_rows` turns a generator into a
fixed list of distinct rows that ``PythonTool-v0`` takes as ``tasks`` (with ``id_field="id"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashrl.envs.math.generators import ArithmeticGenerator
from flashrl.envs.math.tasks import MathTask
from flashrl.envs.python_tool import TOOL_SYSTEM_PROMPT

#: Generators of the tool families; prompt ids are ``<name>:<expression>`` (e.g. ``"mul2:47*83"``).
TOOL_GENERATORS: dict[str, ArithmeticGenerator] = {
    # a * b, two-digit operands: the model's head answers almost none; one print() answers all
    "products_2digit": ArithmeticGenerator(11, 99, 2, ("*",), name="mul2"),
    # a * b, three-digit operands
    "products_3digit": ArithmeticGenerator(100, 999, 2, ("*",), name="mul3"),
    # six three-digit addends: long enough that mental addition fails, trivial in code
    "sums_6x3digit": ArithmeticGenerator(100, 999, 6, ("+",), name="sum6"),
}

#: The tool protocol followed by one worked episode: the model sees the exact shape of a tool call,
#: the environment's answer (as ``format_observation`` writes it) and the boxed final answer.
ONE_SHOT_SYSTEM_PROMPT = (
    TOOL_SYSTEM_PROMPT
    + "\n\nExample.\nUser: What is 37 * 64?\nAssistant:\n```python\nprint(37 * 64)\n```\n"
    "User: Exit status: 0\nstdout:\n```\n2368\n```\nAssistant: \\boxed{2368}"
)

#: The instruction ``observation_suffix`` appends to every tool output in the ``*_hint`` families.
ANSWER_HINT = "Now reply with only the result in \\boxed{}."

#: The one-shot example with the hint where the environment puts it: the worked episode shows the
#: tool's output, the hint after it, then the boxed copy of the printed number.
ONE_SHOT_HINT_SYSTEM_PROMPT = (
    TOOL_SYSTEM_PROMPT
    + "\n\nExample.\nUser: What is 37 * 64?\nAssistant:\n```python\nprint(37 * 64)\n```\n"
    "User: Exit status: 0\nstdout:\n```\n2368\n```\n\n" + ANSWER_HINT + "\nAssistant: \\boxed{2368}"
)

#: A shorter protocol for a small model: one instruction per sentence, the call shown inline.
SHORT_SYSTEM_PROMPT = (
    "Compute with Python. Reply with only a code block like\n```python\nprint(12 * 34)\n```\n"
    "You will get the printed result. Then reply with the result in \\boxed{}, like \\boxed{408}."
)

TOOL_PROMPTS: dict[str, str] = {
    "default": TOOL_SYSTEM_PROMPT,
    "one_shot": ONE_SHOT_SYSTEM_PROMPT,
    "one_shot_hint": ONE_SHOT_HINT_SYSTEM_PROMPT,
    "short": SHORT_SYSTEM_PROMPT,
}


@dataclass(frozen=True)
class ToolTaskFamily:
    """One candidate: which tasks, which system prompt, how many turns."""

    name: str
    """Name in the benchmark's table."""
    generator: str
    """Key of :data:`TOOL_GENERATORS`."""
    prompt: str
    """Key of :data:`TOOL_PROMPTS`."""
    max_turns: int = 3
    """Replies per episode (a tool call, then the answer, plus one spare)."""
    observation_suffix: str = ""
    """PythonTool's ``observation_suffix``: an instruction after every tool output (``""``: none)."""

    def __post_init__(self) -> None:
        if self.generator not in TOOL_GENERATORS:
            raise ValueError(f"generator must be one of {sorted(TOOL_GENERATORS)}; got {self.generator!r}.")
        if self.prompt not in TOOL_PROMPTS:
            raise ValueError(f"prompt must be one of {sorted(TOOL_PROMPTS)}; got {self.prompt!r}.")
        if self.max_turns < 2:
            raise ValueError(f"max_turns must be >= 2 (a tool call, then the answer); got {self.max_turns}.")

    def env_config(self, rows: list[dict[str, str]]) -> dict[str, object]:
        """``flashrl/PythonTool-v0`` arguments that play ``rows`` in order with this family's prompt."""
        config: dict[str, object] = {
            "tasks": rows,
            "id_field": "id",
            "system_prompt": TOOL_PROMPTS[self.prompt],
            "max_turns": self.max_turns,
            "order": "sequential",
        }
        if self.observation_suffix:
            config["observation_suffix"] = self.observation_suffix
        return config


def held_out_rows(generator: ArithmeticGenerator, num_tasks: int, *, seed: int) -> list[dict[str, str]]:
    """``num_tasks`` distinct tasks of ``generator`` drawn with ``seed``, as ``id``/``question``/``answer`` rows.

    Raises ValueError when the generator cannot give that many distinct tasks in ``100 * num_tasks`` draws.
    """
    if num_tasks < 1:
        raise ValueError(f"num_tasks must be >= 1; got {num_tasks}.")
    rng = np.random.default_rng(seed)
    seen: dict[str, MathTask] = {}
    for _ in range(100 * num_tasks):
        task = generator.sample(rng)
        seen.setdefault(task.prompt_id, task)
        if len(seen) == num_tasks:
            return [{"id": t.prompt_id, "question": t.question, "answer": t.answer} for t in seen.values()]
    raise ValueError(
        f"{generator.name}: expected {num_tasks} distinct tasks, drew only {len(seen)} in {100 * num_tasks} "
        "draws. Fix: ask for fewer tasks or widen the operand range."
    )
