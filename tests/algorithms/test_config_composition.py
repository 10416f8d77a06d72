"""The config is composed of the core's specs: each setting declared in exactly one class, the flat
names kept, the parts built from them exactly, and bad values reported by the part that owns them."""

from __future__ import annotations

import dataclasses
import math

import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.algorithms.flash_reinforce.config import _PARTS, ConfigError, FlashReinforceAlgorithmSpec
from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
from flashrl.env_runners.spec import EnvRunnerSpec
from flashrl.learners.spec import LearnerSpec
from flashrl.validation import DERIVED, SpecError

SPECS = (EnvRunnerSpec, LearnerSpec, FlashReinforceLossSpec, FlashReinforceAlgorithmSpec)


def test_every_setting_is_declared_in_exactly_one_class():
    assert [cls for cls, _ in _PARTS.values()] == list(SPECS)
    declared: dict[str, list[str]] = {}
    for cls in SPECS:
        for f in dataclasses.fields(cls):
            if DERIVED not in f.metadata:  # filled in when the config builds the spec, not a setting
                declared.setdefault(f.name, []).append(cls.__name__)
    twice = {name: owners for name, owners in declared.items() if len(owners) > 1}
    assert not twice
    assert sorted(declared) == sorted(FlashReinforceConfig.setting_names())
    # The config class itself declares no setting of its own: it only holds the parts.
    assert not dataclasses.is_dataclass(FlashReinforceConfig)


def test_derived_fields_are_filled_from_the_settings_they_name():
    derived = {f.name for f in dataclasses.fields(LearnerSpec) if DERIVED in f.metadata}
    assert derived == {"temperature", "seed", "device", "loss", "routing_replay", "log_level"}
    config = FlashReinforceConfig().env_runners(temperature=0.7).debugging(seed=5, log_level="INFO").training(
        delta=0.003, routing_replay=True)
    spec = config.learner_spec(model="folder")
    assert (spec.temperature, spec.seed, spec.model, spec.device, spec.log_level) == (0.7, 5, "folder", "auto", "INFO")
    assert spec.routing_replay is config.env_runner_spec(env="flashrl/Math-v0").routing_replay is True
    assert spec.loss == FlashReinforceLossSpec(delta=0.003, baseline="batch_mean")


def test_the_parts_hold_exactly_the_settings():
    config = (FlashReinforceConfig().environment("flashrl/Math-v0", env_config={"preset": "easy_sums"})
              .env_runners(num_env_runners=2, top_k=3).learners(num_learners=2, optimizer_offload=True)
              .training(lr=3e-6, adam_eps=1e-7, train_batch_size=8, negative_token_fraction=0.9,
                        rollout_mode="sync_group", group_size=4)
              .evaluation(evaluation_interval=5, evaluation_top_p=0.7))
    runners = config.env_runner_spec()
    assert (runners.num_env_runners, runners.top_k, runners.train_batch_size, runners.evaluation_top_p) == (2, 3, 8, 0.7)
    learners = config.learner_spec()
    assert (learners.lr, learners.adam_eps, learners.num_learners, learners.optimizer_offload) == (3e-6, 1e-7, 2, True)
    assert learners.loss.negative_token_fraction == 0.9 and learners.loss.baseline == "group_mean"
    settings = config.algorithm_settings()
    assert (settings.rollout_mode, settings.group_size, settings.evaluation_interval) == ("sync_group", 4, 5)
    # Every setting reads back by its flat name, and to_dict/from_dict round-trip them.
    again = FlashReinforceConfig.from_dict(config.to_dict())
    assert again == config and again.adam_eps == 1e-7 and again.env_config == {"preset": "easy_sums"}


def test_a_builder_takes_only_its_sections_settings():
    with pytest.raises(TypeError, match=r"'num_env_runners': it is set by \.env_runners\(\)"):
        FlashReinforceConfig().training(num_env_runners=2)
    with pytest.raises(TypeError, match=r"'lerning_rate': no such setting"):
        FlashReinforceConfig().training(lerning_rate=2)
    with pytest.raises(AttributeError, match=r"has no setting 'detla' \(did you mean 'delta'\?\)"):
        FlashReinforceConfig().detla = 1  # type: ignore[attr-defined]


def test_a_search_space_may_stand_in_for_a_value_until_validate():
    from ray import tune

    config = FlashReinforceConfig().environment("flashrl/Math-v0").training(delta=tune.grid_search([0.01, 0.05]))
    assert config.to_dict()["delta"] == {"grid_search": [0.01, 0.05]}
    with pytest.raises(ConfigError, match=r"delta: expected a number >= 0"):
        config.validate()


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (EnvRunnerSpec, {"env": "x", "temperature": 0.0}, "temperature: expected a finite number > 0, got 0.0"),
        (EnvRunnerSpec, {"env": "x", "max_new_tokens": 64, "max_episode_tokens": 64},
         "max_new_tokens: expected less than max_episode_tokens (64), got 64"),
        (LearnerSpec, {"lr": math.nan}, "lr: expected a finite number > 0, got nan"),
        (LearnerSpec, {"optimizer_offload": "yes"}, "optimizer_offload: expected True or False"),
        (FlashReinforceLossSpec, {"aggregation": "constant_length"},
         "constant_length_normalizer: expected an integer >= 1 with aggregation='constant_length'"),
        (FlashReinforceAlgorithmSpec, {"rollout_mode": "sync"}, "rollout_mode: expected one of ('async', 'sync_group')"),
    ],
)
def test_each_part_checks_its_own_settings(cls, kwargs, message):
    with pytest.raises(SpecError) as err:
        cls(**kwargs)
    assert err.value.owner == cls.__name__
    assert any(problem.startswith(message) and "Fix: " in problem for problem in err.value.problems)


def test_offload_without_sharded_learners_is_refused_by_the_config():
    with pytest.raises(ConfigError, match=r"optimizer_offload: expected False, or True with num_learners >= 2"):
        FlashReinforceConfig().environment("flashrl/Math-v0").learners(optimizer_offload=True, num_learners=1).validate()


def test_validate_lists_the_problems_of_every_part_once():
    config = (FlashReinforceConfig().environment("flashrl/Math-v0")
              .env_runners(top_p=2.0).training(lr=-1.0, delta=-1.0, rollout_mode="nope"))
    with pytest.raises(ConfigError) as err:
        config.validate()
    lines = str(err.value).splitlines()[1:]
    assert [line.split(":")[0].strip(" -") for line in lines] == ["top_p", "lr", "delta", "rollout_mode"]
