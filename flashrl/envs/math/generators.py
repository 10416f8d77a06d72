"""Offline task generators: arithmetic of adjustable difficulty and multi-step word problems.

Both are infinite :class:`~flashrl.envs.math.tasks.TaskSource` objects: ``sample(rng)`` draws a task
from the environment's NumPy generator, so a seeded ``reset`` reproduces the task. The reference
answer is computed exactly with Python integers; the prompt id is the task's content
(``"arith:23+45"``), so the same question always has the same id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from flashrl.envs.math.tasks import MathTask

_OPERATORS = ("+", "-", "*")


@dataclass(frozen=True)
class ArithmeticGenerator:
    """Integer expressions ``a op b op c ...`` evaluated with the usual precedence.

    ``ArithmeticGenerator()`` is the ``easy_sums`` preset: ``What is a + b?`` with ``a, b`` in 1..30.
    :meth:`from_difficulty` gives levels 1 (easy sums) to 5 (four operands up to 999 with ``*``).
    """

    min_value: int = 1
    """Smallest operand (inclusive)."""
    max_value: int = 30
    """Largest operand (inclusive)."""
    num_operands: int = 2
    """Number of operands in the expression (>= 2)."""
    operators: tuple[str, ...] = ("+",)
    """Operators to draw from, a subset of ``+``, ``-``, ``*``."""
    allow_negative: bool = False
    """Whether the result may be negative (otherwise such draws are rejected and redrawn)."""
    question_format: str = "What is {expression}?"
    """How the expression is turned into the question (``{expression}`` is replaced)."""
    name: str = "arith"
    """Prefix of the prompt ids."""

    def __post_init__(self) -> None:
        if self.num_operands < 2:
            raise ValueError(f"num_operands must be >= 2; got {self.num_operands}.")
        if self.min_value > self.max_value:
            raise ValueError(f"min_value must be <= max_value; got {self.min_value} > {self.max_value}.")
        bad = [op for op in self.operators if op not in _OPERATORS]
        if not self.operators or bad:
            raise ValueError(f"operators must be a non-empty subset of {_OPERATORS}; got {self.operators}.")
        if not self.allow_negative and self.max_value < 0:
            raise ValueError("allow_negative=False needs max_value >= 0.")
        if "{expression}" not in self.question_format:
            raise ValueError(f"question_format must contain '{{expression}}'; got {self.question_format!r}.")

    @classmethod
    def from_difficulty(cls, level: int) -> ArithmeticGenerator:
        """Level 1 (``a + b``, 1..30) to 5 (four operands, 1..999, ``+ - *``)."""
        levels = {
            1: cls(1, 30, 2, ("+",)),
            2: cls(1, 99, 2, ("+", "-")),
            3: cls(1, 99, 3, ("+", "-")),
            4: cls(2, 50, 3, ("+", "-", "*")),
            5: cls(1, 999, 4, ("+", "-", "*")),
        }
        if level not in levels:
            raise ValueError(f"difficulty must be one of {sorted(levels)}; got {level!r}.")
        return levels[level]

    def sample(self, rng: np.random.Generator) -> MathTask:
        for _ in range(1000):
            operands = [int(x) for x in rng.integers(self.min_value, self.max_value + 1, self.num_operands)]
            ops = [
                self.operators[int(i)] for i in rng.integers(len(self.operators), size=self.num_operands - 1)
            ]
            value = evaluate(operands, ops)
            if self.allow_negative or value >= 0:
                break
        else:  # pragma: no cover - needs a configuration where almost every draw is negative
            raise RuntimeError(f"{self}: could not draw a non-negative expression in 1000 tries.")
        expression = " ".join([str(operands[0])] + [f"{op} {x}" for op, x in zip(ops, operands[1:])])
        return MathTask(
            question=self.question_format.format(expression=expression),
            answer=str(value),
            prompt_id=f"{self.name}:{expression.replace(' ', '')}",
            metadata={"operands": operands, "operators": ops, "expression": expression},
        )


def evaluate(operands: list[int], operators: list[str]) -> int:
    """Value of ``operands[0] op0 operands[1] op1 ...`` with ``*`` binding tighter than ``+``/``-``."""
    terms: list[int] = [operands[0]]
    signs: list[int] = [1]
    for op, x in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


# --------------------------------------------------------------------------------------- word problems
_NAMES = ("Ana", "Ben", "Chen", "Dina", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jamal", "Kemal", "Lola")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells")

# Each template draws its numbers and returns (question, answer, numbers); numbers key the prompt id.
_Template = Callable[[np.random.Generator, int, str, str], tuple[str, int, tuple[int, ...]]]


def _buy_and_give(
    rng: np.random.Generator, scale: int, name: str, item: str
) -> tuple[str, int, tuple[int, ...]]:
    a, b, c = (int(x) for x in rng.integers(2, scale + 1, 3))
    d = int(rng.integers(1, a + b * c))
    question = (
        f"{name} has {a} {item}. {name} buys {b} packs with {c} {item} in each pack, then gives "
        f"{d} {item} to a friend. How many {item} does {name} have now?"
    )
    return question, a + b * c - d, (a, b, c, d)


def _change(rng: np.random.Generator, scale: int, name: str, item: str) -> tuple[str, int, tuple[int, ...]]:
    price, count = (int(x) for x in rng.integers(2, scale + 1, 2))
    paid = (price * count // 50 + 1) * 50
    question = (
        f"One of the {item} costs {price} dollars. {name} buys {count} of them and pays with "
        f"{paid} dollars. How many dollars of change does {name} get back?"
    )
    return question, paid - price * count, (price, count, paid)


def _two_legs(rng: np.random.Generator, scale: int, name: str, item: str) -> tuple[str, int, tuple[int, ...]]:
    s1, h1, s2, h2 = (int(x) for x in rng.integers(2, scale + 1, 4))
    question = (
        f"{name} drives at {s1} kilometres per hour for {h1} hours, then at {s2} kilometres per "
        f"hour for {h2} hours. How many kilometres does {name} drive in total?"
    )
    return question, s1 * h1 + s2 * h2, (s1, h1, s2, h2)


def _pages_left(
    rng: np.random.Generator, scale: int, name: str, item: str
) -> tuple[str, int, tuple[int, ...]]:
    per_day, days, extra = (int(x) for x in rng.integers(2, scale + 1, 3))
    read = per_day * days + extra
    total = read + int(rng.integers(1, scale * 4 + 1))
    question = (
        f"A book has {total} pages. {name} reads {per_day} pages a day for {days} days and then "
        f"{extra} more pages. How many pages are left to read?"
    )
    return question, total - read, (total, per_day, days, extra)


def _share_equally(
    rng: np.random.Generator, scale: int, name: str, item: str
) -> tuple[str, int, tuple[int, ...]]:
    boxes, per_box, friends = (int(x) for x in rng.integers(2, scale + 1, 3))
    kept = int(rng.integers(0, boxes * per_box // 2 + 1))
    rest = boxes * per_box - kept
    rest -= rest % friends  # make the share exact: give the remainder back to the boxes
    kept = boxes * per_box - rest
    question = (
        f"{name} has {boxes} boxes with {per_box} {item} in each box. {name} keeps {kept} {item} "
        f"and shares the rest equally among {friends} friends. How many {item} does each friend get?"
    )
    return question, rest // friends, (boxes, per_box, kept, friends)


def _savings(rng: np.random.Generator, scale: int, name: str, item: str) -> tuple[str, int, tuple[int, ...]]:
    wage, hours, days = (int(x) for x in rng.integers(2, scale + 1, 3))
    spent = int(rng.integers(1, wage * hours * days))
    question = (
        f"{name} earns {wage} dollars an hour and works {hours} hours a day for {days} days. "
        f"{name} then spends {spent} dollars. How many dollars does {name} have left?"
    )
    return question, wage * hours * days - spent, (wage, hours, days, spent)


WORD_TEMPLATES: dict[str, _Template] = {
    "buy_and_give": _buy_and_give,
    "change": _change,
    "two_legs": _two_legs,
    "pages_left": _pages_left,
    "share_equally": _share_equally,
    "savings": _savings,
}


@dataclass(frozen=True)
class WordProblemGenerator:
    """Multi-step word problems (two to four operations) with exact integer answers.

    Six templates (buying and giving away, change, distance over two legs, pages left, sharing
    equally, savings); the numbers are drawn from ``2..scale``, and every answer is a non-negative
    integer.
    """

    scale: int = 12
    """Largest drawn number; larger means harder arithmetic."""
    templates: tuple[str, ...] = tuple(WORD_TEMPLATES)
    """Template names to draw from (keys of :data:`WORD_TEMPLATES`)."""
    name: str = "word"
    """Prefix of the prompt ids."""

    def __post_init__(self) -> None:
        if self.scale < 2:
            raise ValueError(f"scale must be >= 2; got {self.scale}.")
        bad = [t for t in self.templates if t not in WORD_TEMPLATES]
        if not self.templates or bad:
            raise ValueError(
                f"templates must be a non-empty subset of {sorted(WORD_TEMPLATES)}; got {self.templates}."
            )

    def sample(self, rng: np.random.Generator) -> MathTask:
        template = self.templates[int(rng.integers(len(self.templates)))]
        name = _NAMES[int(rng.integers(len(_NAMES)))]
        item = _ITEMS[int(rng.integers(len(_ITEMS)))]
        question, answer, numbers = WORD_TEMPLATES[template](rng, self.scale, name, item)
        return MathTask(
            question=question,
            answer=str(answer),
            prompt_id=f"{self.name}:{template}:{name}:{item}:{','.join(map(str, numbers))}",
            metadata={"template": template, "numbers": numbers},
        )
