"""A baseline and a reward function defined in this file train through real actors: two data-parallel
learner actors and two EnvRunner actors, which cannot import this file.

The file stands for a user's script: it is renamed below so that no process but this one can import it
by name (Ray puts the driver's working folder, the repository, on every worker's path, where the file's
pytest name would import); the test checks that inside an actor first.
"""

from __future__ import annotations

import sys

import pytest

USER_MODULE = "flashrl_test_user_script_actors"
sys.modules[USER_MODULE] = sys.modules[__name__]
__name__ = USER_MODULE  # the code below gets this module name, importable nowhere else

pytestmark = pytest.mark.ray

SHIFT = 0.125
LOW, HIGH = 0.1, 0.2


class ShiftedBaseline:
    """batch_mean plus SHIFT: the learners' advantage mean is SHIFT exactly when this baseline ran."""

    def __call__(self, rewards, *, group_ids=None):
        return rewards - rewards.mean() + SHIFT


def parity_reward(reply, task):
    """HIGH for a reply of odd length, else LOW: rewards the math verifier never gives (it gives 0 or 1)."""
    return HIGH if len(reply) % 2 else LOW


def _importable_in_an_actor(name: str) -> bool:
    import ray

    @ray.remote(num_cpus=0.1)
    def probe(module: str) -> bool:
        import importlib.util

        return importlib.util.find_spec(module) is not None

    return ray.get(probe.remote(name), timeout=300)


def test_a_baseline_and_a_reward_from_the_users_file_train_on_two_learners_and_two_runners(ray_session,
                                                                                            tiny_config):
    assert not _importable_in_an_actor(USER_MODULE)
    config = tiny_config(
        env_config={"preset": "easy_sums", "reward_fn": parity_reward},
        baseline=ShiftedBaseline(),
        num_env_runners=2,
        num_cpus_per_env_runner=0.5,
        num_learners=2,
        num_cpus_per_learner=0.5,
        tensorboard=False,
        console_every=0,
    )
    algo = config.build_algo()
    try:
        results = [algo.train() for _ in range(2)]
    finally:
        algo.stop()
    for r in results:
        assert r["learners/applied"] == 1.0
        assert r["learners/advantage_mean"] == pytest.approx(SHIFT, abs=1e-6)  # the user's baseline ran
        assert LOW - 1e-6 <= r["learners/reward_mean"] <= HIGH + 1e-6  # the user's reward ran in the runners
    assert results[-1]["learners/version"] == 2
