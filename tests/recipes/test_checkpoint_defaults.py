"""Every tuned example (and so `flashrl train`) saves periodic checkpoints by default: every 10 updates or
10 minutes, whichever comes first, the newest 2 kept; a flag or the config's own settings decide otherwise."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from flashrl.recipes.run import build_config

EXAMPLES = Path(__file__).resolve().parents[2] / "tuned_examples"
SCRIPTS = sorted(p.stem for p in EXAMPLES.glob("*.py") if p.stem != "tune_delta_batch_sweep")
OWN_CONFIGS = ("smollm2_arithmetic_cpu", "smollm2_python_tool_cpu")
"""The examples whose config saves no periodic checkpoint itself (the release's experiments save every
`ckpt.save_steps`, translated to checkpoint_frequency)."""


def _module(script: str):
    spec = importlib.util.spec_from_file_location(f"_example_{script}", EXAMPLES / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _built(script: str, argv: list[str]):
    """The config a tuned example's command line builds (a release experiment's through run_experiment's steps)."""
    experiment = re.search(r'run_experiment\("(\w+)"\)', (EXAMPLES / f"{script}.py").read_text(encoding="utf-8"))
    if experiment:
        from flashrl.reproduction.experiment_run import (
            add_experiment_arguments,
            config_factory,
            experiment_preset,
        )

        name = experiment.group(1)
        return build_config(experiment_preset(name), config_factory(name), argv,
                            add_arguments=lambda parser: add_experiment_arguments(parser, name))[0]
    module = _module(script)
    return build_config(module.PRESET, module.make_config, argv)[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_tuned_example_saves_periodic_checkpoints_into_its_run_folder(script, tmp_path):
    config = _built(script, ["--output", str(tmp_path / "run")])
    assert config.checkpoint_frequency > 0
    assert config.checkpoint_dir == str(tmp_path / "run" / "checkpoints")
    if script in OWN_CONFIGS:
        assert (config.checkpoint_frequency, config.checkpoint_interval_minutes,
                config.num_checkpoints_to_keep) == (10, 10.0, 2)


def test_the_flag_decides_and_zero_turns_periodic_checkpoints_off(tmp_path):
    module = _module("smollm2_arithmetic_cpu")
    every_5, _ = build_config(module.PRESET, module.make_config, ["--checkpoint-frequency", "5"])
    assert (every_5.checkpoint_frequency, every_5.checkpoint_interval_minutes, every_5.num_checkpoints_to_keep) == (
        5, None, None
    )
    off, _ = build_config(module.PRESET, module.make_config, ["--checkpoint-frequency", "0"])
    assert (off.checkpoint_frequency, off.checkpoint_interval_minutes, off.checkpoint_dir) == (0, None, None)


def test_a_config_with_its_own_periodic_checkpoints_keeps_them(tmp_path):
    module = _module("smollm2_arithmetic_cpu")

    def make_config(args):
        return module.make_config(args).checkpointing(checkpoint_frequency=1)

    config, _ = build_config(module.PRESET, make_config, ["--output", str(tmp_path)])
    assert (config.checkpoint_frequency, config.checkpoint_interval_minutes, config.num_checkpoints_to_keep) == (
        1, None, None
    )


def test_the_sweep_checkpoints_through_tune(tmp_path):
    module = _module("tune_delta_batch_sweep")
    config, args = build_config(module.TINY, module.make_config, ["--tiny", "--output", "x"],
                                add_arguments=module.add_arguments, find_resume_checkpoint=False)
    assert (config.checkpoint_frequency, config.checkpoint_interval_minutes) == (0, None)
    checkpoint = module._new_tuner({}, str(tmp_path), args)._local_tuner._run_config.checkpoint_config
    assert (checkpoint.checkpoint_frequency, checkpoint.num_to_keep) == (10, 2)
