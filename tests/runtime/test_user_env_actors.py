"""An env given as a class or as the "module:Class" path of a user's module trains through a Ray actor run,
though the EnvRunner actors cannot import that module: the class reaches them by value."""

from __future__ import annotations

import sys
import textwrap

import gymnasium as gym
import pytest

pytestmark = pytest.mark.ray

MODULE = "flashrl_test_user_env_actors_module"
REWARD = 0.625
"""The user's env pays it for any reply: a reward mean no flashrl env gives (Math gives 0 or 1)."""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of the user's own, on the driver's path only."""
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(f"""
        from flashrl.envs.base import LanguageEnv

        class FlatEnv(LanguageEnv):
            def __init__(self):
                super().__init__(max_turns=1)

            def _reset_task(self, options):
                task = int(self.np_random.integers(1000))
                return [{{"role": "user", "content": f"Task {{task}}: say anything."}}], {{"prompt_id": f"flat-{{task}}"}}

            def _step_action(self, action):
                return [], {REWARD}, True, False, {{}}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield MODULE
    sys.modules.pop(MODULE, None)
    gym.registry.pop(f"{MODULE}.FlatEnv", None)


def _importable_in_an_actor(name: str) -> bool:
    import ray

    @ray.remote(num_cpus=0.1)
    def probe(module: str) -> bool:
        import importlib.util

        return importlib.util.find_spec(module) is not None

    return ray.get(probe.remote(name), timeout=300)


@pytest.mark.parametrize("given", ["class", "path"])
def test_an_env_class_or_its_path_trains_in_runner_actors_that_cannot_import_it(ray_session, tiny_config,
                                                                                 user_module, given):
    import importlib

    assert not _importable_in_an_actor(user_module)
    env = importlib.import_module(user_module).FlatEnv if given == "class" else f"{user_module}:FlatEnv"
    config = tiny_config(env=env, tensorboard=False, console_every=0)
    algo = config.build_algo()
    try:
        result = algo.train()
    finally:
        algo.stop()
    assert result["learners/version"] == 1
    assert result["learners/reward_mean"] == pytest.approx(REWARD)  # the user's env ran in the runner
