"""vLLM serving a LoRA run's adapters: each pushed version is a new LoRARequest, its completions record that
version and their log-probs are the peft model's; a newer adapter is never served from an older one's cache."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flashrl.engines import SamplingConfig, make_engine
from flashrl.engines.agreement import measure_agreement
from flashrl.models.lora import LoRASettings, apply_lora, is_adapter_name

pytestmark = pytest.mark.vllm

SETTINGS = LoRASettings(rank=8, alpha=16.0)


def _adapted(tiny_llama_path: str, seed: int) -> torch.nn.Module:
    """The tiny model with a peft adapter whose lora_B is random (peft starts it at zero)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    apply_lora(model, SETTINGS)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


def test_each_version_is_a_new_adapter_with_the_peft_models_log_probs(tiny_llama_path, chat_prompts,
                                                                      event_loop_runner) -> None:
    engine = make_engine("vllm", tiny_llama_path, seed=0, max_model_len=512, weight_sync="lora",
                         lora=SETTINGS.to_dict())
    try:
        prompts = chat_prompts(engine.tokenizer)
        assert engine.weight_sync == "lora"

        async def sample():
            return await asyncio.gather(
                *[engine.generate(p, SamplingConfig(max_tokens=12, seed=i)) for i, p in enumerate(prompts)])

        first, second = _adapted(tiny_llama_path, 1), _adapted(tiny_llama_path, 2)
        for version, model in ((1, first), (2, second)):
            adapter = {n: t for n, t in model.state_dict().items() if is_adapter_name(n)}
            event_loop_runner.run_until_complete(engine.update_weights(adapter, version=version))
            completions = event_loop_runner.run_until_complete(sample())  # the same prompts: a cache would hit
            assert engine.version == version and [c.version for c in completions] == [version] * len(prompts)
            report = measure_agreement(model, prompts, completions)
            assert report.mean_drift < 1e-5 and report.max_abs_diff < 1e-3, version
        assert measure_agreement(first, prompts, completions).max_abs_diff > 1e-2  # version 2 is another policy
        with pytest.raises(ValueError, match="expected adapter tensors only"):
            event_loop_runner.run_until_complete(engine.update_weights(first.state_dict(), version=3))
    finally:
        engine.close()
