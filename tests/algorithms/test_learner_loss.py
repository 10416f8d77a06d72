"""FlashReinforceLossSpec, the learner's loss hook: its settings are checked, and it comes from the config."""

from __future__ import annotations

import math

import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
from flashrl.learners import Loss


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"delta": -0.1}, "delta"),
        ({"delta": float("nan")}, "delta"),
        ({"baseline": "no_such_baseline"}, "baseline"),
        ({"trust_region": "ppo_clip"}, "trust_region"),
        ({"aggregation": "sum"}, "aggregation"),
        ({"negative_token_fraction": 1.5}, "negative_token_fraction"),
        ({"negative_token_fraction": -0.1}, "negative_token_fraction"),
        ({"importance_sampling": "sequence"}, "importance_sampling"),
        ({"aggregation": "constant_length"}, "constant_length_normalizer"),
        ({"constant_length_normalizer": 0}, "constant_length_normalizer"),
    ],
)
def test_rejects_impossible_settings_naming_field_expected_and_actual(overrides, field):
    with pytest.raises(ValueError, match=rf"Invalid FlashReinforceLossSpec:(\n  - .*)*\n  - {field}: expected .+, got "):
        FlashReinforceLossSpec(**overrides)


def test_the_config_builds_the_loss_with_the_resolved_baseline():
    config = (FlashReinforceConfig().environment("flashrl/Math-v0")
              .training(train_batch_size=8, delta=math.inf, negative_token_fraction=0.2, trust_region="tv",
                        rollout_mode="sync_group", group_size=4))
    loss = config.build_loss()
    assert isinstance(loss, Loss) and loss.needs_entropy
    assert loss == FlashReinforceLossSpec(delta=math.inf, negative_token_fraction=0.2, trust_region="tv",
                                      baseline="group_mean")
