"""The benchmarks' shared module and configs, without Ray: variants, arms, fairness, summaries, JSON."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def common(bench):
    return bench("_common")


def _validate(config) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sync_group's "comparison baseline" notice
        config.validate()


def test_reference_variants_are_the_reference_fields(common):
    fields = {name: common.reference_fields(name, max_new_tokens=24) for name in common.REFERENCE_VARIANTS}
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
        common.reference_fields("gate_5e3", max_new_tokens=24)


def test_staleness_fields_make_the_lag_possible(common):
    assert common.staleness_fields(4, train_batch_size=16) == {
        "async_queue_size": 4,
        "delta": 0.003,
        "episodes_in_flight_per_env_runner": 64,
    }
    assert common.staleness_fields(8, train_batch_size=16) == {
        "async_queue_size": 8,
        "delta": 0.003,
        "episodes_in_flight_per_env_runner": 128,
    }
    with pytest.raises(ValueError, match=r"expected one of \[4, 8\]"):
        common.staleness_fields(2, train_batch_size=16)


def test_full_scale_is_the_main_job_with_its_held_out_split(common):
    config = common.arithmetic_config(common.FULL, model_path="smollm2-135m-instruct", seed=2)
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
    assert common.task_max_new_tokens(common.FULL) == 24 and common.task_max_new_tokens(common.QUICK) == 8


def test_grpo_takes_the_same_rollouts_per_update(bench, common):
    le = bench("learning_efficiency")
    for method in le.METHODS:
        overrides = le.method_overrides(method, 24)
        config = common.arithmetic_config(
            common.FULL, model_path="smollm2-135m-instruct", seed=0, overrides=overrides
        )
        _validate(config)
        le.check_budget(method, config, 16)
    grpo = common.arithmetic_config(
        common.FULL, model_path="x", seed=0, overrides=le.method_overrides("grpo", 24)
    )
    assert grpo.prompts_per_batch == 4 and grpo.effective_baseline == "group_norm"
    with pytest.raises(ValueError, match="expected 8 rollouts per update, got 4 prompts x 4"):
        le.check_budget("grpo", grpo, 8)


def test_every_ablation_arm_is_a_valid_config(bench, common):
    ab = bench("ablations")
    arms = ab.make_arms(16, 24)
    assert [a.name for a in arms] == ab.ARM_NAMES
    by_name = {a.name: a for a in arms}
    for arm in arms:
        config = common.arithmetic_config(common.FULL, model_path="x", seed=0, overrides=arm.overrides)
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


def test_summaries_by_hand(bench, common):
    s = common.spread([1.0, 2.0, None, 4.0])
    assert s["n"] == 3 and (s["min"], s["max"]) == (1.0, 4.0)
    assert s["mean"] == pytest.approx(7 / 3) and s["std"] == pytest.approx(math.sqrt(14 / 9))
    assert common.spread([None])["mean"] is None
    rows = [
        {"num_episodes": 4, "policy_lag_hist": {"0": 0.5, "1": 0.5, "2": 0.0}},
        {"num_episodes": 12, "policy_lag_hist": {"0": 0.25, "1": 0.25, "2": 0.5}},
    ]
    assert common.lag_distribution(rows) == {"0": 0.3125, "1": 0.3125, "2": 0.375}
    le = bench("learning_efficiency")
    curve = [{"rollouts": r, "accuracy": a} for r, a in ((0, 0.3), (16, 0.4), (32, 0.5), (48, 0.45))]
    assert le.rollouts_to_target(curve, 0.45) == 32
    assert le.rollouts_to_target(curve, 0.6) is None
    assert le.curve_area(curve) == pytest.approx((16 * 0.35 + 16 * 0.45 + 16 * 0.475) / 48)


def test_write_json_is_strict(common, tmp_path):
    path = common.write_json(
        tmp_path / "sub" / "r.json", {"a": math.nan, "b": math.inf, "c": [1.0, -math.inf]}
    )

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    assert json.loads(Path(path).read_text(), parse_constant=refuse) == {
        "a": None,
        "b": "inf",
        "c": [1.0, "-inf"],
    }


def test_run_log_keeps_finished_runs_for_resume(common, tmp_path):
    report = tmp_path / "r.json"
    settings = {"scale": common.QUICK}
    log = common.RunLog(report, key_fields=("method", "seed"), settings=settings, resume=False)
    log.add({"method": "grpo", "seed": 0, "drift": math.inf, "curve": [1.0]})
    log.add({"method": "grpo", "seed": 1, "curve": [2.0]})
    with open(log.path, "a", encoding="utf-8") as f:  # a run killed while its line was written
        f.write('{"method": "grpo", "se')

    again = common.RunLog(report, key_fields=("method", "seed"), settings=settings, resume=True)
    assert len(again) == 2
    assert again.get(method="grpo", seed=0) == {"method": "grpo", "seed": 0, "drift": "inf", "curve": [1.0]}
    assert again.get(method="grpo", seed=2) is None
    again.add({"method": "grpo", "seed": 2, "curve": [3.0]})
    assert len(common.RunLog(report, key_fields=("method", "seed"), settings=settings, resume=True)) == 3

    other = {"scale": common.FULL}
    with pytest.raises(ValueError, match="without --resume"):
        common.RunLog(report, key_fields=("method", "seed"), settings=other, resume=True)
    fresh = common.RunLog(report, key_fields=("method", "seed"), settings=other, resume=False)
    assert len(fresh) == 0 and fresh.get(method="grpo", seed=0) is None
    assert len(common.RunLog(report, key_fields=("method", "seed"), settings=other, resume=True)) == 0


def test_run_log_resumes_from_the_committed_report(common, tmp_path):
    # a fresh clone has the report but no log: its runs are the finished ones
    report = tmp_path / "r.json"
    runs = [{"arm": "no_is", "seed": 0, "curve": [0.5]}, {"arm": "no_is", "seed": 1, "curve": [0.6]}]
    common.write_json(
        report, {"settings": {"quick": False, "seeds": [0, 1], "scale": common.FULL}, "runs": runs}
    )
    settings = {"scale": common.FULL}

    log = common.RunLog(report, key_fields=("arm", "seed"), settings=settings, resume=True)
    assert len(log) == 2 and log.get(arm="no_is", seed=1) == runs[1]
    log.add({"arm": "no_is", "seed": 2, "curve": [0.7]})  # the new run goes to the log, next to them
    again = common.RunLog(report, key_fields=("arm", "seed"), settings=settings, resume=True)
    assert [again.get(arm="no_is", seed=s)["curve"] for s in (0, 1, 2)] == [[0.5], [0.6], [0.7]]

    log.path.unlink()
    with pytest.raises(ValueError, match=r"r\.json was made with .*without --resume"):
        common.RunLog(report, key_fields=("arm", "seed"), settings={"scale": common.QUICK}, resume=True)
    assert len(common.RunLog(report, key_fields=("arm", "seed"), settings=settings, resume=False)) == 0


def test_tensorboard_export_steps_by_rollouts(bench, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report = {
        "benchmark": "learning_efficiency",
        "runs": [
            {
                "method": "grpo",
                "seed": 1,
                "curve": [
                    {"update": 0, "rollouts": 0, "accuracy": 0.25},
                    {"update": 2, "rollouts": 32, "accuracy": 0.5},
                ],
                "updates": [
                    {
                        "update": 1,
                        "rollouts": 16,
                        "accepted_fraction": 1.0,
                        "drift_mean": None,
                        "policy_lag_hist": {},
                    },
                    {
                        "update": 2,
                        "rollouts": 32,
                        "accepted_fraction": 0.75,
                        "drift_mean": 0.01,
                        "policy_lag_hist": {},
                    },
                ],
            }
        ],
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    folders = bench("tensorboard_export").main([str(path), "--logdir", str(tmp_path / "tb")])
    assert folders == [str(tmp_path / "tb" / "learning_efficiency" / "grpo" / "seed1")]
    events = EventAccumulator(folders[0])
    events.Reload()
    accuracy = [(e.step, e.value) for e in events.Scalars("heldout/accuracy")]
    assert accuracy == [(0, 0.25), (32, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("train/accepted_fraction")] == [(16, 1.0), (32, 0.75)]
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("train/drift_mean")] == [(32, 0.01)]
    assert "train/policy_lag_hist" not in events.Tags()["scalars"]
