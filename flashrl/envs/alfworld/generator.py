"""Offline generator of ALFWorld games for the six task types, from the ``alfworld`` package alone.

A game is what ALFWorld's own ``alfworld-generate`` writes: a ``game.tw-pddl`` JSON file (the
package's PDDL domain, its grammar with the task sentence filled in, a PDDL problem, ``solvable`` and
a ``walkthrough``) and a ``traj_data.json`` beside it (``task_type``, ``pddl_params``, ``scene``).
Problems are built from a real AI2-THOR floor plan of ``alfworld/gen/layouts/`` (receptacle ids and
poses as ALFRED names them) with a few objects placed where ALFRED's ``canContain`` table allows,
scaled down (``max_receptacles``, ``num_distractors``) so that the planner stays fast.

Every game is a pure function of ``(task_type, split, seed)``: the same seed writes byte-identical
files in any process. Splits follow ALFRED: ``train`` and ``valid_seen`` use its training floor plans
(with disjoint seeds), ``valid_unseen`` its held-out floor plans. The planner's walkthrough is computed
once here, replayed through the engine to check that it wins, and stored in the game file.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashrl.envs.alfworld import assets
from flashrl.envs.alfworld.engine import TextWorldGame
from flashrl.envs.alfworld.tasks import APPLIANCE, TASK_TYPES, TaskSpec, resolve_task_type

#: Version of the generation procedure; part of cache paths, bump when output changes.
GENERATOR_VERSION = 1

#: Furniture a desk lamp may stand on.
_LAMP_FURNITURE = frozenset(
    {"Desk", "SideTable", "Dresser", "DiningTable", "CoffeeTable", "Shelf", "TVStand", "CounterTop"}
)

#: Splits and the ALFRED floor plans each draws from.
SPLITS: tuple[str, ...] = ("train", "valid_seen", "valid_unseen")


@dataclass(frozen=True)
class GeneratorConfig:
    """Size limits of generated scenes (small scenes keep the planner and the prompt short)."""

    max_receptacles: int = 10
    """Receptacles in a scene, at most (the floor plan's own ids; ALFRED scenes have up to ~40)."""
    num_distractors: int = 4
    """Objects besides the task's own, placed at random where they fit."""
    max_walkthrough_steps: int = 30
    """Reject (and redraw) a game whose planner walkthrough is longer than this."""
    max_attempts: int = 50
    """Draws of scene and task before giving up on a seed."""

    def __post_init__(self) -> None:
        if self.max_receptacles < 4:
            raise ValueError(
                f"max_receptacles must be >= 4 (a task needs up to 4); got {self.max_receptacles}."
            )
        if self.num_distractors < 0:
            raise ValueError(f"num_distractors must be >= 0; got {self.num_distractors}.")
        if self.max_walkthrough_steps < 2:
            raise ValueError(f"max_walkthrough_steps must be >= 2; got {self.max_walkthrough_steps}.")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1; got {self.max_attempts}.")

    def key(self) -> str:
        """A short stable digest of the config, for cache paths."""
        text = json.dumps(
            [self.max_receptacles, self.num_distractors, self.max_walkthrough_steps, self.max_attempts]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class GeneratedGame:
    """One generated game, ready to be written as ALFWorld files."""

    name: str
    """Folder name: ``<task_type>-<object>-<toggle>-<parent>-<scene>-<seed>``."""
    spec: TaskSpec
    scene: int
    """AI2-THOR floor plan number."""
    game: dict[str, Any]
    """The ``game.tw-pddl`` content."""
    traj_data: dict[str, Any]
    """The ``traj_data.json`` content."""

    @property
    def walkthrough(self) -> list[str]:
        return list(self.game["walkthrough"])

    def write(self, folder: str | os.PathLike[str]) -> Path:
        """Write ``game.tw-pddl`` and ``traj_data.json`` into ``folder`` (atomically); return the game path."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(folder / "traj_data.json", self.traj_data)
        return _write_json_atomic(folder / "game.tw-pddl", self.game)


@dataclass
class _Layout:
    spec: TaskSpec
    receptacles: list[assets.ReceptacleInstance]
    objects: dict[str, str] = field(default_factory=dict)  # object id -> receptacle id
    classes: dict[str, str] = field(default_factory=dict)  # object id -> class


def derive_seed(seed: int, split: str, index: int) -> int:
    """The seed of game ``index`` of ``split`` in a collection generated with ``seed`` (stable)."""
    digest = hashlib.sha256(f"flashrl-alfworld/{seed}/{split}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def split_scenes(split: str) -> tuple[int, ...]:
    """ALFRED floor plans a split draws from."""
    cat = assets.catalog()
    if split in ("train", "valid_seen"):
        return cat.train_scenes
    if split == "valid_unseen":
        return cat.test_scenes
    raise ValueError(f"Unknown split {split!r}; expected one of {list(SPLITS)}.")


def generate_game(
    task_type: str | int, *, seed: int, split: str = "train", config: GeneratorConfig | None = None
) -> GeneratedGame:
    """Generate one solvable game of ``task_type`` (deterministic in ``task_type, seed, split, config``).

    Raises:
        RuntimeError: no solvable game was found in ``config.max_attempts`` draws.
    """
    task_type = resolve_task_type(task_type)
    config = config or GeneratorConfig()
    cat = assets.catalog()
    rooms = cat.goal_rooms[task_type]
    scenes = [s for s in assets.scenes_for(split_scenes(split)) if s.room_type in rooms]
    rng = random.Random(seed)
    problems: list[str] = []
    for attempt in range(config.max_attempts):
        scene = rng.choice(scenes)
        layout = _sample_layout(task_type, scene, rng, config)
        if layout is None:
            problems.append(f"{scene.name}: no {task_type} task fits")
            continue
        name = (
            f"{task_type}-{layout.spec.object_target}-{layout.spec.toggle_target or 'None'}-"
            f"{layout.spec.parent_target or 'None'}-{scene.number}-{seed % 10**8:08d}"
        )
        problem = _write_problem(name, layout, scene, rng)
        grammar = assets.grammar_template().replace("UNKNOWN GOAL", layout.spec.sentence(rng))
        game = {
            "pddl_domain": assets.pddl_domain(),
            "grammar": grammar,
            "pddl_problem": problem,
            "solvable": False,
            "walkthrough": None,
        }
        plan, reason = _plan_and_check(game, config)
        if reason:
            problems.append(f"{scene.name}: {reason}")
            continue
        game["solvable"] = True
        game["walkthrough"] = plan
        traj_data = {
            "task_type": task_type,
            "task_id": name,
            "pddl_params": layout.spec.pddl_params(),
            "scene": {"floor_plan": scene.name, "scene_num": scene.number},
            "generator": {
                "name": "flashrl",
                "version": GENERATOR_VERSION,
                "seed": seed,
                "split": split,
                "attempt": attempt,
            },
        }
        return GeneratedGame(name=name, spec=layout.spec, scene=scene.number, game=game, traj_data=traj_data)
    raise RuntimeError(
        f"No solvable {task_type} game for seed {seed} in split {split!r} after {config.max_attempts} "
        f"draws (last problems: {problems[-3:]}). Raise max_attempts or max_walkthrough_steps."
    )


def _plan_and_check(game: dict[str, Any], config: GeneratorConfig) -> tuple[list[str], str]:
    """Plan ``game`` and replay the plan through the engine: ``(plan, why it is not valid or "")``."""
    engine = TextWorldGame(plan=True)
    try:
        engine.load(game)
        state = engine.reset()
        plan = list(engine.walkthrough or [])
        if state.won:
            return plan, "the goal already holds at the start"
        if not plan:
            return plan, "the planner found no plan"
        if len(plan) > config.max_walkthrough_steps:
            return plan, f"plan of {len(plan)} steps is longer than {config.max_walkthrough_steps}"
        for i, command in enumerate(plan):
            state = engine.step(command)
            if not state.valid:
                return plan, f"plan step {i} {command!r} is not admissible"
            if state.won and i < len(plan) - 1:
                return plan, f"won before the plan's end (step {i})"
        return plan, "" if state.won else "the plan does not win"
    finally:
        engine.close()


# --------------------------------------------------------------------------------------- layouts
def _sample_layout(
    task_type: str, scene: assets.Scene, rng: random.Random, config: GeneratorConfig
) -> _Layout | None:
    cat = assets.catalog()
    by_class: dict[str, list[assets.ReceptacleInstance]] = {}
    for r in scene.receptacles:
        by_class.setdefault(r.cls, []).append(r)
    present = [c for c in cat.pickupable if c in scene.classes]
    appliance = APPLIANCE.get(task_type)
    if appliance is not None and appliance not in by_class:
        return None

    if task_type == "look_at_obj_in_light":
        lamps = [c for c in cat.toggleable if c in scene.classes]
        if not lamps or not present:
            return None
        lamp_cls = rng.choice(lamps)
        # A desk lamp stands on furniture with a top; a floor lamp next to any open receptacle.
        hosts = [
            r
            for r in scene.receptacles
            if r.cls not in cat.openable and (lamp_cls != "DeskLamp" or r.cls in _LAMP_FURNITURE)
        ]
        if not hosts:
            return None
        obj = rng.choice(present)
        starts = [c for c in sorted(by_class) if obj in cat.can_contain[c]]
        if not starts:
            return None
        spec = TaskSpec(task_type, obj, toggle_target=lamp_cls)
        required = [rng.choice(hosts), rng.choice(by_class[rng.choice(starts)])]
        layout = _fill_receptacles(spec, scene, required, rng, config)
        lamp_id = _new_object_id(lamp_cls, layout, rng)
        layout.objects[lamp_id], layout.classes[lamp_id] = required[0].object_id, lamp_cls
        start_options = [r for r in layout.receptacles if obj in cat.can_contain[r.cls]]
        _place(obj, 1, start_options, layout, rng)
    else:
        candidates = present
        if task_type in APPLIANCE:
            prop = {"SinkBasin": cat.cleanable, "Microwave": cat.heatable, "Fridge": cat.coolable}[appliance]
            candidates = [c for c in present if c in prop]
        pairs = []
        for obj in candidates:
            parents = [c for c in sorted(by_class) if obj in cat.can_contain[c] and c != appliance]
            for parent in parents:
                if any(obj in cat.can_contain[c] for c in by_class if c not in (parent, appliance)):
                    pairs.append((obj, parent))
        if not pairs:
            return None
        obj, parent = rng.choice(pairs)
        spec = TaskSpec(task_type, obj, parent_target=parent)
        # The object starts away from the goal receptacle and from the appliance it must use.
        starts = [
            r for r in scene.receptacles if r.cls not in (parent, appliance) and obj in cat.can_contain[r.cls]
        ]
        required = [rng.choice(by_class[parent]), rng.choice(starts)]
        if appliance is not None:
            required.append(rng.choice(by_class[appliance]))
        count = 2 if task_type == "pick_two_obj_and_place" else 1
        if count == 2:
            required.append(rng.choice(starts))
        layout = _fill_receptacles(spec, scene, required, rng, config)
        start_options = [
            r
            for r in layout.receptacles
            if r.cls not in (parent, appliance) and obj in cat.can_contain[r.cls]
        ]
        _place(obj, count, start_options, layout, rng)

    distractors = [c for c in present if c != spec.object_target]
    for _ in range(config.num_distractors if distractors else 0):
        cls = rng.choice(distractors)
        options = [r for r in layout.receptacles if cls in cat.can_contain[r.cls]]
        if options:
            _place(cls, 1, options, layout, rng)
    return layout


def _fill_receptacles(
    spec: TaskSpec,
    scene: assets.Scene,
    required: list[assets.ReceptacleInstance],
    rng: random.Random,
    config: GeneratorConfig,
) -> _Layout:
    chosen = {r.object_id: r for r in required}
    others = [r for r in scene.receptacles if r.object_id not in chosen]
    rng.shuffle(others)
    for r in others[: max(0, config.max_receptacles - len(chosen))]:
        chosen[r.object_id] = r
    return _Layout(spec=spec, receptacles=sorted(chosen.values(), key=lambda r: r.object_id))


def _place(
    cls: str, count: int, options: list[assets.ReceptacleInstance], layout: _Layout, rng: random.Random
) -> None:
    for _ in range(count):
        object_id = _new_object_id(cls, layout, rng)
        layout.objects[object_id] = rng.choice(options).object_id
        layout.classes[object_id] = cls


def _new_object_id(cls: str, layout: _Layout, rng: random.Random) -> str:
    while True:
        x, y, z = (rng.uniform(-3.0, 3.0) for _ in range(3))
        object_id = f"{cls}|{x:+06.2f}|{abs(y):+06.2f}|{z:+06.2f}"
        if object_id not in layout.objects:
            return object_id


# --------------------------------------------------------------------------------------- PDDL
def mangle(name: str) -> str:
    """An AI2-THOR id as a PDDL name, the way ALFWorld writes them (``|`` -> ``_bar_``, ...)."""
    for old, new in (("-", "_minus_"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        name = name.replace(old, new)
    return name


def _location_name(location: tuple[int, int, int, int]) -> str:
    return mangle("loc|{}|{}|{}|{}".format(*location))


def _write_problem(name: str, layout: _Layout, scene: assets.Scene, rng: random.Random) -> str:
    cat = assets.catalog()
    # Every receptacle gets its own location (ALFRED poses sometimes coincide).
    locations: dict[str, tuple[int, int, int, int]] = {}
    taken: set[tuple[int, int, int, int]] = set()
    for r in layout.receptacles:
        loc = r.location
        while loc in taken:
            loc = (loc[0] + 1, loc[1], loc[2], loc[3])
        taken.add(loc)
        locations[r.object_id] = loc
    start = (rng.randint(-20, 20), rng.randint(-20, 20), rng.randint(0, 3), 30)
    while start in taken:
        start = (start[0] + 1, start[1], start[2], start[3])

    receptacle_classes = sorted({r.cls for r in layout.receptacles} | {"SinkBasin", "Microwave", "Fridge"})
    object_classes = sorted(set(layout.classes.values()) | {"Knife", "ButterKnife"})
    objects = sorted(layout.objects)
    rec_ids = [r.object_id for r in layout.receptacles]

    decl = ["agent1 - agent"]
    decl += [f"{c}Type - otype" for c in object_classes]
    decl += [f"{c}Type - rtype" for c in receptacle_classes]
    decl += [f"{mangle(o)} - object" for o in objects]
    decl += [f"{mangle(r)} - receptacle" for r in rec_ids]
    decl += [f"{_location_name(loc)} - location" for loc in sorted(set(locations.values()) | {start})]

    init = [f"(atLocation agent1 {_location_name(start)})"]
    for r in layout.receptacles:
        init.append(f"(receptacleType {mangle(r.object_id)} {r.cls}Type)")
        init.append(f"(receptacleAtLocation {mangle(r.object_id)} {_location_name(locations[r.object_id])})")
        if r.cls in cat.openable:
            init.append(f"(openable {mangle(r.object_id)})")
    properties = (
        ("pickupable", cat.pickupable),
        ("isReceptacleObject", cat.movable_receptacles),
        ("cleanable", cat.cleanable),
        ("heatable", cat.heatable),
        ("coolable", cat.coolable),
        ("toggleable", cat.toggleable),
        ("sliceable", cat.sliceable),
    )
    for o in objects:
        cls, holder = layout.classes[o], layout.objects[o]
        init.append(f"(objectType {mangle(o)} {cls}Type)")
        init.append(f"(inReceptacle {mangle(o)} {mangle(holder)})")
        init.append(f"(objectAtLocation {mangle(o)} {_location_name(locations[holder])})")
        init += [f"({pred} {mangle(o)})" for pred, classes in properties if cls in classes]
    for rcls in sorted({r.cls for r in layout.receptacles}):
        init += [
            f"(canContain {rcls}Type {ocls}Type)" for ocls in object_classes if ocls in cat.can_contain[rcls]
        ]

    indent = "\n        "
    return (
        f"(define (problem plan_{name.replace('-', '_')})\n"
        f"    (:domain alfred)\n"
        f"    (:objects{indent}{indent.join(decl)}\n    )\n"
        f"    (:init{indent}{indent.join(init)}\n    )\n"
        f"    {layout.spec.goal_pddl()}\n"
        f")\n"
    )


def _write_json_atomic(path: Path, payload: dict[str, Any]) -> Path:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)
    return path


__all__ = [
    "GENERATOR_VERSION",
    "SPLITS",
    "TASK_TYPES",
    "GeneratedGame",
    "GeneratorConfig",
    "derive_seed",
    "generate_game",
    "mangle",
    "split_scenes",
]
