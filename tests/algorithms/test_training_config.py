"""The training fields of FlashReinforceConfig that select the loss options, the optimizer and the schedule.

Each is checked by validate() (expected, actual, fix) and reaches the learner's LearnerSpec unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashrl.algorithms import FlashReinforceConfig
from flashrl.algorithms.flash_reinforce.config import ConfigError
from flashrl.learners import LearnerSpec


def _valid() -> FlashReinforceConfig:
    return FlashReinforceConfig().environment("flashrl/Math-v0").training(train_batch_size=8)


def test_the_reference_options_validate_and_reach_the_learner_spec():
    config = _valid().training(
        delta=math.inf, negative_token_fraction=0.2, importance_sampling="none", aggregation="constant_length",
        constant_length_normalizer=6144, trust_region="tv", lr_schedule="cosine_with_min_lr", lr_warmup_ratio=0.03,
        min_lr_ratio=0.1, total_updates=200, betas=(0.9, 0.95), adam_eps=1e-6, weight_decay=0.1,
    )
    config.validate()
    spec = config.learner_spec(model="m")  # what FlashReinforce.setup() builds
    loss = spec.loss  # the algorithm's settings travel in its loss hook
    assert (loss.delta, loss.negative_token_fraction, loss.importance_sampling) == (math.inf, 0.2, "none")
    assert (loss.aggregation, loss.constant_length_normalizer, loss.trust_region) == ("constant_length", 6144, "tv")
    assert (spec.lr_schedule, spec.lr_warmup_ratio, spec.min_lr_ratio, spec.total_updates) == (
        "cosine_with_min_lr", 0.03, 0.1, 200)
    assert (spec.betas, spec.adam_eps, spec.weight_decay) == ((0.9, 0.95), 1e-6, 0.1)
    assert FlashReinforceConfig.from_dict(config.to_dict()) == config


def test_grpo_is_expressible_as_components():
    # The reference's grpo variants: G rollouts per prompt, (R - mean) / (std + eps), no behavior
    # correction, no trust region, token mean, one pass.
    config = _valid().training(
        rollout_mode="sync_group", group_size=4, train_batch_size=32, baseline="group_norm",
        importance_sampling="none", trust_region="none", aggregation="token_mean",
    )
    with pytest.warns(UserWarning, match="comparison baseline"):
        config.validate()
    assert config.prompts_per_batch == 8


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"delta": -1.0}, "delta: expected a number >= 0 (math.inf = no trust region), got -1.0"),
        ({"delta": float("nan")}, "delta: expected a number >= 0 (math.inf = no trust region), got nan"),
        ({"negative_token_fraction": 1.5}, "negative_token_fraction: expected a number in [0, 1], got 1.5"),
        ({"importance_sampling": "sequence"}, "importance_sampling: expected one of ['none', 'token']"),
        ({"trust_region": "kl"}, "trust_region: expected one of ['bernoulli_kl', 'bernoulli_kl_exact', 'none', 'tv']"),
        ({"aggregation": "constant_length"}, "constant_length_normalizer: expected an integer >= 1 with"),
        ({"constant_length_normalizer": 0}, "constant_length_normalizer: expected None or an integer >= 1"),
        ({"lr_schedule": "cosine_with_min_lr"}, "total_updates: expected the run's number of updates"),
        ({"lr_schedule": "linear"}, "lr_schedule: expected one of ('constant', 'cosine_with_min_lr')"),
        ({"lr_warmup_ratio": 0.03}, "lr_warmup_ratio: expected 0.0 with lr_schedule='constant'"),
        ({"lr_schedule": "cosine_with_min_lr", "total_updates": 10, "min_lr_ratio": 2.0},
         "min_lr_ratio: expected a number in [0, 1], got 2.0"),
        ({"total_updates": 0}, "total_updates: expected None or an integer >= 1, got 0"),
        ({"adam_eps": 0.0}, "adam_eps: expected a finite number > 0, got 0.0"),
        ({"baseline": "group_norm"}, "baseline: expected a per-batch baseline in 'async' mode"),
        ({"baseline": "group_norm", "rollout_mode": "sync_group", "group_size": 1},
         "group_size: expected >= 2 with the 'group_norm' baseline"),
    ],
)
def test_validate_says_expected_actual_and_fix(change, needle):
    config = FlashReinforceConfig.from_dict(_valid().to_dict() | change)
    with pytest.raises(ConfigError) as info:
        config.validate()
    message = str(info.value)
    assert needle in message
    assert "Fix:" in message



def test_every_learner_setting_comes_from_the_config():
    # LearnerSpec fields the config lacks are derived (the device, the loss) or the learner's own;
    # every field of the loss hook is a config field of the same name.
    import dataclasses

    from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec

    config = _valid().training(rollout_mode="sync_group", group_size=4, adam_eps=1e-7).learners(
        max_tokens_per_micro_batch=4096, pack_sequences=True)
    spec = config.learner_spec(model="m")
    names = set(FlashReinforceConfig.setting_names())
    assert {f.name for f in dataclasses.fields(LearnerSpec)} - names == {"device", "loss"}
    assert {f.name for f in dataclasses.fields(FlashReinforceLossSpec)} <= names
    assert (spec.model, spec.loss.baseline, spec.adam_eps, spec.device) == ("m", "group_mean", 1e-7, "auto")
    assert (spec.max_tokens_per_micro_batch, spec.pack_sequences, spec.optimizer_offload) == (4096, True, False)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"max_tokens_per_micro_batch": 0}, "max_tokens_per_micro_batch: expected None (one pass per learner) or"),
        ({"pack_sequences": "yes"}, "pack_sequences: expected None (auto), True or False"),
        ({"optimizer_offload": True}, "optimizer_offload: expected False, or True with num_learners >= 2"),
    ],
)
def test_learner_fields_are_validated(change, needle):
    config = FlashReinforceConfig.from_dict(_valid().to_dict() | change)
    with pytest.raises(ConfigError, match="Fix:") as info:
        config.validate()
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("dtype", "runners", "training", "expected"),
    [
        ("bfloat16", {"engine": "vllm"}, {}, "float32"),  # vLLM's CPU build holds float32
        ("bfloat16", {"engine": "vllm", "num_gpus_per_env_runner": 1}, {}, None),  # the checkpoint's dtype
        ("bfloat16", {"engine": "vllm", "engine_options": {"dtype": "bfloat16"}}, {}, None),
        ("bfloat16", {"engine": "torch"}, {}, "float32"),
        ("bfloat16", {"engine": "torch", "engine_options": {"dtype": "bfloat16"}}, {}, None),
        ("bfloat16", {"engine": "vllm"}, {"weight_sync_dtype": "bfloat16"}, "bfloat16"),  # the user's choice wins
        ("float32", {"engine": "vllm"}, {}, None),
    ],
)
def test_a_bfloat16_learner_sends_float32_masters_to_float32_engines(dtype, runners, training, expected):
    config = _valid().env_runners(**runners).training(dtype=dtype, **training)
    config.validate()
    spec = config.learner_spec(model="m")
    assert spec.weight_sync_dtype == expected
    assert spec.sync_torch_dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16, None: spec.torch_dtype}[expected]
