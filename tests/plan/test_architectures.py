"""Parameter counts of the preset models, and the formulas checked against real transformers modules."""

from __future__ import annotations

import pytest
import torch

from flashrl.plan.architectures import ARCHITECTURES, Architecture, architecture_for, read_architecture


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [
        # The exact counts the Hugging Face hub shows for these models (safetensors metadata).
        ("HuggingFaceTB/SmolLM2-135M-Instruct", 134_515_008, 134_515_008),
        ("Qwen/Qwen2.5-Math-1.5B", 1_543_714_304, 1_543_714_304),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 1_777_088_000, 1_777_088_000),
        ("Qwen/Qwen2.5-7B-Instruct", 7_615_616_512, 7_615_616_512),
        ("Qwen/Qwen3-30B-A3B", 30_532_122_624, 3_353_032_704),
    ],
)
def test_parameter_counts_of_the_preset_models(name: str, total: int, active: int) -> None:
    arch = ARCHITECTURES[name]
    assert arch.num_parameters() == total
    assert arch.num_active_parameters() == active


def test_kv_cache_bytes_per_token_by_hand() -> None:
    # 2 (K and V) x 28 layers x 4 KV heads x 128 head dim x 2 bytes
    assert ARCHITECTURES["Qwen/Qwen2.5-7B-Instruct"].kv_cache_bytes_per_token(2) == 57_344
    # 2 x 30 x 3 x 64 x 4 bytes (float32, as vLLM's CPU build serves SmolLM2)
    assert ARCHITECTURES["HuggingFaceTB/SmolLM2-135M-Instruct"].kv_cache_bytes_per_token(4) == 46_080


def _count_meta(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_formula_matches_transformers(tied: bool) -> None:
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    arch = Architecture.from_hf_config("tiny-qwen2", config.to_dict())
    assert arch.attention_bias
    assert arch.num_parameters() == _count_meta(config)


def test_qwen3_moe_formula_matches_transformers() -> None:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    arch = Architecture.from_hf_config("tiny-qwen3-moe", config.to_dict())
    assert (arch.num_experts, arch.num_experts_per_token, arch.qk_norm) == (8, 2, True)
    assert arch.num_parameters() == _count_meta(config)
    # active: only 2 of the 8 experts' MLPs per layer
    per_expert = 3 * 64 * 32
    assert arch.num_parameters() - arch.num_active_parameters() == 2 * (8 - 2) * per_expert


def test_local_folder_config_wins_over_the_table(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 16, '
        '"num_attention_heads": 2, "vocab_size": 10, "tie_word_embeddings": true}'
    )
    arch = architecture_for("HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path))
    # embed 80 + 2 x (attention 4 x 64 + mlp 3 x 128 + norms 16) + final norm 8
    assert arch.num_parameters() == 80 + 2 * (256 + 384 + 16) + 8
    assert read_architecture(tmp_path / "missing") is None
    assert architecture_for("smollm2-135m-instruct") is ARCHITECTURES["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert architecture_for("org/unknown-model") is None


def test_the_old_recipes_paths_still_import_the_same_objects() -> None:
    from flashrl.plan import architectures, memory
    from flashrl.recipes import architectures as old_architectures
    from flashrl.recipes import memory as old_memory

    assert old_architectures.architecture_for is architectures.architecture_for
    assert old_architectures.ARCHITECTURES is architectures.ARCHITECTURES
    assert (old_memory.learner_memory, old_memory.GIB, old_memory.EXPORT_BUCKET_BYTES) == (
        memory.learner_memory, memory.GIB, memory.EXPORT_BUCKET_BYTES)  # fmt: skip
