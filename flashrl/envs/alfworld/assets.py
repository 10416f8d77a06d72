"""What the ``alfworld`` package ships for writing games: its PDDL domain, its text grammar, the
object/receptacle catalogue of ``alfworld.gen.constants`` and the 120 AI2-THOR scene layouts.

Everything here is read from the installed package (nothing is downloaded) and returned in a sorted,
deterministic order: Python sets iterate in a per-process order, and the generator must write the
same game for the same seed in every process.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

#: Scene number ranges of each room type (AI2-THOR floor plans), as in ``alfworld.gen.constants``.
ROOM_TYPES: tuple[str, ...] = ("Kitchen", "LivingRoom", "Bedroom", "Bathroom")

#: Receptacle classes that only wrap a basin: the basin (``Sink|...|SinkBasin``) is the receptacle.
_WRAPPER_CLASSES = frozenset({"Sink", "Bathtub"})


def require_alfworld() -> None:
    """Import ``alfworld`` and ``textworld`` or raise an error that says how to install them."""
    try:
        import alfworld.gen.constants  # noqa: F401
        import fast_downward  # noqa: F401
        import textworld  # noqa: F401
        from textworld.envs import PddlEnv  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "The ALFWorld environment needs the `alfworld` and `textworld[pddl]` packages "
            f"({exc}). Install them with: pip install 'alfworld==0.4.2' 'textworld[pddl]' "
            "(or pip install 'flashrl[alfworld]')."
        ) from exc


@dataclass(frozen=True)
class ReceptacleInstance:
    """A static receptacle of a scene: its AI2-THOR id, class and where the agent stands to use it."""

    object_id: str
    """AI2-THOR id, e.g. ``Cabinet|+00.68|+00.50|-02.20`` or ``Sink|-01.90|+00.97|-01.50|SinkBasin``."""
    cls: str
    """Receptacle class, e.g. ``Cabinet`` or ``SinkBasin``."""
    location: tuple[int, int, int, int]
    """Agent pose in front of it: grid x, grid z, rotation / 90, camera horizon."""


@dataclass(frozen=True)
class Scene:
    """One AI2-THOR floor plan: its number, room type, object classes and receptacle instances."""

    number: int
    """Floor plan number (1-30 kitchens, 201-230 living rooms, 301-330 bedrooms, 401-430 bathrooms)."""
    room_type: str
    """One of :data:`ROOM_TYPES`."""
    classes: frozenset[str]
    """Every object and receptacle class present in the scene."""
    receptacles: tuple[ReceptacleInstance, ...]
    """Static receptacles with a known pose, sorted by id."""

    @property
    def name(self) -> str:
        return f"FloorPlan{self.number}"


@dataclass(frozen=True)
class Catalog:
    """The object model of ALFRED, as ``alfworld.gen.constants`` defines it (sorted tuples)."""

    can_contain: dict[str, tuple[str, ...]]
    """Static receptacle class -> object classes it can hold."""
    pickupable: tuple[str, ...]
    """Object classes an agent can pick up (every class some receptacle can hold, unsliced)."""
    movable_receptacles: tuple[str, ...]
    """Pickupable classes that can hold other objects (bowl, mug, ...)."""
    openable: tuple[str, ...]
    """Receptacle classes that must be opened before use (fridge, cabinet, ...)."""
    cleanable: tuple[str, ...]
    heatable: tuple[str, ...]
    coolable: tuple[str, ...]
    toggleable: tuple[str, ...]
    sliceable: tuple[str, ...]
    train_scenes: tuple[int, ...]
    """Scene numbers ALFRED trains on."""
    test_scenes: tuple[int, ...]
    """Scene numbers ALFRED holds out (its unseen scenes)."""
    goal_rooms: dict[str, tuple[str, ...]]
    """Task type -> room types ALFRED allows it in."""


def _alfworld_dir() -> Path:
    require_alfworld()
    import alfworld

    return Path(alfworld.__file__).resolve().parent


@functools.lru_cache(maxsize=1)
def pddl_domain() -> str:
    """The text of the package's ``alfworld/data/alfred.pddl``."""
    return (_alfworld_dir() / "data" / "alfred.pddl").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def grammar_template() -> str:
    """The text of the package's ``alfworld/data/alfred.twl2`` (its goal is ``UNKNOWN GOAL``)."""
    text = (_alfworld_dir() / "data" / "alfred.twl2").read_text(encoding="utf-8")
    if "UNKNOWN GOAL" not in text:
        raise RuntimeError(
            "alfworld's alfred.twl2 has no 'UNKNOWN GOAL' placeholder; expected alfworld==0.4.2."
        )
    return text


@functools.lru_cache(maxsize=1)
def catalog() -> Catalog:
    """Read ``alfworld.gen.constants`` into a :class:`Catalog`."""
    require_alfworld()
    import alfworld.gen.constants as c

    movable = set(c.MOVABLE_RECEPTACLES)
    can_contain = {
        cls: tuple(sorted(o for o in objs if not o.endswith("Sliced")))
        for cls, objs in c.VAL_RECEPTACLE_OBJECTS.items()
        if cls not in movable
    }
    held = set().union(*c.VAL_RECEPTACLE_OBJECTS.values())
    pickupable = sorted(o for o in held if not o.endswith("Sliced") and o not in can_contain)
    actions = c.VAL_ACTION_OBJECTS
    return Catalog(
        can_contain=dict(sorted(can_contain.items())),
        pickupable=tuple(pickupable),
        movable_receptacles=tuple(sorted(movable)),
        openable=tuple(sorted(c.OPENABLE_CLASS_SET)),
        cleanable=tuple(sorted(actions["Cleanable"])),
        heatable=tuple(sorted(actions["Heatable"])),
        coolable=tuple(sorted(actions["Coolable"])),
        toggleable=tuple(sorted(actions["Toggleable"])),
        sliceable=tuple(sorted(actions["Sliceable"])),
        train_scenes=tuple(sorted(c.TRAIN_SCENE_NUMBERS)),
        test_scenes=tuple(sorted(c.TEST_SCENE_NUMBERS)),
        goal_rooms={goal: tuple(sorted(rooms)) for goal, rooms in sorted(c.GOALS_VALID.items())},
    )


def room_type(number: int) -> str:
    """The room type of floor plan ``number``."""
    kind = {0: "Kitchen", 2: "LivingRoom", 3: "Bedroom", 4: "Bathroom"}.get(number // 100)
    if kind is None:
        raise ValueError(
            f"Floor plan {number} is not an AI2-THOR scene; expected 1-30, 201-230, 301-330 or 401-430."
        )
    return kind


def _receptacle_class(object_id: str) -> str:
    parts = object_id.split("|")
    # A basin id carries its own class last: "Sink|x|y|z|SinkBasin".
    return parts[-1] if parts[0] in _WRAPPER_CLASSES and len(parts) == 5 else parts[0]


@functools.cache
def scene(number: int) -> Scene:
    """Load floor plan ``number`` from ``alfworld/gen/layouts/``."""
    layouts = _alfworld_dir() / "gen" / "layouts"
    objects_path = layouts / f"FloorPlan{number}-objects.json"
    poses_path = layouts / f"FloorPlan{number}-openable.json"
    if not objects_path.exists() or not poses_path.exists():
        raise ValueError(f"alfworld ships no layout for FloorPlan{number} ({objects_path} missing).")
    classes = frozenset(json.loads(objects_path.read_text(encoding="utf-8")))
    poses = json.loads(poses_path.read_text(encoding="utf-8"))
    receptacles = []
    known = catalog().can_contain
    for object_id in sorted(poses):
        cls = _receptacle_class(object_id)
        if cls not in known:
            continue
        x, z, rotation, horizon = poses[object_id]
        location = (round(x / 0.25), round(z / 0.25), round(rotation / 90) % 4, round(horizon))
        receptacles.append(ReceptacleInstance(object_id, cls, location))
    return Scene(number, room_type(number), classes, tuple(receptacles))


def scenes_for(numbers: tuple[int, ...]) -> tuple[Scene, ...]:
    """The scenes with the given numbers that alfworld ships a layout for."""
    layouts = _alfworld_dir() / "gen" / "layouts"
    return tuple(scene(n) for n in numbers if (layouts / f"FloorPlan{n}-objects.json").exists())
