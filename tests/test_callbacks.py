"""flashrl.callbacks without Ray: the metrics logger's reductions, resolving the setting, its checks."""

from __future__ import annotations

import math

import pytest
from ray import cloudpickle

from flashrl.algorithms import FlashReinforceConfig
from flashrl.algorithms.flash_reinforce.config import ConfigError
from flashrl.callbacks import (
    DefaultCallbacks,
    FlashReinforceCallbacks,
    MetricsLogger,
    callbacks_class_path,
    make_callbacks,
    resolve_callbacks_class,
    ship_by_value,
)


class Mine(FlashReinforceCallbacks):
    pass


def test_metrics_logger_reduces_each_key_and_starts_empty():
    logger = MetricsLogger()
    for value in (1, 2, 6):
        logger.log_value("a", value)  # mean
    logger.log_value("s", 2, reduce="sum")
    logger.log_value("s", True, reduce="sum")  # a bool counts 1
    logger.log_dict({"lo": 3.0, "hi": 3.0}, reduce="min")
    logger.log_value("lo", -1.5, reduce="min")
    assert logger.peek("a") == 3.0 and len(logger) == 4
    assert logger.reduce("callbacks/") == {"callbacks/a": 3.0, "callbacks/s": 3.0, "callbacks/lo": -1.5,
                                           "callbacks/hi": 3.0}
    assert logger.reduce() == {} and len(logger) == 0


def test_metrics_logger_merges_another_process_state():
    runner, driver = MetricsLogger(), MetricsLogger()
    runner.log_value("calls", 4, reduce="max")
    runner.log_value("calls", 7, reduce="max")
    driver.log_value("calls", 5, reduce="max")
    driver.merge(cloudpickle.loads(cloudpickle.dumps(runner.state())))  # as it travels in a RunnerReport
    assert driver.reduce() == {"calls": 7.0}
    assert runner.peek("calls") == 7.0  # state() does not clear


def test_metrics_logger_refuses_bad_values_with_the_fix():
    logger = MetricsLogger()
    with pytest.raises(ValueError, match="expected a finite number, got nan"):
        logger.log_value("x", math.nan)
    with pytest.raises(ValueError, match="expected a finite number, got 'high'"):
        logger.log_value("x", "high")
    with pytest.raises(ValueError, match="expected reduce in"):
        logger.log_value("x", 1.0, reduce="median")
    logger.log_value("x", 1.0, reduce="sum")
    with pytest.raises(ValueError, match="expected reduce='sum' \\(the key's first reduction\\), got 'mean'"):
        logger.log_value("x", 1.0)
    with pytest.raises(TypeError, match="non-empty str key"):
        logger.log_value("", 1.0)


def test_resolve_by_class_or_import_path():
    assert resolve_callbacks_class(None) is FlashReinforceCallbacks is DefaultCallbacks
    assert resolve_callbacks_class(Mine) is Mine
    assert resolve_callbacks_class("flashrl.callbacks:DefaultCallbacks") is FlashReinforceCallbacks
    assert resolve_callbacks_class("flashrl.callbacks.FlashReinforceCallbacks") is FlashReinforceCallbacks
    assert isinstance(make_callbacks(Mine), Mine)
    with pytest.raises(TypeError, match="expected None, a subclass of flashrl.callbacks.FlashReinforceCallbacks"):
        resolve_callbacks_class(dict)
    with pytest.raises(ValueError, match="the module 'no_such_module_xyz' of 'no_such_module_xyz:Callbacks' does "
                       "not import .*Fix: check the path"):
        resolve_callbacks_class("no_such_module_xyz:Callbacks")
    with pytest.raises(ValueError, match="'flashrl.callbacks' has no attribute 'Nope'"):
        resolve_callbacks_class("flashrl.callbacks:Nope")
    # A path names flashrl's or the user's own code (flashrl.user_code), never an installed or standard
    # module's, re-exports included: this module imports pytest, whose classes are not callbacks of ours.
    with pytest.raises(ValueError, match="callbacks_class: .*leads into the installed package 'pytest'"):
        resolve_callbacks_class(f"{__name__}:pytest.Item")
    with pytest.raises(ValueError, match="callbacks_class: .*leads into the standard library"):
        resolve_callbacks_class("collections:OrderedDict")


def test_the_config_takes_the_class_and_validate_rejects_a_wrong_one(tiny_llama_path):
    config = FlashReinforceConfig().environment("flashrl/Math-v0").training(model=tiny_llama_path)
    assert config.callbacks(Mine) is config and config.callbacks_class is Mine
    config.validate()
    assert config.to_dict()["callbacks_class"] is Mine and config.copy().callbacks_class is Mine
    assert config.env_runner_spec().callbacks_class is Mine  # the runners build their own instance
    config.callbacks("flashrl.callbacks:nothing_here")
    with pytest.raises(ConfigError, match="callbacks_class: .*'flashrl.callbacks' has no attribute 'nothing_here'"):
        config.validate()
    with pytest.raises(TypeError, match="callbacks\\(\\) got an unexpected keyword argument 'lr'"):
        config.callbacks(Mine, lr=1.0)


def test_checkpoints_keep_the_import_path_which_resolves_again():
    path = callbacks_class_path(Mine)
    assert path == f"{__name__}:Mine" and callbacks_class_path(None) is None
    assert callbacks_class_path("pkg.mod:Cls") == "pkg.mod:Cls"
    assert resolve_callbacks_class(path) is Mine


def test_a_class_outside_flashrl_is_registered_to_pickle_by_value():
    from ray.cloudpickle import cloudpickle as impl

    ship_by_value(Mine)
    assert __name__ in impl._PICKLE_BY_VALUE_MODULES
    ship_by_value(FlashReinforceCallbacks)  # flashrl's own classes travel by reference
    assert "flashrl.callbacks" not in impl._PICKLE_BY_VALUE_MODULES
    # By value: the bytes rebuild the class itself (cloudpickle's skeleton class), not an import of it.
    assert b"_make_skeleton_class" in cloudpickle.dumps(Mine)
    assert b"_make_skeleton_class" not in cloudpickle.dumps(FlashReinforceCallbacks)
