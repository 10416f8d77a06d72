"""`.environment(env=...)` takes a registered id, an env class or its "module:Class" path; the config's dict
carries the env to a process without the user's script (a Ray Tune trial), and bad values are refused
with expected, got and the fix. No Ray here: tests/runtime/test_user_env_actors.py and
tests/runtime/test_tune_user_env.py run them."""

from __future__ import annotations

import json
import pickle
import sys
import textwrap

import gymnasium as gym
import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.algorithms.flash_reinforce.config import ConfigError
from flashrl.envs.base import LanguageEnv

USER_ID = "flashrl-test-user/Constant-v0"
FORMS = "a registered Gymnasium id (str), a gymnasium.Env subclass or its 'module:Class' path"


class ConstantEnv(LanguageEnv):
    """One turn, reward 0.375 whatever the reply."""

    def __init__(self, reward: float = 0.375) -> None:
        super().__init__(max_turns=1)
        self.reward = reward

    def _reset_task(self, options):
        return [{"role": "user", "content": "Say anything."}], {"prompt_id": "constant"}

    def _step_action(self, action):
        return [], self.reward, True, False, {}


class NotAnEnv:
    """A class, but not a gymnasium.Env."""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of the user's own on sys.path, defining ``ModuleEnv`` (reward 0.625) and ``NotAnEnv``."""
    name = "flashrl_test_user_env_module"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        from flashrl.envs.base import LanguageEnv

        class ModuleEnv(LanguageEnv):
            def __init__(self):
                super().__init__(max_turns=1)

            def _reset_task(self, options):
                return [{"role": "user", "content": "Say anything."}], {"prompt_id": "module"}

            def _step_action(self, action):
                return [], 0.625, True, False, {}

        class NotAnEnv:
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)
    for env_id in [k for k in gym.registry if k.startswith(name)]:
        del gym.registry[env_id]


@pytest.fixture
def registered():
    """USER_ID registered as a script would (``gymnasium.register``), unregistered afterwards."""
    gym.register(USER_ID, entry_point=ConstantEnv)
    yield USER_ID
    gym.registry.pop(USER_ID, None)


def _config(env) -> FlashReinforceConfig:
    return FlashReinforceConfig().environment(env).training(model="smollm2-135m-instruct")


def _reward(env_id: str) -> float:
    env = gym.make(env_id)
    env.reset(seed=0)
    return env.step("x")[1]


def test_an_env_class_is_registered_under_its_module_and_name_and_shown_as_text():
    config = _config(ConstantEnv)
    config.validate()
    spec = config.env_runner_spec()
    assert spec.env == f"{__name__}.ConstantEnv"
    assert gym.spec(spec.env).entry_point is ConstantEnv
    assert _reward(spec.env) == 0.375
    assert config.env is ConstantEnv and config.to_dict()["env"] is ConstantEnv
    assert config.serialize()["env"] == f"<object {__name__}:ConstantEnv>"


def test_a_path_is_imported_and_kept_as_the_path(user_module):
    config = _config(f"{user_module}:ModuleEnv")
    config.validate()
    spec = config.env_runner_spec()
    assert spec.env == f"{user_module}.ModuleEnv"
    assert _reward(spec.env) == 0.625
    assert json.dumps(config.serialize()["env"]) == f'"{user_module}:ModuleEnv"'
    carried = config.to_dict()["env"]
    assert carried == f"{user_module}:ModuleEnv" and carried.spec.entry_point is sys.modules[user_module].ModuleEnv


def test_a_script_registered_id_reaches_a_process_where_it_is_not_registered(registered):
    """What a Tune trial receives: the config's dict, pickled, in a process that never ran gymnasium.register."""
    data = pickle.dumps(_config(registered).to_dict())
    del gym.registry[registered]  # the trial's process
    config = FlashReinforceConfig.from_dict(pickle.loads(data))
    assert config.env == registered and json.dumps(config.serialize()["env"]) == f'"{registered}"'
    config.validate()
    assert config.env_runner_spec().env == registered  # registered here again
    assert _reward(registered) == 0.375
    assert config.copy() == config
    own = _config("flashrl/Math-v0").to_dict()["env"]  # registered wherever flashrl is imported
    assert type(own) is str and own == "flashrl/Math-v0"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (NotAnEnv, (
            f"env: expected {FORMS}, got '<object {__name__}:NotAnEnv>', which is not a gymnasium.Env subclass. Fix: "
            "pass a subclass of gymnasium.Env (e.g. of flashrl.envs.base.LanguageEnv), or its 'module:Class' path")),
        ("os:system", (
            f"env: expected {FORMS}, got 'os:system', which is not a registered id and as a path fails: the path "
            "'os:system' leads into the standard library (module 'os'), which is refused: a path names a function or "
            "class defined in your own code or in flashrl (write the function in a module of your own and give its "
            "'module:name' path, or pass the object itself). Fix: gymnasium.register the id before building the "
            "config, or give the path of an env class in a module of your own (or pass the class itself)")),
        (f"<object {__name__}:ConstantEnv>", (
            f"env: expected {FORMS}, got '<object {__name__}:ConstantEnv>', the text a saved config keeps for an env "
            "class. Fix: pass the class again (e.g. FlashReinforce.from_checkpoint(path, env=MyEnv)), or configure the "
            "env by its 'module:Class' path")),
        (42, (
            f"env: expected {FORMS}, got 42. Fix: call .environment('flashrl/Math-v0'), or .environment(MyEnv) with "
            "your env class")),
    ],
)
def test_what_is_not_an_env_is_refused_with_expected_got_and_fix(env, message):
    with pytest.raises(ConfigError) as info:
        _config(env).validate()
    assert str(info.value) == f"Invalid FlashReinforceConfig:\n  - {message}"


def test_a_path_to_a_class_that_is_not_an_env_is_refused(user_module):
    with pytest.raises(ConfigError) as info:
        _config(f"{user_module}:NotAnEnv").validate()
    assert str(info.value) == (
        f"Invalid FlashReinforceConfig:\n  - env: expected {FORMS}, got '<object {user_module}:NotAnEnv>' (the path "
        f"'{user_module}:NotAnEnv'), which is not a gymnasium.Env subclass. Fix: pass a subclass of gymnasium.Env "
        "(e.g. of flashrl.envs.base.LanguageEnv), or its 'module:Class' path")


class RefusingEnv(ConstantEnv):
    """Like ConstantEnv, but its step raises: the run must fail at setup, before any actor starts."""

    def _step_action(self, action):
        raise ValueError("no reply is accepted")


def test_an_env_class_is_checked_like_an_id_before_ray_starts(monkeypatch):
    from flashrl.algorithms.flash_reinforce import algorithm as algorithm_module
    from flashrl.env_runners.env_check import EnvCheckError

    with pytest.raises(ConfigError, match=rf"env_config: expected keyword arguments of {__name__}\.ConstantEnv's "
                                          r"constructor \(reward\), got 'rewrd'\. Fix: did you mean 'reward'\?"):
        _config(ConstantEnv).environment(env_config={"rewrd": 1.0}).validate()
    started = []
    monkeypatch.setattr("flashrl.ray_utils.init_or_join", lambda *a, **k: started.append(1))
    with pytest.raises(EnvCheckError, match=rf"expected an env that resets and steps, got {__name__}\.RefusingEnv "
                                            r"with \{\}, whose step\('0'\) raised ValueError: no reply is accepted"):
        algorithm_module.FlashReinforce(config=_config(RefusingEnv).env_runners(engine="torch"))
    assert started == []
