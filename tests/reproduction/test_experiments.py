"""The reference experiments table: values as the reference files have them, variants, translation."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.reproduction.experiments import (
    COMMON,
    EXPERIMENTS,
    FLASHRL_CHOICE,
    FLASHRL_CHOICES,
    ExperimentError,
    resolve_experiment,
)
from flashrl.reproduction.translate import TRANSLATION, flashrl_fields

EXAMPLES = Path(__file__).resolve().parents[2] / "tuned_examples"
CASES = [(name, variant) for name, s in EXPERIMENTS.items() for variant in (None, *s.variants)]


def resolved(name: str, *variants: str):
    return resolve_experiment(name, variants)


def test_the_five_experiments_and_their_variants_by_the_reference_names() -> None:
    # examples/README.md, "Variant names"
    assert {name: list(s.variants) for name, s in EXPERIMENTS.items()} == {
        "r1": ["gate_5e3", "no_trust"],
        "qwen_math": ["gate_1e3", "negative_q09", "negative_q02", "five_benchmark_eval16"],
        "qwen7b_tool": [
            "negative_q09",
            "negative_q02",
            "negative_q00",
            "token_mean",
            "constant_length",
            "grpo",
        ],
        "qwen3_tool_ablation": ["no_trust", "no_is"],
        "alfworld": ["negative_q02", "no_is", "grpo"],
    }
    assert all(
        s.source.startswith("examples/settings/") and s.source.endswith(".json") for s in EXPERIMENTS.values()
    )


def test_common_values_are_the_reference_ones() -> None:
    # examples/settings/common.json
    assert len(COMMON) == 43
    assert (COMMON["actor.flash_gate_delta"], COMMON["actor.adam.weight_decay"], COMMON["actor.adam.lr"]) == (
        0.001,
        0.1,
        1e-6,
    )
    assert (COMMON["actor.lr_scheduler"], COMMON["actor.lr_warmup_ratio"], COMMON["actor.min_lr_ratio"]) == (
        "cosine_with_min_lr",
        0.03,
        0.1,
    )
    assert (COMMON["eval.n_samples_per_prompt"], COMMON["eval.temperature"], COMMON["eval.top_p"]) == (
        4,
        0.7,
        0.7,
    )
    assert (COMMON["rollout.vllm_generate_batch_size"], COMMON["train.async_queue_size"]) == (16, 1)


@pytest.mark.parametrize(
    ("name", "total", "generated", "delta", "batch", "queue", "turns"),
    [  # examples/README.md, first table, and each experiment file
        ("r1", 9216, 8192, 0.003, 128, 8, 1),
        ("qwen_math", 6144, 4096, 0.003, 128, 1, 1),
        ("qwen7b_tool", 8192, 6144, 0.001, 128, 1, 10),
        ("qwen3_tool_ablation", 16384, 14336, 0.003, 128, 4, 20),
        ("alfworld", 16384, 8192, 0.001, 64, 1, 50),
    ],
)
def test_each_experiment_resolves_to_the_reference_values(
    name: str, total: int, generated: int, delta: float, batch: int, queue: int, turns: int
) -> None:
    r = resolved(name)
    flags = r.flags
    assert (flags["data.max_len"], flags["rollout.max_new_tokens"]) == (total, generated)
    assert flags["actor.flash_gate_delta"] == delta
    assert (flags["rollout.batch_size"], flags["train.batch_size"], flags["train.async_queue_size"]) == (
        batch,
        batch,
        queue,
    )
    assert r.experiment.max_agent_turns == turns
    assert r.origin["actor.adam.lr"] == "examples/settings/common.json"
    assert r.origin["data.max_len"] == r.experiment.source


def test_experiment_specific_evaluation_and_schedule() -> None:
    r1, alf = resolved("r1").flags, resolved("alfworld").flags
    assert (r1["eval.n_samples_per_prompt"], r1["eval.temperature"], r1["eval.top_p"], r1["eval.steps"]) == (
        32,
        0.6,
        0.95,
        128,
    )
    assert (
        alf["eval.n_samples_per_prompt"],
        alf["eval.temperature"],
        alf["eval.top_p"],
        alf["eval.steps"],
    ) == (3, 1.0, 0.7, 40)
    assert (alf["actor.lr_scheduler"], alf["actor.flash_neg_topq"]) == ("constant", 0.9)
    assert resolved("qwen_math", "five_benchmark_eval16").flags["eval.n_samples_per_prompt"] == 16


def test_variants_apply_in_order_and_the_last_value_wins() -> None:
    assert resolved("qwen_math", "negative_q09").flags["actor.flash_gate_delta"] == 0.001
    both = resolved("qwen_math", "negative_q09", "negative_q02")
    assert (both.flags["actor.flash_neg_topq"], both.variants) == (0.2, ("negative_q09", "negative_q02"))
    assert "variant negative_q02" in both.origin["actor.flash_neg_topq"]
    assert math.isinf(flashrl_fields(resolved("r1", "no_trust")).values["delta"])


def test_unknown_experiment_or_variant_lists_the_known_ones() -> None:
    with pytest.raises(ExperimentError, match=r"unknown variant 'typo'.*\['gate_5e3', 'no_trust'\]"):
        resolved("r1", "typo")
    with pytest.raises(ExperimentError, match="unknown experiment 'r2'"):
        resolve_experiment("r2")


def test_grpo_leaves_the_native_loss_flags_out_and_keeps_the_batch() -> None:
    r = resolved("qwen7b_tool", "grpo")
    assert not any(key.startswith("actor.flash_") for key in r.flags)
    assert (r.flags["rollout.batch_size"], r.flags["rollout.n_samples_per_prompt"]) == (32, 4)
    fields = flashrl_fields(r).values
    assert (fields["rollout_mode"], fields["group_size"], fields["train_batch_size"]) == (
        "sync_group",
        4,
        128,
    )
    assert (
        fields["baseline"],
        fields["aggregation"],
        fields["importance_sampling"],
        fields["trust_region"],
    ) == ("group_norm", "token_mean", "none", "none")


@pytest.mark.parametrize(("name", "variant"), CASES)
def test_every_flag_of_every_experiment_translates(name: str, variant: str | None) -> None:
    r = resolved(name, *([variant] if variant else []))
    assert set(r.flags) <= set(TRANSLATION)
    out = flashrl_fields(r)
    assert set(out.sources) >= {
        "lr",
        "weight_decay",
        "lr_schedule",
        "train_batch_size",
        "max_new_tokens",
        "max_episode_tokens",
        "temperature",
        "async_queue_size",
        "max_samples",
        "num_epochs",
        "evaluation_num_samples_per_prompt",
        "evaluation_temperature",
        "evaluation_top_p",
    }
    for field_name, source in out.sources.items():
        assert source.startswith(("examples/", "ceil(", "molt-rl 0.2.1 default", FLASHRL_CHOICE)), (
            field_name,
            source,
        )
    values = out.values
    assert values["max_new_tokens"] < values["max_episode_tokens"]
    assert (
        values["episodes_in_flight_per_env_runner"] * FLASHRL_CHOICES[name].num_env_runners
        == (r.flags["rollout.vllm_generate_batch_size"])
    )
    json.dumps(r.to_json())  # JSON-ready, inf included


def test_translated_values_of_the_qwen7b_tool_experiment() -> None:
    values = flashrl_fields(resolved("qwen7b_tool")).values
    assert (
        values["lr"],
        values["weight_decay"],
        values["lr_schedule"],
        values["lr_warmup_ratio"],
        values["min_lr_ratio"],
        values["grad_clip"],
    ) == (1e-6, 0.1, "cosine_with_min_lr", 0.03, 0.1, 1.0)
    assert (values["delta"], values["negative_token_fraction"], values["aggregation"]) == (
        0.001,
        1.0,
        "sample_mean",
    )
    assert values["env_config"] == {"max_turns": 10}
    assert (values["dtype"], values["gradient_checkpointing"], values["optimizer"]) == (
        "bfloat16",
        True,
        "adamw",
    )
    assert (values["betas"], values["adam_eps"]) == ((0.9, 0.95), 1e-8)  # Molt 0.2.1's defaults
    assert (values["max_samples"], values["num_epochs"]) == (7500, 68)
    assert "total_updates" not in values  # the horizon follows the real set: ceil(N / 128) rounds x 68 passes
    config = FlashReinforceConfig().update_from_dict({k: v for k, v in values.items() if k != "engine_options"})
    assert config.schedule_horizon(10_000) == 59 * 68  # a set larger than max_samples: ceil(7500 / 128) x 68
    assert config.schedule_horizon(1000) == 8 * 68  # a set of 1,000 prompts: ceil(1000 / 128) x 68
    constant = flashrl_fields(resolved("qwen7b_tool", "constant_length")).values
    assert (constant["aggregation"], constant["constant_length_normalizer"]) == ("constant_length", 6144)
    no_is = flashrl_fields(resolved("qwen3_tool_ablation", "no_is")).values
    assert (no_is["importance_sampling"], no_is["delta"]) == ("none", 0.001)


def test_every_experiment_has_its_tuned_example() -> None:
    for name, choices in FLASHRL_CHOICES.items():
        text = (EXAMPLES / f"{choices.script}.py").read_text()
        assert f'run_experiment("{name}")' in text
        assert len(ast.parse(text).body) <= 6  # docstring, imports, the main: thin


def test_alfworld_evaluates_every_seen_and_unseen_game_once() -> None:
    """The reference's 140 seen + 134 unseen games: evaluation_num_episodes counts prompts per split."""
    import argparse

    from flashrl.env_runners.evaluation import num_prompts
    from flashrl.reproduction.experiment_run import ALFWORLD_EVAL_GAMES, experiment_config

    out = flashrl_fields(resolved("alfworld"))
    assert out.values["evaluation_num_episodes"] == 140
    assert out.values["evaluation_splits"] == {"valid_seen": {"split": "valid_seen"},
                                               "valid_unseen": {"split": "valid_unseen"}}
    assert "140 seen + 134 unseen games" in out.sources["evaluation_num_episodes"]
    args = argparse.Namespace(alfworld_data=None, num_generated_games=8)
    spec = experiment_config(resolved("alfworld"), args).env_runner_spec()
    assert {split: env["split"] for split, env in spec.evaluation_splits.items()} == {
        "valid_seen": "valid_seen", "valid_unseen": "valid_unseen"}
    # a finite game list caps the prompts at its size: each game played once, 274 in all
    played = {split: num_prompts(spec, ALFWORLD_EVAL_GAMES[split]) for split in spec.evaluation_splits}
    assert played == {"valid_seen": 140, "valid_unseen": 134}


def test_a_constant_schedule_leaves_warmup_and_min_lr_inert() -> None:
    out = flashrl_fields(resolved("alfworld"))
    assert (out.values["lr_schedule"], out.values["lr_warmup_ratio"], out.values["min_lr_ratio"]) == (
        "constant",
        0.0,
        0.0,
    )
    assert "inert under actor.lr_scheduler=constant" in out.sources["lr_warmup_ratio"]


def test_a_field_the_config_lacks_is_an_error_not_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from flashrl.reproduction import experiment_run

    real = experiment_run.flashrl_fields

    def with_extra(resolved, **kwargs):
        out = real(resolved, **kwargs)
        out.set("no_such_field", 1, "examples/settings/common.json: a future flag")
        return out

    monkeypatch.setattr(experiment_run, "flashrl_fields", with_extra)
    args = argparse.Namespace(data="train.jsonl", eval_data="eval.jsonl")
    with pytest.raises(ExperimentError, match=r"needs FlashReinforceConfig fields \['no_such_field'\]"):
        experiment_run.experiment_config(resolved("qwen_math"), args)


def test_every_experiment_builds_a_valid_config() -> None:
    import argparse

    from flashrl.reproduction.experiment_run import experiment_config

    for name, variant in CASES:
        r = resolved(name, *([variant] if variant else []))
        args = argparse.Namespace(
            data="t.jsonl", eval_data="e.jsonl", alfworld_data=None, num_generated_games=8
        )
        config = experiment_config(r, args)
        with pytest.warns(UserWarning) if config.rollout_mode == "sync_group" else _no_warning():
            config.validate()
        assert (config.delta, config.train_batch_size) == (
            flashrl_fields(r).values.get("delta", config.delta),
            r.flags["train.batch_size"],
        )


def _no_warning():
    import contextlib

    return contextlib.nullcontext()
