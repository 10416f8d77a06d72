"""Validation of typed settings: one message format, every problem at once.

Each setting is declared once, as a field of one dataclass (``EnvRunnerSpec``, ``LearnerSpec``, an
algorithm's loss or its own settings), and checked once, in that dataclass's ``__post_init__``, with a
``Checks``: every failed check adds ``"<field>: expected <what>, got <actual>. Fix: <how>"`` and
``done()`` raises one ``SpecError`` that lists them all. An algorithm config (RLlib's
``AlgorithmConfig``) builds its parts and collects their problems before it raises its own error.

Field metadata (``setting(...)``) says where a setting belongs in such a config:

- ``section``: the builder method that sets it (RLlib's sections: ``environment``, ``env_runners``,
  ``learners``, ``training``, ``evaluation``, ``reporting``, ``checkpointing``, ``debugging``,
  ``resources``); a spec gives its own default section.
- ``derived``: not a setting of the config at all, but filled in when the config builds the spec
  (e.g. the learner's sampling temperature is the env runners' one); the text says from what.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

__all__ = ["Checks", "SpecError", "is_int", "is_number", "setting"]

SECTION = "section"
DERIVED = "derived"


class SpecError(ValueError):
    """Invalid settings of one spec; ``problems`` holds one message per setting."""

    def __init__(self, owner: str, problems: Sequence[str]) -> None:
        self.owner = owner
        self.problems = list(problems)
        super().__init__(f"Invalid {owner}:" + "".join(f"\n  - {problem}" for problem in self.problems))


class Checks:
    """Collects the problems of one spec's ``__post_init__``; ``done()`` raises them together."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.problems: list[str] = []

    def expect(self, ok: bool, name: str, expected: str, actual: Any, fix: str) -> bool:
        """Record ``name: expected ..., got .... Fix: ...`` unless ``ok``; returns ``ok``."""
        if not ok:
            self.problems.append(f"{name}: expected {expected}, got {actual!r}. Fix: {fix}")
        return bool(ok)

    def integers(self, spec: Any, names: Sequence[str], minimum: int) -> None:
        """Each named field of ``spec`` an int >= ``minimum`` (0 or 1)."""
        fix = "a positive integer" if minimum >= 1 else "0 or more"
        for name in names:
            value = getattr(spec, name)
            self.expect(is_int(value) and value >= minimum, name, f"an integer >= {minimum}", value,
                        f"set {name} to {fix}")

    def numbers(self, spec: Any, names: Sequence[str], *, positive: bool) -> None:
        """Each named field of ``spec`` a finite number > 0 (``positive``) or >= 0."""
        for name in names:
            value = getattr(spec, name)
            ok = is_number(value) and (value > 0 if positive else value >= 0)
            self.expect(ok, name, f"a finite number {'>' if positive else '>='} 0", value,
                        f"set {name} to {'a positive number' if positive else '0 or a positive number'}")

    def gpus(self, spec: Any, name: str) -> None:
        """A Ray GPU request: a number >= 0, fractional only up to 1."""
        self.numbers(spec, [name], positive=False)
        value = getattr(spec, name)
        if is_number(value) and value > 1 and not float(value).is_integer():
            self.expect(False, name, "a fraction <= 1 or a whole number", value, "use e.g. 0.5, 1 or 2")

    def add(self, problem: str) -> None:
        """A problem phrased by the caller (one that compares settings, say)."""
        self.problems.append(problem)

    def done(self) -> None:
        if self.problems:
            raise SpecError(self.owner, self.problems)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def setting(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    section: str | None = None,
    derived: str | None = None,
) -> Any:
    """A dataclass field with the metadata above (``section``, ``derived``)."""
    metadata = {}
    if section is not None:
        metadata[SECTION] = section
    if derived is not None:
        metadata[DERIVED] = derived
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)
