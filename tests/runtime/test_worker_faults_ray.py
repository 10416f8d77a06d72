"""On a real Ray cluster: an EnvRunner killed with SIGKILL mid-run is replaced and the books balance; an
env error that repeats stops the run at once with its traceback; ``stop()`` after either does not raise."""

from __future__ import annotations

import os
import re
import signal
import sys

import gymnasium as gym
import pytest
import ray
from ray import cloudpickle

from flashrl.env_runners import EnvRunnerGroupError
from flashrl.env_runners.env_check import CHECK_ACTION

from .conftest import ParityEnv
from .test_books import unbalanced

pytestmark = pytest.mark.ray


def _score(row: dict[str, str], reply: str) -> float:
    return float(reply == row["answer"])  # the user's bug: the row has no "answer"


class ReplyKeyErrorEnv(ParityEnv):
    """Scores the env check's reply, then raises KeyError on every model reply (a bug the check cannot see)."""

    def _step_action(self, action: str):
        if action == CHECK_ACTION:
            return [], 0.0, True, False, {}
        return [], _score({"question": "1+1"}, action), True, False, {}


if "flashrl-test/ReplyKeyError-v0" not in gym.registry:
    gym.register("flashrl-test/ReplyKeyError-v0", entry_point=ReplyKeyErrorEnv)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


@pytest.mark.timeout(600)
def test_a_runner_killed_with_sigkill_mid_run_is_replaced_and_the_books_balance(ray_session, tiny_config):
    algo = tiny_config(env="flashrl-test/Parity-v0", tensorboard=False, console_every=0).build_algo()
    try:
        first = algo.train()
        assert first["env_runners/num_restarts_lifetime"] == 0
        os.kill(_pid(algo.env_runner_group.actors[0]), signal.SIGKILL)  # mid-run: its episodes are in flight
        results = [algo.train() for _ in range(2)]
        last = results[-1]
        assert last["env_runners/num_restarts_lifetime"] == 1
        assert [r["training_iteration"] for r in results] == [2, 3]
        assert unbalanced(last) == 0  # started = trained + pending + skipped + lost + in flight
    finally:
        algo.stop()  # no raise


@pytest.mark.timeout(600)
def test_the_same_env_error_in_a_row_stops_the_run_with_its_traceback(ray_session, tiny_config):
    algo = tiny_config(env="flashrl-test/ReplyKeyError-v0", tensorboard=False, console_every=0).build_algo()
    try:
        with pytest.raises(EnvRunnerGroupError) as caught:
            algo.train()
    finally:
        algo.stop()  # no raise
    text = str(caught.value)
    assert "EnvRunner 0 stopped the run: the same environment error ended 20 episodes in a row" in text
    assert re.search(r"env 'flashrl-test/ReplyKeyError-v0', episode \d+, prompt id 'parity-\d+'", text)
    assert "KeyError: 'answer'" in text and 'return float(reply == row["answer"])' in text
    assert "sample_timeout_s" not in text
