"""A checkpoint's config.json is data: restoring never runs a command or imports a module that it names.

A checkpoint folder may come from someone else. `FlashReinforce.from_checkpoint` and `flashrl eval
<checkpoint>` refuse every stored setting that names code (an Agent-v0 ``command``, a ``"module:name"``
path, vLLM's ``engine_args``) with an error naming each one, unless the user passes it again or opts in
(``trust_config_code=True``, ``--trust-checkpoint-code``); ``restore_from_path`` (a tuned example's
``--resume``, Tune's restore) reads the stored config not at all. Which settings hold code is declared on
each setting (``setting(..., code=...)``), and every setting that admits objects must say so.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
import textwrap
import types
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from flashrl.algorithms import FlashReinforce, FlashReinforceConfig
from flashrl.algorithms.flash_reinforce.config import FlashReinforceAlgorithmSpec
from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
from flashrl.checkpoints import STATE_FILE, write_checkpoint
from flashrl.checkpoints.stored_code import UntrustedCodeError, find_stored_code
from flashrl.cli import main
from flashrl.env_runners.spec import EnvRunnerSpec
from flashrl.envs.agent_env import AgentEnv
from flashrl.learners.spec import LearnerSpec, _build_loss
from flashrl.validation import CODE, CODE_KINDS, DERIVED

SPECS = (EnvRunnerSpec, LearnerSpec, FlashReinforceLossSpec, FlashReinforceAlgorithmSpec)
CODE_SETTINGS = {
    "env": "path", "env_config": "env_config", "engine_options": "engine_options",
    "evaluation_env_config": "env_config", "evaluation_splits": "env_configs", "callbacks_class": "import",
    "loss": "path", "baseline": "path", "importance_sampling": "path", "trust_region": "path",
    "aggregation": "path", "token_mask": "path", "logger_options": "passthrough",
}
"""Every setting that may hold code, and how (``flashrl.validation.CODE_KINDS``)."""
CODE_SAMPLES = {
    "path": "probe_module:thing", "import": "probe_module.Thing", "env_config": {"reward_fn": "probe_module:f"},
    "env_configs": {"split": {"reward_fn": "probe_module:f"}},
    "engine_options": {"engine_args": {"worker_extension_cls": "probe_module.Worker"}},
    "passthrough": {"wandb": {"settings": {"x": 1}}},
}
"""A stored value of each kind that names code."""


class _Group:
    """What write_checkpoint needs of a learner group: one state file, and the tiny model as the policy."""

    num_learners = 0

    def __init__(self, policy: str | None = None) -> None:
        self.policy = policy

    def save_state(self, path: str) -> str:
        Path(path).mkdir()
        torch.save({"w": torch.zeros(2)}, Path(path, STATE_FILE))
        return path

    def save_policy(self, path: str) -> str:
        assert self.policy is not None
        shutil.copytree(self.policy, path)
        return path


def _checkpoint(path: Path, config: dict[str, Any], policy: str | None = None) -> str:
    return write_checkpoint(path, config=config, learner_group=_Group(policy), algorithm_state={"iteration": 1},
                            export_policy=policy is not None)


def _agent_config(marker: Path) -> dict[str, Any]:
    """An Agent-v0 run whose command writes ``marker``, then asks the model once and returns reward 1."""
    script = textwrap.dedent(f"""
        import json, os, pathlib, sys
        from openai import OpenAI
        pathlib.Path({str(marker)!r}).write_text("ran")
        task = json.load(sys.stdin)
        OpenAI(max_retries=0).chat.completions.create(
            model=os.environ["FLASHRL_MODEL"], messages=[{{"role": "user", "content": "hi"}}], max_tokens=2)
        print(json.dumps({{"reward": 1.0}}))
    """)
    return (FlashReinforceConfig()
            .environment("flashrl/Agent-v0", env_config={"tasks": [{"id": "t0"}],
                                                          "command": [sys.executable, "-c", script]})
            .env_runners(engine="torch", max_new_tokens=4, max_episode_tokens=256)
            .serialize())


@pytest.fixture
def probe_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A module of user code that writes a marker when it is imported, with a reward function ``score``."""
    name = f"ckpt_probe_{uuid.uuid4().hex}"
    folder = tmp_path / "user_code"
    folder.mkdir()
    marker = tmp_path / "imported"
    (folder / f"{name}.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n\n"
        "def score(reply, task):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    yield types.SimpleNamespace(name=name, marker=marker)
    sys.modules.pop(name, None)


class _Started(Exception):
    """Raised where the run would start (Ray): the config got past the restore's checks."""


@pytest.fixture
def no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def start(**_: Any) -> None:
        raise _Started

    monkeypatch.setattr("flashrl.ray_utils.init_or_join", start)


# ------------------------------------------------------------------------------------------------
# the marking
# ------------------------------------------------------------------------------------------------
def test_every_setting_that_admits_objects_declares_whether_it_holds_code() -> None:
    declared = {f.name for cls in SPECS for f in dataclasses.fields(cls)}
    assert set(FlashReinforceConfig.setting_names()) <= declared  # no part of the config is left out here
    for cls in SPECS:
        for f in dataclasses.fields(cls):
            if re.search(r"\b(Any|type|Callable|object|Loss)\b", str(f.type)):
                assert CODE in f.metadata, (
                    f"{cls.__name__}.{f.name}: {f.type} admits objects; declare setting(..., code=<kind>) "
                    f"(one of {CODE_KINDS}) or code=False for plain data")
    marked = {f.name: f.metadata[CODE] for cls in SPECS for f in dataclasses.fields(cls) if f.metadata.get(CODE)}
    assert marked == CODE_SETTINGS


@pytest.mark.parametrize("name", sorted(CODE_SETTINGS))
def test_each_code_setting_is_found_when_stored_and_plain_data_is_not(name: str) -> None:
    value = CODE_SAMPLES[CODE_SETTINGS[name]]
    found = find_stored_code({name: value}, SPECS, env="flashrl/Math-v0")
    assert found and all(item.setting.startswith(name) for item in found)
    fields = {f.name: f for cls in SPECS for f in dataclasses.fields(cls)}
    plain = [n for n, f in fields.items() if not f.metadata.get(CODE) and DERIVED not in f.metadata]
    assert find_stored_code(dict.fromkeys(plain, "probe_module:thing"), SPECS, env="flashrl/Math-v0") == []


def test_a_default_config_holds_no_code_and_names_and_ids_are_data() -> None:
    config = FlashReinforceConfig().environment("flashrl/Math-v0", env_config={"preset": "easy_sums",
                                                                               "tasks": "https://x/y.jsonl"})
    assert find_stored_code(config.serialize(), SPECS, env="flashrl/Math-v0") == []
    # an object written as text cannot run: validate() asks for it again
    assert find_stored_code({"baseline": "<object m:B>", "env_config": {"reward_fn": "<object m:f>"}}, SPECS,
                            env="flashrl/Math-v0") == []


def test_agent_v0_declares_its_command_and_its_code() -> None:
    assert AgentEnv.command_arguments == ("command",)
    found = find_stored_code({"env_config": {"command": ["python", "a.py"], "agent": "m:agent", "tasks": []}},
                             SPECS, env="flashrl/Agent-v0")
    assert [item.setting for item in found] == ["env_config['command']", "env_config['agent']"]


def test_a_stored_loss_type_resolves_only_to_a_loss_class_of_flashrl_or_the_user(probe_module) -> None:
    with pytest.raises(ValueError, match="leads into the standard library"):
        _build_loss({"type": "os:system"})
    with pytest.raises(TypeError, match="not one"):
        _build_loss({"type": f"{probe_module.name}:score"})
    assert isinstance(_build_loss({"type": "flashrl.algorithms.flash_reinforce.learner_loss:FlashReinforceLossSpec",
                                   "delta": 0.5}), FlashReinforceLossSpec)


# ------------------------------------------------------------------------------------------------
# from_checkpoint
# ------------------------------------------------------------------------------------------------
def test_from_checkpoint_runs_no_stored_command_and_names_it(tmp_path: Path, no_start: None) -> None:
    marker = tmp_path / "ran"
    path = _checkpoint(tmp_path / "ckpt", _agent_config(marker))
    with pytest.raises(UntrustedCodeError) as error:
        FlashReinforce.from_checkpoint(path)
    message = str(error.value)
    assert "env_config['command'] = [" in message and "trust_config_code=True" in message
    assert [item.setting for item in error.value.found] == ["env_config['command']"]
    assert not marker.exists()
    with pytest.raises(_Started):  # the user's opt-in, or the setting given again: the run starts
        FlashReinforce.from_checkpoint(path, trust_config_code=True)
    with pytest.raises(_Started):
        FlashReinforce.from_checkpoint(path, env_config={"tasks": [{"id": "t0"}], "command": ["true"]})
    with pytest.raises(_Started):
        FlashReinforce.from_checkpoint(path, config=FlashReinforceConfig().environment("flashrl/Math-v0"))
    assert not marker.exists()


def test_from_checkpoint_imports_no_stored_path(tmp_path: Path, probe_module, no_start: None) -> None:
    stored = FlashReinforceConfig().environment(
        "flashrl/Math-v0", env_config={"preset": "easy_sums", "reward_fn": f"{probe_module.name}:score"},
    ).training(baseline=f"{probe_module.name}:Baseline").serialize()
    path = _checkpoint(tmp_path / "ckpt", stored)
    with pytest.raises(UntrustedCodeError) as error:
        FlashReinforce.from_checkpoint(path)
    assert [item.setting for item in error.value.found] == ["env_config['reward_fn']", "baseline"]
    assert f"baseline = '{probe_module.name}:Baseline'" in str(error.value)
    assert probe_module.name not in sys.modules and not probe_module.marker.exists()
    with pytest.raises(UntrustedCodeError) as error:  # one given again: the other is still named
        FlashReinforce.from_checkpoint(path, baseline="batch_mean")
    assert [item.setting for item in error.value.found] == ["env_config['reward_fn']"]


def test_restore_from_path_reads_no_stored_config(tmp_path: Path, probe_module) -> None:
    """What a tuned example's --resume and Tune's restore call: the config is the caller's own (rebuilt by the
    example's code, or the trial's), and the checkpoint gives state only."""
    stored = _agent_config(tmp_path / "ran")
    stored["env_config"]["reward_fn"] = f"{probe_module.name}:score"
    stored["callbacks_class"] = f"{probe_module.name}:Callbacks"
    path = _checkpoint(tmp_path / "ckpt", stored)

    class _Stub:
        def __getattr__(self, name: str) -> Any:
            return lambda *args, **kwargs: None

    algo = types.SimpleNamespace(learner_group=types.SimpleNamespace(version=0, load_state=lambda *a, **k: None),
                                 env_runner_group=types.SimpleNamespace(streaming=True), stream=_Stub(),
                                 _weight_sync=_Stub(), _loggers=[], _learner_restarts=_Stub(), callbacks=_Stub())
    FlashReinforce.restore_from_path(algo, path)
    assert algo._iteration == 1
    assert probe_module.name not in sys.modules and not probe_module.marker.exists()
    assert not (tmp_path / "ran").exists()


# ------------------------------------------------------------------------------------------------
# flashrl eval <checkpoint>
# ------------------------------------------------------------------------------------------------
EVAL = ["--num-episodes", "1", "--max-new-tokens", "2", "--max-episode-tokens", "256", "--concurrency", "1"]


def test_eval_runs_a_stored_command_only_when_trusted(tmp_path: Path, tiny_llama_path: str, capsys) -> None:
    marker = tmp_path / "ran"
    path = _checkpoint(tmp_path / "ckpt", _agent_config(marker), policy=tiny_llama_path)
    with pytest.raises(SystemExit) as exit_:
        main(["eval", path, *EVAL])
    message = str(exit_.value.code)
    assert "env_config['command'] = [" in message and "--trust-checkpoint-code" in message
    assert not marker.exists()
    assert main(["eval", path, *EVAL, "--trust-checkpoint-code"]) == 0
    assert marker.read_text() == "ran"
    assert json.loads(capsys.readouterr().out)["evaluation/episode_return_mean"] == 1.0


def test_eval_imports_a_stored_reward_fn_only_when_trusted(tmp_path: Path, tiny_llama_path: str, probe_module,
                                                           capsys) -> None:
    stored = FlashReinforceConfig().environment(
        "flashrl/Math-v0", env_config={"tasks": [{"question": "1+1", "answer": "2"}],
                                       "reward_fn": f"{probe_module.name}:score"},
    ).env_runners(engine="torch").serialize()
    path = _checkpoint(tmp_path / "ckpt", stored, policy=tiny_llama_path)
    with pytest.raises(SystemExit) as exit_:
        main(["eval", path, *EVAL])
    assert f"env_config['reward_fn'] = '{probe_module.name}:score'" in str(exit_.value.code)
    assert probe_module.name not in sys.modules and not probe_module.marker.exists()
    assert main(["eval", path, *EVAL, "--trust-checkpoint-code"]) == 0
    assert probe_module.marker.exists()
    assert json.loads(capsys.readouterr().out)["evaluation/episode_return_mean"] == 1.0  # score() graded it
