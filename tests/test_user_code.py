"""User code given to a run as objects or "module:name" paths: checked at validate(), shipped by value.

This file stands for a user's own module: it is renamed below so that no other process can import it
by name (every process of the test session has the repository on its path, where the file's pytest
name would import). A fresh Python process then plays the actors: it unpickles what the driver ships
and uses it, which only works when the code travelled by value.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import gymnasium as gym
import pytest
import torch

from flashrl.algorithms import FlashReinforceConfig
from flashrl.algorithms.flash_reinforce.components import (
    BASELINES,
    FailureTokenEntropyMask,
    Normalizers,
)
from flashrl.algorithms.flash_reinforce.config import ConfigError
from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
from flashrl.algorithms.flash_reinforce.loss import flash_reinforce_loss
from flashrl.env_runners.env_check import runner_env_spec, runner_spec
from flashrl.envs.base import LanguageEnv
from flashrl.learners.spec import LearnerSpec
from flashrl.user_code import Shipped, UserCodeError, describe, import_path

USER_MODULE = "flashrl_test_user_code_script"
sys.modules[USER_MODULE] = sys.modules[__name__]
__name__ = USER_MODULE  # the classes below get this module name, importable nowhere else

REPO = Path(__file__).resolve().parents[1]
SHIFT = 0.125


class ShiftedBaseline:
    """batch_mean plus SHIFT: an advantage mean of SHIFT shows this baseline was used."""

    def __call__(self, rewards, *, group_ids=None):
        return rewards - rewards.mean() + SHIFT


def halves(reply, task):
    """A user verifier: 0.5 for a reply of odd length, else 0."""
    return 0.5 if len(reply) % 2 else 0.0


class FirstTokenOnly:
    """A token mask: each trajectory keeps only its first valid token."""

    def __call__(self, loss_mask, *, entropy=None, failures=None):
        first = loss_mask.int().cumsum(-1) == 1
        return loss_mask & first


@BASELINES.register("test_user_code_plus_one")
class PlusOneBaseline:
    """A name registered by the user's script: the actors' registries do not have it."""

    def __call__(self, rewards, *, group_ids=None):
        return rewards + 1.0


class EchoEnv(LanguageEnv):
    """Single turn: reward = the reply's length."""

    def __init__(self) -> None:
        super().__init__(max_turns=1)

    def _reset_task(self, options):
        return [{"role": "user", "content": "say something"}], {"prompt_id": "echo"}

    def _step_action(self, action):
        return [], float(len(action)), True, False, {"success": True}


ECHO_ID = "flashrl-test-user-code/Echo-v0"
if ECHO_ID not in gym.registry:
    gym.register(ECHO_ID, entry_point=f"{USER_MODULE}:EchoEnv")


def _rows(b: int = 4, t: int = 3):
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0][:b])
    logprobs = torch.full((b, t), -1.0, requires_grad=True)
    return logprobs, logprobs.detach().clone(), rewards, torch.ones(b, t, dtype=torch.bool)


def _as_an_actor(tmp_path: Path, shipped: object, code: str) -> None:
    """Unpickle ``shipped`` in a fresh process that cannot import this module, then run ``code`` on it."""
    blob = tmp_path / "shipped.pkl"
    blob.write_bytes(pickle.dumps(Shipped(shipped)))
    script = (
        "import importlib.util, pickle, sys\n"
        f"assert importlib.util.find_spec({USER_MODULE!r}) is None, 'the user module imports here'\n"
        f"obj = pickle.loads(open({str(blob)!r}, 'rb').read())\n" + code
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], check=False, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


# ------------------------------------------------------------------------------------------------
# the loss components


def test_object_path_and_name_give_the_same_component():
    logprobs, behavior, rewards, mask = _rows()
    by_object = flash_reinforce_loss(logprobs, behavior, rewards, mask, delta=1.0, baseline=ShiftedBaseline())
    by_path = flash_reinforce_loss(logprobs, behavior, rewards, mask, delta=1.0,
                                   baseline=f"{USER_MODULE}:ShiftedBaseline")
    by_class = flash_reinforce_loss(logprobs, behavior, rewards, mask, delta=1.0, baseline=ShiftedBaseline)
    expected = torch.tensor([0.625, -0.375, 0.625, -0.375])  # R - 0.5 + 0.125
    for out in (by_object, by_path, by_class):
        torch.testing.assert_close(out.advantages, expected)


def test_a_token_mask_keeps_only_its_tokens():
    logprobs, behavior, rewards, mask = _rows()
    out = flash_reinforce_loss(logprobs, behavior, rewards, mask, delta=1.0, token_mask=FirstTokenOnly())
    assert out.keep_mask.sum().item() == 4  # one token per trajectory
    # sample_mean with T_i = 3 kept as the denominator: -(1/4) sum_i A_i * 1 * (-1) / 3, A = +-0.5
    assert out.loss.item() == pytest.approx(0.0)
    out.loss.backward()
    assert logprobs.grad[:, 1:].abs().sum().item() == 0.0
    assert logprobs.grad[:, 0].tolist() == pytest.approx([-0.5 / 12, 0.5 / 12, -0.5 / 12, 0.5 / 12])


def test_the_failure_filter_is_a_token_mask():
    logprobs, behavior, rewards, mask = _rows()
    entropy = torch.tensor([[0.1, 0.9, 0.5]] * 4)
    failures = rewards == 0
    by_fraction = flash_reinforce_loss(logprobs, behavior, rewards, mask, delta=1.0, entropy=entropy,
                                       failures=failures, negative_token_fraction=0.3)
    by_mask = flash_reinforce_loss(logprobs, behavior, rewards, mask, delta=1.0, entropy=entropy,
                                   failures=failures, token_mask=FailureTokenEntropyMask(0.3))
    assert torch.equal(by_fraction.keep_mask, by_mask.keep_mask)
    assert by_mask.keep_mask[1].tolist() == [False, True, False]  # a failure keeps its ceil(0.3 * 3) = 1 top token
    assert by_mask.keep_mask[0].tolist() == [True, True, True]


class _TokenSum:
    """An aggregation: the plain sum of the token terms."""

    def __call__(self, token_terms, valid_counts, norm: Normalizers):
        return token_terms.sum()


class _NeedsArgument:
    def __init__(self, scale):
        self.scale = scale

    def __call__(self, rewards, *, group_ids=None):
        return rewards * self.scale


class _Locked:
    def __init__(self):
        self.lock = threading.Lock()

    def __call__(self, rewards, *, group_ids=None):
        return rewards


def _trust_everything(logprobs, behavior_logprobs, loss_mask, *, delta):
    from flashrl.algorithms.flash_reinforce.components import TrustDecision

    return TrustDecision(drift=torch.zeros(loss_mask.shape[0]), trust_mask=loss_mask.any(-1))  # validate() calls it


@pytest.mark.parametrize("value, expected, fix", [
    ("no_such_module_xyz:Thing", "a 'module:name' path", "the module 'no_such_module_xyz' of"),
    (f"{USER_MODULE}:NoSuchThing", "a 'module:name' path", "has no attribute 'NoSuchThing'"),
    (42, "a baseline object", "pass a callable baseline"),
    (_trust_everything, "a baseline: <1 positional>, group_ids=", "does not take"),
    (_NeedsArgument, "constructs with no arguments", "pass an instance instead"),
    (_Locked(), "an object that can be pickled", "cannot pickle '_thread.lock' object"),
    ("<object somewhere:Thing>", "a baseline object", "the object itself cannot be stored as text"),
])
def test_bad_components_fail_at_validate_with_expected_actual_and_fix(value, expected, fix):
    config = FlashReinforceConfig().environment("flashrl/Math-v0").training(baseline=value)
    with pytest.raises(ConfigError) as err:
        config.validate()
    line = next(line for line in str(err.value).splitlines() if line.strip().startswith("- baseline:"))
    assert expected in line and fix in line and "Fix:" in line
    got = describe(value) if not isinstance(value, (str, int)) else value
    assert f"got {got!r}" in line


def test_a_token_mask_and_the_failure_filter_exclude_each_other():
    config = FlashReinforceConfig().environment("flashrl/Math-v0").training(
        token_mask=FirstTokenOnly(), negative_token_fraction=0.5)
    with pytest.raises(ConfigError, match=r"token_mask: expected None with negative_token_fraction=0.5"):
        config.validate()


# ------------------------------------------------------------------------------------------------
# configs, to_dict and checkpoints


def test_serialize_writes_objects_as_text_and_paths_as_they_are():
    config = (FlashReinforceConfig()
              .environment("flashrl/Math-v0", env_config={"reward_fn": halves})
              .training(baseline=ShiftedBaseline(), trust_region=f"{USER_MODULE}:_trust_everything"))
    config.validate()
    assert config.to_dict()["baseline"] is config.baseline  # to_dict keeps the object (Tune carries it)
    data = config.serialize()
    assert data["baseline"] == f"<object {USER_MODULE}:ShiftedBaseline>"
    assert data["env_config"] == {"reward_fn": f"<object {USER_MODULE}:halves>"}
    assert data["trust_region"] == f"{USER_MODULE}:_trust_everything"
    assert config.copy().baseline is config.baseline  # user code is shared, not copied
    learner = config.learner_spec(model="m").to_dict()
    assert learner["loss"]["baseline"] == data["baseline"]  # the learner state's record is plain text too
    # A config read back from that text names what to pass again; the objects given again, it validates.
    restored = FlashReinforceConfig.from_dict(data)
    with pytest.raises(ConfigError) as err:
        restored.validate()
    assert "pass it again" in str(err.value) and "pass the function again" in str(err.value)
    restored.update_from_dict({"baseline": ShiftedBaseline(), "env_config": {"reward_fn": halves}})
    restored.validate()
    assert restored.serialize() == data


def test_update_from_dict_keeps_the_objects_it_is_not_given():
    baseline = ShiftedBaseline()
    config = FlashReinforceConfig(baseline=baseline).update_from_dict({"lr": 1e-4})
    assert config.baseline is baseline and config.lr == 1e-4


def test_a_learner_spec_with_user_code_round_trips_through_its_plain_form():
    spec = LearnerSpec(model="m", loss=FlashReinforceLossSpec(baseline=f"{USER_MODULE}:ShiftedBaseline"))
    again = LearnerSpec.from_dict(spec.to_dict())
    assert again.loss.component("baseline")(torch.tensor([1.0, 0.0])).tolist() == [0.625, -0.375]


# ------------------------------------------------------------------------------------------------
# the env's user code: Math's reward function, an env entry point


def test_math_reward_fn_by_object_and_by_path():
    import flashrl.envs  # noqa: F401 - registers flashrl/Math-v0

    for reward_fn in (halves, f"{USER_MODULE}:halves"):
        env = gym.make("flashrl/Math-v0", reward_fn=reward_fn)
        env.reset(seed=0)
        _, reward, _, _, info = env.step("abc")
        assert (reward, info["success"], info["correct"], info["reason"]) == (0.5, True, True, "reward_fn")
        env.reset(seed=1)
        assert env.step("ab")[1:2] == (0.0,)
        env.close()


def test_user_code_ships_by_value_to_a_process_that_cannot_import_it(tmp_path):
    """The loss's components (objects, a path, a name registered here) and the env's code (a user entry
    point, Math's reward_fn by path and by object), unpickled and used in one fresh process."""
    loss = FlashReinforceLossSpec(baseline=ShiftedBaseline(), trust_region="none", token_mask=FirstTokenOnly(),
                              aggregation=f"{USER_MODULE}:_TokenSum")
    named = FlashReinforceLossSpec(baseline="test_user_code_plus_one")
    FlashReinforceConfig().environment(ECHO_ID).validate()
    env_spec = runner_env_spec(ECHO_ID)
    assert env_spec.entry_point is EchoEnv  # the user's "module:Class" imported in the driver
    math_spec = runner_spec(FlashReinforceConfig(
        env="flashrl/Math-v0", env_config={"reward_fn": f"{USER_MODULE}:halves", "preset": "easy_sums"},
        evaluation_env_config={"reward_fn": halves}).env_runner_spec())
    assert math_spec.env_config["reward_fn"] is halves
    _as_an_actor(tmp_path, {"loss": loss, "named": named, "echo": env_spec, "math": math_spec}, (
        "import torch\n"
        "loss, named = obj['loss'], obj['named']\n"
        "r = torch.tensor([1.0, 0.0])\n"
        "assert loss.component('baseline')(r).tolist() == [0.625, -0.375]\n"
        "m = loss.component('token_mask')(torch.ones(2, 3, dtype=torch.bool))\n"
        "assert m.tolist() == [[True, False, False]] * 2\n"
        "assert loss.component('aggregation')(torch.ones(2, 3), None, None).item() == 6.0\n"
        f"assert loss.to_dict()['baseline'] == '<object {USER_MODULE}:ShiftedBaseline>'\n"
        "from flashrl.algorithms.flash_reinforce.components import BASELINES\n"
        "assert 'test_user_code_plus_one' not in BASELINES  # not registered in this process\n"
        "assert named.component('baseline')(torch.tensor([1.0, 2.0])).tolist() == [2.0, 3.0]\n"
        "assert named.baseline == 'test_user_code_plus_one'\n"
        "import gymnasium as gym\n"
        "env = gym.make(obj['echo'])\n"
        "env.reset(seed=0)\n"
        "assert env.step('four')[1] == 4.0\n"
        "import flashrl.envs\n"
        "spec = obj['math']\n"
        "env = gym.make(spec.env, **spec.env_config)\n"
        "env.reset(seed=0)\n"
        "assert env.step('abc')[1] == 0.5\n"
        "assert spec.evaluation_env_config['reward_fn']('a', None) == 0.5\n"
    ))


def test_bad_env_user_code_fails_at_validate():
    config = FlashReinforceConfig().environment("flashrl/Math-v0", env_config={"reward_fn": "no_such_mod_q:f"})
    with pytest.raises(ConfigError, match=r"env_config\['reward_fn'\]: expected a callable or its 'module:name' "
                                          r"path .*no_such_mod_q.*Fix:"):
        config.validate()
    config = FlashReinforceConfig().environment("flashrl/Math-v0", env_config={"reward_fn": 3})
    with pytest.raises(ConfigError, match=r"got 3: it is not callable\. Fix:"):
        config.validate()
    lock = threading.Lock()
    config = FlashReinforceConfig().environment("flashrl/Math-v0",
                                                env_config={"reward_fn": lambda reply, task: bool(lock)})
    with pytest.raises(ConfigError, match=r"cannot pickle '_thread.lock'.*Fix:"):
        config.validate()


def test_import_path_errors_say_what_did_not_import():
    with pytest.raises(ValueError, match="expected an import path 'package.module:name', got 'math'"):
        import_path("math")
    assert import_path("flashrl.user_code:import_path") is import_path


STDLIB = ("the path {!r} leads into the standard library (module {!r}), which is refused: a path names a function "
          "or class defined in your own code or in flashrl (write the function in a module of your own and give its "
          "'module:name' path, or pass the object itself)")
INSTALLED = ("the path {!r} leads into the installed package 'sympy' (module {!r}), which a path may name only when "
             "your code trusts it: expected a function or class defined in your own code or in flashrl. Fix: pass the "
             "object itself, write a function of your own that calls it, or call "
             "flashrl.user_code.trust_installed('sympy') in your script if config text may name its code")

REEXPORTS = """
import functools
import os
import subprocess
from os import system
from subprocess import Popen

import sympy
from sympy import S, expand


def score(reply, task):
    \"\"\"The user's own function: it may call anything.\"\"\"
    return float(len(expand(reply).args))


class Scorer:
    def __call__(self, reply, task):
        return 1.0


scorer = Scorer()
table = {}
score_twice = functools.partial(score, task=None)  # the user's own function, partially applied
partial_eval = functools.partial(eval)  # a standard function, however wrapped
"""


@pytest.fixture
def reexports(tmp_path, monkeypatch):
    """A user module (a file outside site-packages) that imports standard and installed code."""
    (tmp_path / "user_code_reexport.py").write_text(REEXPORTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_code_reexport", raising=False)
    yield "user_code_reexport"
    sys.modules.pop("user_code_reexport", None)


@pytest.mark.parametrize(("path", "module"), [
    ("os:system", "os"), ("builtins:eval", "builtins"), ("subprocess:run", "subprocess"), ("math:pi", "math"),
    ("os.path:join", "os.path"), ("_posixsubprocess:fork_exec", "_posixsubprocess"),
    ("flashrl.user_code:os.system", "os"),  # through a module flashrl imports
    ("flashrl.user_code:importlib.import_module", "importlib"),
    ("user_code_reexport:system", "posix"),  # os.system imported into a user module: defined by posix
    ("user_code_reexport:Popen", "subprocess"),
    ("user_code_reexport:os.system", "os"),
    ("user_code_reexport:table.get", "builtins"),  # a bound method of a dict: defined by builtins
    ("user_code_reexport:partial_eval", "builtins"),  # a partial: where its function is defined
])
def test_a_path_into_the_standard_library_is_refused(reexports, path, module):
    with pytest.raises(UserCodeError) as err:
        import_path(path)
    assert str(err.value) == STDLIB.format(path, module)


@pytest.mark.parametrize(("path", "module"), [
    ("sympy:expand", "sympy"),  # as a reward_fn it would eval each model reply as Python, outside the sandbox
    ("sympy.core.function:expand", "sympy.core.function"),
    ("user_code_reexport:expand", "sympy.core.function"),  # a re-export: where it is defined counts
    ("user_code_reexport:S", "sympy.core.singleton"),  # an instance: its class's module (S(text) is sympify)
    ("user_code_reexport:sympy.expand", "sympy"),  # a dotted walk through an installed module
])
def test_a_path_into_an_installed_package_is_refused_unless_the_code_trusts_it(reexports, path, module):
    with pytest.raises(UserCodeError) as err:
        import_path(path)
    assert str(err.value) == INSTALLED.format(path, module)
    import sympy

    assert import_path(path, trusted=("sympy",)) in (sympy.expand, sympy.S)


def test_trust_installed_opts_the_process_in_by_code_only(reexports, monkeypatch):
    import sympy

    from flashrl import user_code

    monkeypatch.setattr(user_code, "_TRUSTED", set())
    with pytest.raises(UserCodeError, match="installed package 'sympy'"):
        import_path("user_code_reexport:expand")
    user_code.trust_installed("sympy")
    assert import_path("user_code_reexport:expand") is sympy.expand
    with pytest.raises(UserCodeError, match="the standard library or flashrl. Fix: paths never name the standard"):
        user_code.trust_installed("os")
    with pytest.raises(UserCodeError, match="expected the top-level name of an installed package"):
        user_code.trust_installed("sympy.core")
    with pytest.raises(UserCodeError, match="leads into the standard library"):
        import_path("os:system", trusted=("os",))  # the standard library is never trusted


def test_the_user_s_own_code_resolves_by_path(reexports):
    assert import_path(f"{reexports}:score")("x + x", None) == 2.0  # 2*x: Mul(2, x)
    module = sys.modules[reexports]
    assert import_path(f"{reexports}:scorer") is module.scorer  # an instance of the user's class
    assert import_path(f"{reexports}:Scorer") is module.Scorer
    assert import_path(f"{reexports}:score_twice")("x") == 0.0  # Symbol x: no args


@pytest.mark.parametrize("attribute", ["score.__globals__", "score.__builtins__", "Scorer.__init__", "scorer.__call__"])
def test_a_dotted_walk_through_a_dunder_is_refused(reexports, attribute):
    with pytest.raises(UserCodeError, match=f"walks through '{attribute.split('.')[1]}'.*Fix: name the function"):
        import_path(f"{reexports}:{attribute}")


def test_an_installed_package_is_refused_before_it_is_imported(tmp_path):
    """Its import-time code never runs: the top-level name is located, not imported."""
    script = ("import sys\n"
              "from flashrl.user_code import UserCodeError, import_path\n"
              "try:\n"
              "    import_path('sympy:expand')\n"
              "except UserCodeError:\n"
              "    pass\n"
              "print('sympy' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, "False"), done.stderr[-3000:]


@pytest.mark.parametrize(("path", "refusal"), [
    ("os:system", "the standard library \\(module 'os'\\), which is refused"),
    ("sympy:expand", "the installed package 'sympy' \\(module 'sympy'\\), which a path may name only when"),
])
def test_validate_refuses_a_reward_fn_path_to_code_that_is_not_the_users(path, refusal):
    import flashrl.envs  # noqa: F401 - registers flashrl/Math-v0

    config = FlashReinforceConfig().environment("flashrl/Math-v0", env_config={"reward_fn": path})
    with pytest.raises(ConfigError, match=r"env_config\['reward_fn'\]: expected a callable or its 'module:name' path "
                       rf"\(user code of flashrl/Math-v0\), got '{path}': the path '{path}' leads into {refusal}"):
        config.validate()
    with pytest.raises(UserCodeError, match=f"the path '{path}' leads into {refusal}"):
        gym.make("flashrl/Math-v0", reward_fn=path)  # the env itself refuses it too


def test_a_reward_fn_given_as_the_object_itself_is_the_users_choice():
    import sympy

    FlashReinforceConfig().environment("flashrl/Math-v0", env_config={"reward_fn": sympy.expand}).validate()


def test_a_script_registering_main_colon_class_ships_the_class(tmp_path):
    """`gym.register(id, entry_point="__main__:Cls")` in the user's script: a runner's __main__ is not the
    script, so the driver resolves the class and ships it by value."""
    script = tmp_path / "user_script.py"
    script.write_text(
        "import cloudpickle, gymnasium as gym\n"
        "from flashrl.env_runners.env_check import runner_env_spec\n"
        "class ScriptEnv(gym.Env):\n"
        "    observation_space = action_space = gym.spaces.Discrete(2)\n"
        "    def reset(self, *, seed=None, options=None):\n"
        "        return 0, {'made_by': 'script'}\n"
        "gym.register('user/ScriptEnv-v0', entry_point='__main__:ScriptEnv')\n"
        "spec = runner_env_spec('user/ScriptEnv-v0')\n"
        "assert spec.entry_point is ScriptEnv, spec.entry_point\n"
        "open('spec.pkl', 'wb').write(cloudpickle.dumps(spec))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    made = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert made.returncode == 0, made.stderr
    loaded = subprocess.run(
        [sys.executable, "-c", ("import pickle, gymnasium as gym\n"
                                "env = gym.make(pickle.load(open('spec.pkl', 'rb')))\n"
                                "print(env.reset()[1]['made_by'])\n")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "script", loaded.stderr


def test_a_registered_env_s_entry_point_in_an_installed_package_resolves_and_nothing_else_there():
    """gymnasium registers CartPole-v1 by code; a config may name it by its id, so its entry point imports.
    Another path into gymnasium is still the installed package's code, refused."""
    entry = gym.spec("CartPole-v1").entry_point
    assert entry == "gymnasium.envs.classic_control.cartpole:CartPoleEnv"
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv

    assert import_path(entry) is CartPoleEnv
    assert runner_env_spec("CartPole-v1").entry_point == entry  # an installed package's: stays a string
    with pytest.raises(UserCodeError, match="leads into the installed package 'gymnasium'"):
        import_path("gymnasium.envs.classic_control.cartpole:CartPoleEnv.np_random")
    with pytest.raises(UserCodeError, match="leads into the installed package 'gymnasium'"):
        import_path("gymnasium:make")
