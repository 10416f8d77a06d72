"""EnvRunnerSpec: read from the algorithm config by field name, frozen, round-trips, rejects bad input."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.env_runners import EnvRunner, EnvRunnerGroup, EnvRunnerSpec


def _config() -> FlashReinforceConfig:
    return (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0", env_config={"preset": "arithmetic"})
        .env_runners(num_env_runners=3, num_cpus_per_env_runner=0.5, engine="torch",
                     engine_options={"dtype": "float32"}, episodes_in_flight_per_env_runner=6,
                     async_queue_size=2, temperature=0.9, top_p=0.95, top_k=5, max_new_tokens=17,
                     max_episode_tokens=300, max_num_env_runner_restarts=7, sample_timeout_s=12.0)
        .training(train_batch_size=12)
        .evaluation(evaluation_num_episodes=9, evaluation_temperature=0.7, evaluation_top_p=0.7,
                    evaluation_env_config={"order": "sequential"},
                    evaluation_splits={"seen": {"split": "valid_seen"}},
                    evaluation_datasource_key="datasource")
        .debugging(seed=11, log_level="INFO")
    )


def test_every_field_is_the_config_field_of_the_same_name():
    config = _config()
    spec = config.env_runner_spec()
    names = [f.name for f in dataclasses.fields(EnvRunnerSpec)]
    config_names = set(FlashReinforceConfig.setting_names())
    # A spec field the config lacks would silently keep its default in every run.
    assert set(names) <= config_names, sorted(set(names) - config_names)
    for name in names:
        assert getattr(spec, name) == getattr(config, name), name
    assert (spec.num_env_runners, spec.async_queue_size, spec.train_batch_size, spec.seed) == (3, 2, 12, 11)
    assert spec.evaluation_splits == {"seen": {"split": "valid_seen"}}


def test_max_buffered_episodes_defaults_to_the_episodes_in_flight():
    spec = _config().env_runner_spec()
    assert spec.max_buffered_episodes == 6
    spec = _config().env_runners(max_buffered_episodes_per_env_runner=2).env_runner_spec()
    assert spec.max_buffered_episodes == 2


def test_overrides_win_and_the_spec_owns_its_dicts():
    config = _config()
    spec = config.env_runner_spec(num_env_runners=1, seed=5)
    assert (spec.num_env_runners, spec.seed) == (1, 5)
    config.env_config["preset"] = "easy_sums"  # a later change to the config does not reach the spec
    assert spec.env_config == {"preset": "arithmetic"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 3  # type: ignore[misc]


def test_round_trips_through_a_dict_and_pickle():
    spec = _config().env_runner_spec()
    data = spec.to_dict()
    assert EnvRunnerSpec.from_dict(data) == spec
    data["env_config"]["preset"] = "x"  # to_dict copies
    assert spec.env_config["preset"] == "arithmetic"
    assert pickle.loads(pickle.dumps(spec)) == spec  # how it reaches the actors


def test_bad_input_says_what_was_expected():
    with pytest.raises(ValueError, match=r"Unknown EnvRunnerSpec fields \['lr'\]"):
        EnvRunnerSpec.from_dict({"env": "flashrl/Math-v0", "lr": 1e-6})
    with pytest.raises(ValueError, match=r"episodes_in_flight_per_env_runner: expected an integer >= 1, got 0\. Fix:"):
        EnvRunnerSpec(env="flashrl/Math-v0", episodes_in_flight_per_env_runner=0)
    with pytest.raises(ValueError, match=r"Invalid EnvRunnerSpec:\n  - temperature: expected a finite number > 0"):
        EnvRunnerSpec(env="flashrl/Math-v0", temperature=0.0)
    with pytest.raises(ValueError, match=r"env: expected a registered Gymnasium id"):
        EnvRunnerSpec(env="")


def test_the_runners_take_a_spec_not_a_config_dict():
    config = _config()
    with pytest.raises(TypeError, match=r"expected an EnvRunnerSpec, got dict.*env_runner_spec"):
        EnvRunner(config.to_dict(), runner_index=0, num_runners=1, model_path="unused")
    with pytest.raises(TypeError, match=r"expected an EnvRunnerSpec, got FlashReinforceConfig"):
        EnvRunnerGroup(config, model_path="unused")


@pytest.mark.parametrize("seed", [2**70, -1, 1.0])
def test_a_seed_outside_what_torch_takes_is_refused(seed):
    from flashrl.algorithms.flash_reinforce.config import ConfigError

    with pytest.raises(ConfigError, match=r"seed: expected an integer in \[0, 18446744073709551616\) \(2\*\*64: the range "
                       rf"torch\.manual_seed takes\), got {seed!r}\. Fix: use a seed below 2\*\*64, e\.g\. 0"):
        _config().debugging(seed=seed).validate()


def test_the_seed_bound_is_the_one_torch_takes():
    import torch

    from flashrl.algorithms.flash_reinforce.config import ConfigError

    assert _config().debugging(seed=2**64 - 1).env_runner_spec().seed == 2**64 - 1
    torch.manual_seed(2**64 - 1)  # the learners seed torch with the run's seed as it is
    with pytest.raises(ValueError, match="Overflow"):
        torch.manual_seed(2**64)
    with pytest.raises(ConfigError, match=r"seed: expected an integer in \[0, 18446744073709551616\)"):
        _config().debugging(seed=2**64).validate()
