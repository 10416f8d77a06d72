"""The GPU tuned examples' command line for the release's experiments: every experiment and variant
plans coherently with `--dry-run`, and `--print-config` resolves every field."""

from __future__ import annotations

import json

import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.cli import main
from flashrl.reproduction.experiments import EXPERIMENTS, FLASHRL_CHOICES, resolve_experiment

EXPERIMENT_CASES = [
    (FLASHRL_CHOICES[name].script, variant) for name, s in EXPERIMENTS.items() for variant in (None, *s.variants)
]


def dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["train", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("script", "variant"), EXPERIMENT_CASES)
def test_every_experiment_and_variant_plans_coherently(
    script: str, variant: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = dry_run(capsys, script, "--dry-run", *(["--variant", variant] if variant else []))
    assert code == 0, out + err
    assert "VERDICT: COHERENT PLAN" in out
    assert "-- where the hyperparameters come from --" in out
    assert "examples/settings/common.json" in out and "flashrl's choice" in out


@pytest.mark.parametrize(("script", "variant"), EXPERIMENT_CASES)
def test_print_config_resolves_every_field(
    script: str, variant: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = dry_run(capsys, script, "--print-config", *(["--variant", variant] if variant else []))
    assert code == 0, err
    printed = json.loads(out)
    name = next(n for n, c in FLASHRL_CHOICES.items() if c.script == script)
    resolved = resolve_experiment(name, [variant] if variant else [])
    assert printed["setting"] == name and printed["variants"] == ([variant] if variant else [])
    config = printed["flashrl_config"]
    assert config["train_batch_size"] == resolved.flags["train.batch_size"]
    assert config["max_episode_tokens"] == resolved.flags["data.max_len"]
    # the horizon follows the real set; over a set of exactly data.max_samples it is Molt's
    assert (config["max_samples"], config["num_epochs"]) == (
        resolved.flags["data.max_samples"], resolved.flags["train.num_episodes"])
    horizon = FlashReinforceConfig().update_from_dict(config).schedule_horizon(resolved.flags["data.max_samples"])
    assert horizon == resolved.total_updates
    assert set(config) <= set(printed["flashrl_sources"]) | {
        "env_config",
        "evaluation_env_config",
        "engine_options",
    }


def test_unknown_variant_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = dry_run(capsys, "qwen25_math_1p5b", "--dry-run", "--variant", "no_trust")
    assert code == 2
    assert "expected one of ['gate_1e3', 'negative_q09', 'negative_q02', 'five_benchmark_eval16']" in err
