"""Deterministic setting errors fail in the driver, in seconds, before Ray or an engine starts."""

from __future__ import annotations

import time
import warnings

import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.algorithms.flash_reinforce import algorithm as algorithm_module
from flashrl.algorithms.flash_reinforce.config import ConfigError
from flashrl.env_runners.env_check import EnvCheckError, build_env_once


def _math(**env_config):
    return FlashReinforceConfig().environment("flashrl/Math-v0", env_config={"preset": "easy_sums", **env_config})


def test_a_misspelt_env_config_key_fails_validate_naming_it():
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"env_config: expected keyword arguments of flashrl/Math-v0's constructor "
                                          r"\(.*preset.*\), got 'presset'\. Fix: did you mean 'preset'\?"):
        FlashReinforceConfig().environment("flashrl/Math-v0", env_config={"presset": "easy_sums"}).validate()
    assert time.perf_counter() - start < 10


def test_evaluation_overrides_and_splits_are_checked_too():
    config = _math().evaluation(evaluation_env_config={"sed": 1}, evaluation_splits={"held": {"difficulti": 2}})
    with pytest.raises(ConfigError) as err:
        config.validate()
    text = str(err.value)
    assert "evaluation_env_config: expected keyword arguments" in text and "got 'sed'" in text
    assert "evaluation_splits['held']: expected keyword arguments" in text and "did you mean 'difficulty'?" in text


def test_an_env_that_cannot_be_built_is_an_error_naming_the_setting_and_the_cause():
    with pytest.raises(EnvCheckError, match=r"env_config: expected settings with which flashrl/PythonTool-v0 can be "
                                            r"built, got .*'sandbox': \{'a': 1\}.*AttributeError"):
        build_env_once("flashrl/PythonTool-v0", {"preset": "easy_sums", "sandbox": {"a": 1}})
    with pytest.raises(EnvCheckError, match=r"expected settings with which flashrl/Math-v0 can be built.*preset"):
        build_env_once("flashrl/Math-v0", {"preset": "no_such_preset"})


def test_setup_fails_before_ray_starts(monkeypatch):
    started = []
    monkeypatch.setattr("flashrl.ray_utils.init_or_join", lambda *a, **k: started.append(1))
    bad_env = _math(difficulty="hard").env_runners(engine="torch")
    with pytest.raises(EnvCheckError, match="difficulty"):
        algorithm_module.FlashReinforce(config=bad_env)
    bad_model = _math().env_runners(engine="torch").training(model="no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        algorithm_module.FlashReinforce(config=bad_model)
    assert started == []


def test_delta_zero_warns():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _math().training(delta=0.0).validate()
        _math().training(delta=0.0, trust_region="none").validate()
    messages = [str(w.message) for w in caught if "delta=0" in str(w.message)]
    assert len(messages) == 1 and "rejects every trajectory" in messages[0]



def test_a_runner_error_that_repeats_stops_the_run_instead_of_a_restart():
    from ray.exceptions import RayActorError, RayTaskError

    from flashrl.env_runners import EnvRunnerGroup, EnvRunnerGroupError
    from flashrl.env_runners.group import REPEATED_ERROR_LIMIT

    group = EnvRunnerGroup.__new__(EnvRunnerGroup)  # the bookkeeping only: no actors
    group._repeats = None

    def task_error(text: str) -> RayTaskError:
        return RayTaskError("EnvRunner.poll", "Traceback ...", ValueError(text))

    # Deaths (killed, out of memory) are restarted however often; an error in between resets the streak.
    for _ in range(5):
        group._stop_on_a_repeated_error(0, RayActorError(actor_init_failed=False))
    group._stop_on_a_repeated_error(0, task_error("env reset failed"))
    group._stop_on_a_repeated_error(0, task_error("another error"))
    for _ in range(REPEATED_ERROR_LIMIT - 1):
        group._stop_on_a_repeated_error(1, task_error("env reset failed"))
    with pytest.raises(EnvRunnerGroupError, match=rf"EnvRunner 1 failed with the same error {REPEATED_ERROR_LIMIT} "
                                                  r"times in a row: ValueError: env reset failed\. .*Fix it"):
        group._stop_on_a_repeated_error(1, task_error("env reset failed"))
    # An actor whose constructor raised is deterministic too.
    group._repeats = None
    for _ in range(REPEATED_ERROR_LIMIT - 1):
        group._stop_on_a_repeated_error(0, RayActorError(actor_init_failed=True, error_msg="init"))
    with pytest.raises(EnvRunnerGroupError):
        group._stop_on_a_repeated_error(0, RayActorError(actor_init_failed=True, error_msg="init"))
