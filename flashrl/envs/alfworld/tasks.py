"""ALFWorld's six task types: their goal PDDL and sentences, from ``alfworld.gen.goal_library``."""

from __future__ import annotations

import random
from dataclasses import dataclass

#: The six ALFWorld task types, numbered as ALFWorld numbers them (1-6).
TASK_TYPES: tuple[str, ...] = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)

#: Short names accepted wherever a task type is expected.
TASK_ALIASES: dict[str, str] = {
    "pick": "pick_and_place_simple",
    "look": "look_at_obj_in_light",
    "examine": "look_at_obj_in_light",
    "clean": "pick_clean_then_place_in_recep",
    "heat": "pick_heat_then_place_in_recep",
    "cool": "pick_cool_then_place_in_recep",
    "pick_two": "pick_two_obj_and_place",
}

#: The appliance class a state-change task needs in the scene.
APPLIANCE: dict[str, str] = {
    "pick_clean_then_place_in_recep": "SinkBasin",
    "pick_heat_then_place_in_recep": "Microwave",
    "pick_cool_then_place_in_recep": "Fridge",
}


def resolve_task_type(name: str | int) -> str:
    """Map a task type name, alias or ALFWorld number (1-6) to its canonical name."""
    if isinstance(name, int) and not isinstance(name, bool):
        if not 1 <= name <= len(TASK_TYPES):
            raise ValueError(f"ALFWorld task type numbers are 1-{len(TASK_TYPES)}; got {name}.")
        return TASK_TYPES[name - 1]
    if isinstance(name, str):
        if name in TASK_TYPES:
            return name
        if name in TASK_ALIASES:
            return TASK_ALIASES[name]
    raise ValueError(
        f"Unknown ALFWorld task type {name!r}; expected one of {list(TASK_TYPES)}, an alias in "
        f"{sorted(TASK_ALIASES)} or a number 1-{len(TASK_TYPES)}."
    )


@dataclass(frozen=True)
class TaskSpec:
    """What one game asks for, in ALFRED's ``pddl_params`` terms (class names, e.g. ``Apple``)."""

    task_type: str
    """One of :data:`TASK_TYPES`."""
    object_target: str
    """Class of the object to handle."""
    parent_target: str = ""
    """Class of the receptacle to put it in ("" for look_at_obj_in_light)."""
    toggle_target: str = ""
    """Lamp class for look_at_obj_in_light ("" otherwise)."""

    def pddl_params(self) -> dict[str, object]:
        """The ``pddl_params`` entry of ALFWorld's ``traj_data.json``."""
        return {
            "object_target": self.object_target,
            "parent_target": self.parent_target,
            "toggle_target": self.toggle_target,
            "mrecep_target": "",
            "object_sliced": False,
        }

    def goal_pddl(self) -> str:
        """The ``(:goal ...)`` block from ``alfworld.gen.goal_library`` (without its trailing ``)``)."""
        from alfworld.gen.goal_library import gdict

        text = gdict[self.task_type]["pddl"].format(
            obj=self.object_target, recep=self.parent_target, toggle=self.toggle_target, mrecep=""
        )
        text = text.replace("#", "-").strip()
        # The library's goals also close the enclosing `(define ...`; the problem writer closes it.
        if not text.endswith(")"):
            raise RuntimeError(f"Unexpected goal text in alfworld's goal library: {text[-40:]!r}")
        return text[:-1].rstrip()

    def sentence(self, rng: random.Random) -> str:
        """A task sentence from the goal library's templates, as ALFWorld fills them in."""
        from alfworld.gen.goal_library import gdict

        template = rng.choice(gdict[self.task_type]["templates"])
        return template.format(
            obj=self.object_target.lower(),
            recep=self.parent_target.lower(),
            toggle=self.toggle_target.lower(),
            mrecep="",
        )
