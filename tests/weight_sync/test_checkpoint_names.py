"""Fused experts go out under the checkpoint's names: a tiny Qwen3-MoE saved, its plan compared with the file.

transformers 5 loads a mixture of experts fused (`mlp.experts.gate_up_proj` [E, 2I, H]); its checkpoint
(and vLLM's loader) has one tensor per expert and projection. `names="checkpoint"` streams the latter.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from flashrl.engines.types import check_full_state_dict
from flashrl.learners.weight_gather import (
    checkpoint_items,
    iter_weight_buckets,
    put_weight_buckets,
    weight_manifest,
)

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


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_vllm_loads_the_checkpoint_named_stream_of_a_moe(tmp_path, smollm2_path: str, chat_prompts) -> None:
    """vLLM's CPU build serves a tiny Qwen3-MoE; the learner's fused model, changed, is streamed to it under
    the checkpoint's names (the names vLLM's `load_weights` takes on every route: the NCCL consumer feeds
    the same loader). Afterwards the engine samples exactly what an engine started from the changed
    model's saved checkpoint samples. The fused names are refused before anything loads."""
    import asyncio

    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from flashrl.engines import SamplingConfig, make_engine

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=128,
                            moe_intermediate_size=WIDTH, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=32, num_experts=EXPERTS, num_experts_per_tok=2,
                            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=512,
                            tie_word_embeddings=False, initializer_range=0.2,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    first, changed = tmp_path / "moe", tmp_path / "moe-changed"
    Qwen3MoeForCausalLM(config).save_pretrained(first)
    tokenizer.save_pretrained(first)
    model = AutoModelForCausalLM.from_pretrained(first, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(changed)  # transformers writes the checkpoint format back
    tokenizer.save_pretrained(changed)

    loop = asyncio.new_event_loop()

    def sample(engine) -> list:
        prompts = chat_prompts(engine.tokenizer, 4)

        async def run() -> list:
            return await asyncio.gather(
                *[engine.generate(p, SamplingConfig(max_tokens=8, seed=i)) for i, p in enumerate(prompts)]
            )

        return loop.run_until_complete(run())

    engine = make_engine("vllm", str(first), seed=0, max_model_len=256, max_num_seqs=4)
    try:
        before = sample(engine)
        fused = put_weight_buckets(model, bucket_bytes=2**16, put=lambda b: b)  # the learner's own names
        with pytest.raises(ValueError, match="gate_up_proj"):
            loop.run_until_complete(engine.update_weights(fused, version=1))
        stream = put_weight_buckets(model, bucket_bytes=2**16, names="checkpoint", put=lambda b: b)
        assert len(stream.manifest) > 2
        loop.run_until_complete(engine.update_weights(stream, version=1))
        pushed = sample(engine)
    finally:
        engine.close()
    engine = make_engine("vllm", str(changed), seed=0, max_model_len=256, max_num_seqs=4)
    try:
        started = sample(engine)
    finally:
        engine.close()
        loop.close()
    assert [c.version for c in pushed] == [1] * 4
    assert [c.token_ids for c in pushed] == [c.token_ids for c in started] != [c.token_ids for c in before]
    for a, b in zip(pushed, started, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)
