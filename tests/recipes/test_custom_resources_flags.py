"""`--custom-resources-per-env-runner` / `--custom-resources-per-learner` (NAME=AMOUNT[,NAME=AMOUNT]) of the tuned
examples and `flashrl train`: parsed into the settings, malformed text a usage error, and shown by `--dry-run`."""

from __future__ import annotations

import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.cli import main
from flashrl.recipes import Preset, apply_overrides, recipe_parser
from flashrl.recipes.preset import NodePlan

PRESET = Preset(name="t", description="test", success_metric="m", success_threshold=1.0, stop_iters=3,
                node_plan=NodePlan(gpus_per_node=2, cpus_per_node=4))


def test_the_flags_set_the_settings():
    args = recipe_parser(PRESET).parse_args(["--custom-resources-per-env-runner", "rollout_node=1, ssd=0.5",
                                             "--custom-resources-per-learner", "learner_node=2"])
    config = apply_overrides(FlashReinforceConfig().environment("flashrl/Math-v0"), args)
    assert config.custom_resources_per_env_runner == {"rollout_node": 1.0, "ssd": 0.5}
    assert config.custom_resources_per_learner == {"learner_node": 2.0}
    untouched = apply_overrides(FlashReinforceConfig().environment("flashrl/Math-v0"), recipe_parser(PRESET).parse_args([]))
    assert untouched.custom_resources_per_env_runner == {} and untouched.custom_resources_per_learner == {}


@pytest.mark.parametrize(("text", "why"), [
    ("rollout_node", "'rollout_node' is not NAME=AMOUNT"),
    ("=1", "'=1' is not NAME=AMOUNT"),
    ("rollout_node=1,", "'' is not NAME=AMOUNT"),
    ("rollout_node=one", "'rollout_node=one' has an amount that is not a number >= 0"),
    ("rollout_node=-1", "'rollout_node=-1' has an amount that is not a number >= 0"),
    ("rollout_node=inf", "'rollout_node=inf' has an amount that is not a number >= 0"),
    ("rollout_node=1,rollout_node=2", "'rollout_node=2' names rollout_node a second time"),
])
def test_malformed_text_is_a_usage_error_saying_what_is_expected(text, why, capsys):
    for flag in ("--custom-resources-per-env-runner", "--custom-resources-per-learner"):
        with pytest.raises(SystemExit) as exit_:
            recipe_parser(PRESET).parse_args([flag, text])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert (f"argument {flag}: expected NAME=AMOUNT[,NAME=AMOUNT] (each name once, amounts >= 0), got {text!r}: "
                f"{why}. Fix: e.g. rollout_node=1 or rollout_node=1,ssd=0.5") in err


def test_a_name_ray_reserves_is_the_configs_error(capsys):
    code = main(["train", "qwen25_math_1p5b", "--dry-run", "--custom-resources-per-env-runner", "GPU=1"])
    out, err = capsys.readouterr()
    assert code != 0
    assert "custom_resources_per_env_runner: expected a dict of Ray custom resource name (not CPU, GPU, memory)" in out + err


def test_the_dry_run_shows_what_each_actor_asks_for(capsys):
    code = main(["train", "qwen25_math_1p5b", "--dry-run", "--custom-resources-per-env-runner", "rollout_node=1",
                 "--custom-resources-per-learner", "learner_node=1,ssd=0.5"])
    out, _ = capsys.readouterr()
    assert code == 0, out
    assert ("  custom resources: each env runner asks for rollout_node=1 (only nodes started with them, ray start "
            "--resources, can host it; checked at setup)") in out
    assert "  custom resources: each learner asks for learner_node=1, ssd=0.5 (" in out
    main(["train", "qwen25_math_1p5b", "--dry-run"])
    assert "custom resources:" not in capsys.readouterr()[0]  # none asked: the plan reads as before
