"""ALFWorld through the real textworld engine, on games written by the offline generator.

One game of each of the six task types is generated once per module (a few seconds each) into a
temporary cache and shared by the tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashrl.envs  # noqa: F401  (registers the ids)
from flashrl.envs.alfworld import (
    TASK_TYPES,
    ALFWorldEnv,
    GeneratorConfig,
    generate_game,
    generated_games,
    official_games,
    parse_command,
)
from flashrl.envs.alfworld.assets import catalog
from flashrl.envs.base import EpisodeEndedError

pytestmark = pytest.mark.alfworld


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(tmp_path_factory.mktemp("alfworld_cache"))
    # One game of each task type, in TASK_TYPES order (game i has type TASK_TYPES[i]).
    generated_games(split="train", num_games=len(TASK_TYPES), seed=0, cache_dir=path)
    return path


@pytest.fixture(scope="module")
def env(cache_dir: Path) -> Iterator[ALFWorldEnv]:
    env = gym.make("flashrl/ALFWorld-v0", num_games=len(TASK_TYPES), seed=0, cache_dir=cache_dir).unwrapped
    assert isinstance(env, ALFWorldEnv)
    yield env
    env.close()


# ------------------------------------------------------------------------------------ playing
@pytest.mark.parametrize("index", range(len(TASK_TYPES)), ids=list(TASK_TYPES))
def test_each_task_type_is_won_with_its_walkthrough(env: ALFWorldEnv, index: int) -> None:
    messages, info = env.reset(options={"game_index": index})
    assert info["task_type"] == TASK_TYPES[index]
    assert info["prompt_id"] == f"alfworld-gen-v1/seed0/train/{index:05d}-{TASK_TYPES[index]}"
    plan = info["walkthrough"]
    assert plan and plan == env.walkthrough()
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "Your task is to: " + info["task"] in messages[1]["content"]
    for i, command in enumerate(plan):
        last = i == len(plan) - 1
        new, reward, terminated, truncated, step_info = env.step(f"Next I will do this.\n> {command}")
        assert step_info["command"] == command
        assert step_info["admissible"] is True
        assert (reward, terminated, truncated) == ((1.0, True, False) if last else (0.0, False, False))
        assert new == ([] if last else [{"role": "user", "content": new[0]["content"]}])
    assert step_info["won"] is True
    assert step_info["turn"] == len(plan)


def test_observations_list_the_admissible_commands(env: ALFWorldEnv) -> None:
    messages, info = env.reset(options={"game_index": 0})
    intro = messages[1]["content"]
    assert intro.startswith("-= Welcome to TextWorld, ALFRED! =-")
    _head, listed = intro.split("\n\nAdmissible commands:\n")
    assert listed.split("\n") == info["admissible_commands"]
    assert {"look", "inventory", "help"} <= set(info["admissible_commands"])
    go_to = [c for c in info["admissible_commands"] if c.startswith("go to ")]
    assert 4 <= len(go_to) <= GeneratorConfig().max_receptacles
    first = info["walkthrough"][0]
    new, _, _, _, step_info = env.step(f"> {first}")
    content = new[0]["content"]
    assert content.startswith(step_info["feedback"])
    assert content.split("\n\nAdmissible commands:\n")[1].split("\n") == step_info["admissible_commands"]
    assert first.replace("go to ", "You arrive at ") in step_info["feedback"]


def test_wrong_commands_get_no_reward_and_change_nothing(env: ALFWorldEnv) -> None:
    _, info = env.reset(options={"game_index": 2})
    _new, reward, terminated, truncated, step_info = env.step("> fly to the moon")
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert step_info["admissible"] is False
    assert step_info["feedback"] == "Nothing happens."
    assert step_info["admissible_commands"] == info["admissible_commands"]  # state unchanged
    # An admissible command that does not finish the task: still no reward.
    _, reward, terminated, _, step_info = env.step("look")
    assert (reward, terminated, step_info["admissible"]) == (0.0, False, True)
    # Skipping the first step of the plan (take before going there) is not admissible.
    _, reward, _, _, step_info = env.step("> " + info["walkthrough"][1])
    assert (reward, step_info["admissible"], step_info["feedback"]) == (0.0, False, "Nothing happens.")


def test_step_after_the_end_raises(env: ALFWorldEnv, cache_dir: Path) -> None:
    _, info = env.reset(options={"game_index": 0})
    for command in info["walkthrough"]:
        env.step(command)
    with pytest.raises(EpisodeEndedError):
        env.step("look")
    short = ALFWorldEnv(num_games=1, cache_dir=cache_dir, max_turns=2)
    short.reset(seed=0)
    assert short.step("look")[2:4] == (False, False)
    new, reward, terminated, truncated, step_info = short.step("look")
    assert (new, reward, terminated, truncated) == ([], 0.0, False, True)
    assert step_info["turn_limit_reached"] is True
    with pytest.raises(EpisodeEndedError):
        short.step("look")
    short.close()


def test_reset_order_is_seeded_and_covers_every_game(cache_dir: Path) -> None:
    env = ALFWorldEnv(num_games=3, cache_dir=cache_dir, max_loaded_games=3)

    def epoch(seed: int) -> list[int]:
        order = [env.reset(seed=seed)[1]["game_index"]]
        return order + [env.reset()[1]["game_index"] for _ in range(2)]

    first = epoch(3)
    assert sorted(first) == [0, 1, 2]
    assert epoch(3) == first
    assert sorted(env.loaded_games) == sorted(g.path for g in env.games)  # max_loaded_games=3 keeps all
    env.close()


# ------------------------------------------------------------------------------------ generator
def test_generation_is_deterministic_across_processes(cache_dir: Path) -> None:
    game = generate_game("pick_cool_then_place_in_recep", seed=11, split="valid_unseen")
    assert game.scene in catalog().test_scenes  # valid_unseen draws from ALFRED's held-out scenes
    script = (
        "import json, sys; from flashrl.envs.alfworld import generate_game; "
        "g = generate_game('pick_cool_then_place_in_recep', seed=11, split='valid_unseen'); "
        "sys.stdout.write(json.dumps([g.game, g.traj_data], sort_keys=True))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    ).stdout
    assert json.loads(out) == json.loads(json.dumps([game.game, game.traj_data]))
    # The cached training games come from ALFRED's training scenes, and differ from each other.
    scenes = {json.loads(p.read_text())["scene"]["scene_num"] for p in cache_dir.rglob("traj_data.json")}
    assert scenes <= set(catalog().train_scenes)
    problems = {json.loads(p.read_text())["pddl_problem"] for p in cache_dir.rglob("game.tw-pddl")}
    assert len(problems) == len(TASK_TYPES)


def test_cached_games_are_reused(cache_dir: Path) -> None:
    files = sorted(cache_dir.rglob("game.tw-pddl"))
    stamps = [f.stat().st_mtime_ns for f in files]
    again = generated_games(split="train", num_games=len(TASK_TYPES), seed=0, cache_dir=cache_dir)
    assert sorted(g.path for g in again.games) == files
    assert [f.stat().st_mtime_ns for f in files] == stamps


def test_generated_files_are_in_alfworld_format(cache_dir: Path) -> None:
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv
    from alfworld.agents.utils.misc import get_templated_task_desc

    for path in sorted(cache_dir.rglob("game.tw-pddl")):
        game = json.loads(path.read_text())
        traj = json.loads((path.parent / "traj_data.json").read_text())
        assert game["solvable"] is True and game["walkthrough"]
        assert "UNKNOWN GOAL" not in game["grammar"]
        # ALFWorld's own task-sentence helper reads our traj_data.json.
        sentence = get_templated_task_desc(traj)
        assert traj["pddl_params"]["object_target"].lower() in sentence
    # ALFWorld's own game collector finds every generated game.
    config = {
        "env": {"goal_desc_human_anns_prob": 0, "task_types": [1, 2, 3, 4, 5, 6]},
        "dataset": {"data_path": str(cache_dir), "num_train_games": -1},
    }
    assert AlfredTWEnv(config, train_eval="train").num_games == len(TASK_TYPES)


# ------------------------------------------------------------------------------------ official files
def test_official_folder_is_scanned_like_alfworld(cache_dir: Path, tmp_path: Path) -> None:
    source = sorted(cache_dir.rglob("game.tw-pddl"))
    root = tmp_path / "json_2.1.1" / "valid_unseen"
    for i, path in enumerate(source[:3]):
        shutil.copytree(path.parent, root / f"{path.parent.name}" / f"trial_{i}")
    shutil.copytree(source[3].parent, root / "pick_and_place_with_movable_recep-x" / "trial_0")
    unsolvable = root / "unsolvable" / "trial_0"
    shutil.copytree(source[4].parent, unsolvable)
    data = json.loads((unsolvable / "game.tw-pddl").read_text())
    (unsolvable / "game.tw-pddl").write_text(json.dumps({**data, "solvable": False}))
    # A game without a stored walkthrough: the planner supplies one.
    no_plan = root / "no_walkthrough" / "trial_0"
    shutil.copytree(source[5].parent, no_plan)
    data = json.loads((no_plan / "game.tw-pddl").read_text())
    (no_plan / "game.tw-pddl").write_text(json.dumps({**data, "walkthrough": None}))

    found = official_games(root)
    assert len(found.games) == 4
    assert found.skipped == {
        "movable receptacle or sliced object (unsupported by ALFWorld)": 1,
        "not marked solvable": 1,
    }
    assert official_games(root, task_types=["clean"]).skipped == {
        "movable receptacle or sliced object (unsupported by ALFWorld)": 1,
        "task type not selected": 4,
    }

    env = ALFWorldEnv(games=root.parent, split="valid_unseen", order="sequential")  # the data root
    assert [g.path for g in env.games] == [g.path for g in found.games]
    _, info = env.reset(options={"game_file": no_plan / "game.tw-pddl"})
    assert info["walkthrough"] is None
    assert info["prompt_id"] == "alfworld/valid_unseen/no_walkthrough/trial_0"
    plan = env.walkthrough()
    assert plan == data["walkthrough"]
    rewards = [env.step(f"> {command}")[1] for command in plan]
    assert rewards == [0.0] * (len(plan) - 1) + [1.0]
    env.close()


# ------------------------------------------------------------------------------------ errors
def test_bad_configuration_errors(cache_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Unknown split 'test'"):
        ALFWorldEnv(split="test", cache_dir=cache_dir)
    with pytest.raises(ValueError, match="num_games must be a positive int"):
        ALFWorldEnv(num_games=0, cache_dir=cache_dir)
    with pytest.raises(ValueError, match="Unknown ALFWorld task type 'dance'"):
        ALFWorldEnv(task_types=["dance"], cache_dir=cache_dir)
    with pytest.raises(ValueError, match="task type numbers are 1-6"):
        ALFWorldEnv(task_types=[7], cache_dir=cache_dir)
    with pytest.raises(TypeError, match="Wrap it in a list"):
        ALFWorldEnv(task_types="clean", cache_dir=cache_dir)
    with pytest.raises(ValueError, match="max_turns must be a positive int"):
        ALFWorldEnv(max_turns=0, cache_dir=cache_dir)
    with pytest.raises(ValueError, match="max_loaded_games must be a positive int"):
        ALFWorldEnv(max_loaded_games=0, cache_dir=cache_dir)
    with pytest.raises(ValueError, match="worker_timeout_s must be a positive number of seconds; got 0"):
        ALFWorldEnv(worker_timeout_s=0, cache_dir=cache_dir)
    with pytest.raises(ValueError, match="order must be"):
        ALFWorldEnv(order="backwards", cache_dir=cache_dir)
    with pytest.raises(ValueError, match="max_receptacles must be >= 4"):
        GeneratorConfig(max_receptacles=2)
    with pytest.raises(RuntimeError, match="No solvable pick_and_place_simple game for seed 1"):
        generate_game("pick", seed=1, config=GeneratorConfig(max_walkthrough_steps=2, max_attempts=1))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ALFWorldEnv(games=tmp_path / "missing")
    with pytest.raises(ValueError, match="No playable ALFWorld games"):
        ALFWorldEnv(games=tmp_path)
    bad = tmp_path / "bad.tw-pddl"
    bad.write_text(json.dumps({"pddl_domain": "x"}))
    env = ALFWorldEnv(games=[bad])
    with pytest.raises(ValueError, match=r"missing keys \['grammar', 'pddl_problem'\]"):
        env.reset()
    env = ALFWorldEnv(num_games=1, cache_dir=cache_dir)
    with pytest.raises(ValueError, match="Unknown reset options"):
        env.reset(options={"level": 3})
    with pytest.raises(IndexError, match="game_index 5 is out of range for 1 games"):
        env.reset(options={"game_index": 5})
    env.close()


# ------------------------------------------------------------------------------------ parsing
@pytest.mark.parametrize(
    ("reply", "command"),
    [
        ("go to cabinet 1", "go to cabinet 1"),
        ("The apple may be cold.\n> go to fridge 1\n", "go to fridge 1"),
        ("> look\nthinking more\n> Open Fridge 1.", "open fridge 1"),
        ("I should check.\nAction: take apple 1 from countertop 2", "take apple 1 from countertop 2"),
        ("> `heat   mug 1 with microwave 1`", "heat mug 1 with microwave 1"),
        ("put apple 1 in/on fridge 1", "move apple 1 to fridge 1"),
        ("> put cd 2 on desk 1", "move cd 2 to desk 1"),
        ("", ""),
        ("  \n\n", ""),
    ],
)
def test_parse_command(reply: str, command: str) -> None:
    assert parse_command(reply) == command


def test_gymnasium_check_env(cache_dir: Path) -> None:
    from gymnasium.utils.env_checker import check_env

    env = ALFWorldEnv(num_games=1, cache_dir=cache_dir, max_turns=3)
    check_env(env, skip_render_check=True)
    env.close()


_COMMANDS = [
    "go to cabinet 1",
    "take apple 1 from countertop 2",
    "move mug 2 to shelf 1",
    "use desklamp 1",
    "look",
]


@given(
    preamble=st.lists(
        st.text(min_size=0, max_size=30).filter(lambda t: not t.lstrip().startswith(">")), max_size=4
    ),
    command=st.sampled_from(_COMMANDS),
)
def test_parse_command_takes_the_marked_line_after_any_thoughts(preamble: list[str], command: str) -> None:
    reply = "\n".join([*preamble, f">   {command.upper()}.", ""])
    assert parse_command(reply) == command
