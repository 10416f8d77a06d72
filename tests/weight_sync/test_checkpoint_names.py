"""Fused experts go out under the checkpoint's names: a tiny Qwen3-MoE saved, its plan compared with the file.

transformers 5 loads a mixture of experts fused (`mlp.experts.gate_up_proj` [E, 2I, H]); its checkpoint
(and vLLM's loader) has one tensor per expert and projection. `names="checkpoint"` streams the latter.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from flashrl.engines.types import check_full_state_dict
from flashrl.weight_sync.gather import checkpoint_items, iter_weight_buckets, put_weight_buckets, weight_manifest

EXPERTS, HIDDEN, WIDTH = 4, 64, 32


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=WIDTH,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                            num_experts=EXPERTS, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                            max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    return str(folder)


def _checkpoint(folder: str) -> dict[str, torch.Tensor]:
    with safe_open(f"{folder}/model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


@pytest.mark.parametrize("loaded", [True, False], ids=["from_pretrained", "from_config"])
def test_the_plan_is_the_checkpoints_names_and_shapes(moe_folder: str, loaded: bool) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    if loaded:  # what a learner holds (transformers recorded the conversions it applied)
        model = AutoModelForCausalLM.from_pretrained(moe_folder, dtype=torch.float32)
    else:  # built from its config: transformers' default conversions for the architecture
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(moe_folder))
    checkpoint = {name: t.shape for name, t in _checkpoint(moe_folder).items()}
    fused = {name: t.shape for name, t in model.state_dict().items()}
    assert fused["model.layers.0.mlp.experts.gate_up_proj"] == (EXPERTS, 2 * WIDTH, HIDDEN)
    with pytest.raises(ValueError, match="unknown"):
        check_full_state_dict(fused, checkpoint)  # the learner's own names: what the engines refused

    metas = [m for bucket in weight_manifest(model, bucket_bytes=2**14, names="checkpoint") for m in bucket]
    plan = {m.name: torch.Size(m.shape) for m in metas}
    assert len(metas) == len(plan) == len(checkpoint)  # every tensor once
    assert plan == checkpoint
    check_full_state_dict(plan, checkpoint)
    assert plan["model.layers.1.mlp.experts.3.gate_proj.weight"] == (WIDTH, HIDDEN)
    assert plan["model.layers.1.mlp.experts.3.down_proj.weight"] == (HIDDEN, WIDTH)


def test_the_streamed_tensors_are_the_checkpoints(moe_folder: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_folder, dtype=torch.float32)
    manifest = weight_manifest(model, bucket_bytes=2**14, dtype=torch.bfloat16, names="checkpoint")
    assert len(manifest) > 2  # several buckets, cut between layers
    expected = _checkpoint(moe_folder)
    seen = 0
    for declared, bucket in zip(manifest, iter_weight_buckets(model, manifest, dtype=torch.bfloat16,
                                                              names="checkpoint"), strict=True):  # fmt: skip
        assert [m.name for m in declared] == list(bucket)
        assert {m.name.split(".")[2] for m in declared if m.name.startswith("model.layers.")} in (set(), {"0"}, {"1"})
        for name, tensor in bucket.items():
            assert tensor.dtype == torch.bfloat16
            torch.testing.assert_close(tensor, expected[name].to(torch.bfloat16), rtol=0, atol=0)
            seen += 1
    assert seen == len(expected)
    stream = put_weight_buckets(model, bucket_bytes=2**14, names="checkpoint", put=lambda b: b)
    assert stream.manifest == weight_manifest(model, bucket_bytes=2**14, names="checkpoint")


def test_a_dense_model_is_passed_through(tiny_llama_path: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    items = list(model.state_dict().items())
    assert [(n, t.data_ptr()) for n, t in checkpoint_items(model, items)] == [(n, t.data_ptr()) for n, t in items]
    assert weight_manifest(model, names="checkpoint") == weight_manifest(model)
    with pytest.raises(ValueError, match=r"names: expected one of \('model', 'checkpoint'\)"):
        weight_manifest(model, names="hf")
