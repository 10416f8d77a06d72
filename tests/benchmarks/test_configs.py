"""The benchmarks' configs, without Ray: the reference's variants as fields, the arms, fair budgets."""

from __future__ import annotations

import math
import warnings

import pytest
from _configs import (
    FULL,
    QUICK,
    REFERENCE_VARIANTS,
    arithmetic_config,
    reference_fields,
    staleness_fields,
    task_max_new_tokens,
)


def _validate(config) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sync_group's "comparison baseline" notice
        config.validate()


def test_reference_variants_are_the_reference_fields():
    fields = {name: reference_fields(name, max_new_tokens=24) for name in REFERENCE_VARIANTS}
    assert fields["grpo"] == {
        "rollout_mode": "sync_group",
        "group_size": 4,
        "baseline": "group_norm",
        "importance_sampling": "none",
        "trust_region": "none",
        "aggregation": "token_mean",
    }
    assert fields["no_trust"] == {"delta": math.inf}
    assert fields["no_is"] == {"importance_sampling": "none"}
    assert fields["token_mean"] == {"aggregation": "token_mean"}
    assert fields["negative_q09"] == {"negative_token_fraction": 0.9}
    # the reference's L = 6144 is its max_new_tokens: scaled to this task's 24
    assert fields["constant_length"] == {"aggregation": "constant_length", "constant_length_normalizer": 24}
    with pytest.raises(ValueError, match="unknown variant 'gate_5e3'"):
        reference_fields("gate_5e3", max_new_tokens=24)


def test_staleness_fields_make_the_lag_possible():
    assert staleness_fields(4, train_batch_size=16) == {
        "async_queue_size": 4,
        "delta": 0.003,
        "episodes_in_flight_per_env_runner": 64,
    }
    assert staleness_fields(8, train_batch_size=16) == {
        "async_queue_size": 8,
        "delta": 0.003,
        "episodes_in_flight_per_env_runner": 128,
    }
    with pytest.raises(ValueError, match=r"expected one of \[4, 8\]"):
        staleness_fields(2, train_batch_size=16)


def test_full_scale_is_the_main_job_with_its_held_out_split():
    config = arithmetic_config(FULL, model_path="smollm2-135m-instruct", seed=2)
    _validate(config)
    assert (config.train_batch_size, config.lr, config.delta, config.engine) == (16, 3e-6, 0.05, "vllm")
    assert (config.rollout_mode, config.aggregation, config.max_new_tokens, config.seed) == (
        "async",
        "sample_mean",
        24,
        2,
    )
    assert config.evaluation_temperature == 0.0 and config.evaluation_num_episodes == 64
    held_out = {t["id"] for t in config.evaluation_env_config["tasks"]}
    train = {t["id"] for t in config.env_config["tasks"]}
    assert len(held_out) == 64 and len(train) == 836 and not held_out & train
    assert task_max_new_tokens(FULL) == 24 and task_max_new_tokens(QUICK) == 8


def test_grpo_takes_the_same_rollouts_per_update(bench):
    le = bench("learning_efficiency")
    for method in le.METHODS:
        overrides = le.method_overrides(method, 24)
        config = arithmetic_config(
            FULL, model_path="smollm2-135m-instruct", seed=0, overrides=overrides
        )
        _validate(config)
        le.check_budget(method, config, 16)
    grpo = arithmetic_config(
        FULL, model_path="x", seed=0, overrides=le.method_overrides("grpo", 24)
    )
    assert grpo.prompts_per_batch == 4 and grpo.effective_baseline == "group_norm"
    with pytest.raises(ValueError, match="expected 8 rollouts per update, got 4 prompts x 4"):
        le.check_budget("grpo", grpo, 8)


def test_every_ablation_arm_is_a_valid_config(bench):
    ab = bench("ablations")
    arms = ab.make_arms(16, 24)
    assert [a.name for a in arms] == ab.ARM_NAMES
    by_name = {a.name: a for a in arms}
    for arm in arms:
        config = arithmetic_config(FULL, model_path="x", seed=0, overrides=arm.overrides)
        _validate(config)
        assert arm.baseline is None or arm.baseline in by_name
    for q in (4, 8):
        trusted, untrusted = by_name[f"flash_reinforce@Q{q}"].overrides, by_name[f"no_trust@Q{q}"].overrides
        assert trusted["async_queue_size"] == untrusted["async_queue_size"] == q
        assert trusted["episodes_in_flight_per_env_runner"] == q * 16
        assert (trusted["delta"], untrusted["delta"]) == (0.003, math.inf)
        assert by_name[f"no_trust@Q{q}"].baseline == f"flash_reinforce@Q{q}"


def test_async_and_sync_get_the_same_runners_and_episodes_in_flight(bench):
    avs = bench("async_vs_sync")
    args = avs.parse_args([])
    avs.check_fair(args)
    configs = {mode: avs.make_config(args, "model", mode) for mode in avs.MODES}
    for name in (
        "num_env_runners",
        "num_cpus_per_env_runner",
        "episodes_in_flight_per_env_runner",
        "train_batch_size",
        "engine",
        "max_new_tokens",
        "model",
    ):
        assert getattr(configs["async"], name) == getattr(configs["sync_group"], name), name
    assert configs["async"].episodes_in_flight_per_env_runner * args.num_env_runners == args.batch_size == 16
    sync = configs["sync_group"]  # one round: B/G prompts x G, spread evenly over the runners
    assert (
        sync.prompts_per_batch * sync.group_size == 16 and sync.prompts_per_batch % args.num_env_runners == 0
    )
    with pytest.raises(SystemExit, match="spread evenly over the 4 runners"):
        avs.check_fair(avs.parse_args(["--num-env-runners", "4"]))
    with pytest.raises(SystemExit, match="multiple of --group-size 8"):
        avs.check_fair(avs.parse_args(["--batch-size", "12"]))
