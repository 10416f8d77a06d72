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
- ``code``: the setting may hold code, not only data: an object, a ``"module:name"`` path, a command
  or keyword arguments that another library reads unchecked. The value says how its code is found
  (one of `CODE_KINDS`); a checkpoint's stored config never brings such a value back unless the user
  passes it again or trusts the checkpoint (``flashrl.checkpoints.stored_code``). A setting whose type
  admits objects must say ``code=`` (a test enumerates every setting), ``code=False`` for plain data.

A setting's simple bounds are declared with it too, and ``Checks.fields`` checks them all in one place
(a spec's ``__post_init__`` calls it first): ``integer=True``, ``ge=`` / ``gt=`` / ``le=`` / ``lt=``,
``choices=(...)``, ``optional=True`` (None allowed too). The message's expected text follows from
them (``setting(16, integer=True, ge=1)``: "expected an integer >= 1"); ``fix=`` gives the fix when
the generated one ("set <field> to a positive integer") would not help. Checks that compare several
settings, or look a value up in a registry, stay code in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CODE_KINDS", "Bounds", "Checks", "SpecError", "is_int", "is_number", "setting"]

SECTION = "section"
DERIVED = "derived"
BOUNDS = "bounds"
CODE = "code"
CODE_KINDS = ("path", "import", "env_config", "env_configs", "engine_options", "passthrough")
"""How a code-bearing setting's value names code (``flashrl.checkpoints.stored_code`` reads it):

- ``path``: any ``"module:name"`` string in it (names and ids, without a colon, are data);
- ``import``: any non-empty string (an import path, also written ``"package.module.Class"``);
- ``env_config``: keyword arguments of the env: those its class declares as code (``code_arguments``,
  ``command_arguments``) and any ``"module:name"`` string;
- ``env_configs``: a dict of name -> such keyword arguments;
- ``engine_options``: the engine's ``engine_args``, handed to vLLM unread (it imports class paths, and
  ``trust_remote_code`` runs a model folder's code);
- ``passthrough``: keyword arguments handed unread to another library (a tracker's ``init``)."""
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
"""Resources Ray asks for through their own arguments (num_cpus, num_gpus, ...), never as custom ones."""


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

    def fields(self, spec: Any) -> None:
        """Each field of ``spec`` declared with bounds (``setting(..., ge=0)``) within them (field order)."""
        for f in dataclasses.fields(spec):
            bounds = f.metadata.get(BOUNDS)
            if bounds is not None:
                value = getattr(spec, f.name)
                self.expect(bounds.allows(value), f.name, bounds.expected(), value, bounds.fix_for(f.name))

    def gpus(self, spec: Any, name: str) -> None:
        """A Ray GPU request (a number >= 0, declared with the field): fractional only up to 1."""
        value = getattr(spec, name)
        if is_number(value) and value > 1 and not float(value).is_integer():
            self.expect(False, name, "a fraction <= 1 or a whole number", value, "use e.g. 0.5, 1 or 2")

    def custom_resources(self, spec: Any, name: str) -> None:
        """Ray custom resources an actor asks for (``custom_resources_per_*``): names Ray takes as custom
        resources (not CPU, GPU, memory or object_store_memory, which have their own settings), amounts >= 0."""
        value = getattr(spec, name)
        ok = isinstance(value, Mapping) and all(
            isinstance(k, str) and k and k not in RAY_BUILTIN_RESOURCES and is_number(v) and v >= 0
            for k, v in value.items()
        )
        self.expect(ok, name, "a dict of Ray custom resource name (not CPU, GPU, memory) -> amount >= 0", value,
                    "e.g. {'rollout_node': 1} with nodes started with ray start --resources='{\"rollout_node\": 4}'")

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


@dataclass(frozen=True)
class Bounds:
    """The simple bounds of one setting (``setting(..., ge=0)``); ``Checks.fields`` applies them."""

    integer: bool = False
    """An int (not a bool); otherwise a number, an int or a float (not a bool, never NaN)."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] | None = None
    """The allowed values (instead of a number)."""
    optional: bool | str = False
    """None is allowed too; a str says what None means ("None (auto) or ...")."""
    finite: bool = True
    """A number with a single bound must be finite; False lets inf through (e.g. an 'off' value)."""
    note: str | None = None
    """Said after the expected value, in parentheses."""
    fix: str | None = None
    """The message's fix; None = "set <field> to <the expected value>"."""

    def __post_init__(self) -> None:
        if self.ge is not None and self.gt is not None or self.le is not None and self.lt is not None:
            raise TypeError("setting(): give at most one lower bound (ge, gt) and one upper bound (le, lt)")
        if self.choices is not None and (self.integer or self._limits()):
            raise TypeError("setting(): choices= excludes integer= and the bounds ge, gt, le, lt")

    def _limits(self) -> list[tuple[str, float]]:
        limits = ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
        return [(op, v) for op, v in limits if v is not None]

    def allows(self, value: Any) -> bool:
        if value is None:
            return bool(self.optional)
        if self.choices is not None:
            return value in self.choices
        if self.integer:
            ok = is_int(value)
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
            ok = ok and (math.isfinite(value) or not self.finite)
        compare = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}
        return ok and all(compare[op](value, limit) for op, limit in self._limits())

    def expected(self) -> str:
        """What the message says was expected, e.g. 'None or an integer >= 1'."""
        limits = self._limits()
        kind = "an integer" if self.integer else "a number"
        if self.choices is not None:
            text = f"one of {self.choices!r}"
        elif len(limits) == 2:
            (low, a), (high, b) = limits
            text = f"{kind} in {'[' if low == '>=' else '('}{a}, {b}{']' if high == '<=' else ')'}"
        else:
            finite = not self.integer and self.finite and limits
            text = " ".join(["a finite number" if finite else kind, *(f"{op} {v}" for op, v in limits)])
        if self.optional:
            text = f"None{'' if self.optional is True else f' ({self.optional})'} or {text}"
        return f"{text} ({self.note})" if self.note else text

    def fix_for(self, name: str) -> str:
        if self.fix is not None:
            return self.fix
        limits = self._limits()
        plain = _PLAIN_FIXES.get((self.integer, *limits[0])) if len(limits) == 1 else None
        return f"set {name} to {plain if plain and not (self.optional or self.note) else self.expected()}"


_PLAIN_FIXES = {(True, ">=", 1): "a positive integer", (True, ">=", 0): "0 or more",
                (False, ">", 0): "a positive number", (False, ">=", 0): "0 or a positive number"}
"""(integer, bound, limit) -> the fix of a single lower bound, in words."""


def setting(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    section: str | None = None,
    derived: str | None = None,
    integer: bool = False,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: Sequence[Any] | None = None,
    optional: bool | str = False,
    finite: bool = True,
    note: str | None = None,
    fix: str | None = None,
    code: str | bool | None = None,
) -> Any:
    """A dataclass field with the metadata above: ``section``, ``derived``, ``code`` and the bounds (`Bounds`)."""
    metadata: dict[str, Any] = {}
    if section is not None:
        metadata[SECTION] = section
    if derived is not None:
        metadata[DERIVED] = derived
    if code is not None:
        if code is not False and code not in CODE_KINDS:
            raise TypeError(f"setting(): code= expected one of {CODE_KINDS} or False (plain data), got {code!r}")
        metadata[CODE] = code
    if integer or choices is not None or any(limit is not None for limit in (ge, gt, le, lt)):
        metadata[BOUNDS] = Bounds(integer=integer, ge=ge, gt=gt, le=le, lt=lt,
                                  choices=None if choices is None else tuple(choices),
                                  optional=optional, finite=finite, note=note, fix=fix)
    elif optional or note or fix:
        raise TypeError("setting(): optional=, note= and fix= qualify a bound; add integer=, choices= or one")
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)
