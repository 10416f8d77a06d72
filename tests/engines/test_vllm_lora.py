"""vLLM serving a LoRA run's adapters: each pushed version is a new LoRARequest, its completions record that
version and their log-probs are the peft model's; a newer adapter is never served from an older one's cache.
An exported adapter folder (what a checkpoint's policy/ holds) loads in vLLM as ``--lora-modules`` loads it,
and in peft, with the exporting model's log-probs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from flashrl.engines import SamplingConfig, make_engine
from flashrl.engines.agreement import measure_agreement
from flashrl.models.lora import LoRASettings, apply_lora, is_adapter_name

pytestmark = pytest.mark.vllm

SETTINGS = LoRASettings(rank=8, alpha=16.0)


def _adapted(tiny_llama_path: str, seed: int) -> torch.nn.Module:
    """The tiny model with a peft adapter whose lora_B is random (peft starts it at zero)."""
    return _adapted_peft(tiny_llama_path, seed).get_base_model()


def _adapted_peft(tiny_llama_path: str, seed: int) -> Any:
    """``_adapted``'s ``PeftModel`` (what the learner exports its adapter with)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    peft_model = apply_lora(model, SETTINGS)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return peft_model.eval()


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


def test_an_exported_adapter_loads_in_vllm_and_peft_with_the_exporters_log_probs(tiny_llama_path, chat_prompts,
                                                                               event_loop_runner, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from vllm.lora.request import LoRARequest

    from flashrl.checkpoints.export import save_adapter
    from flashrl.models import compute_token_logprobs

    exporter = _adapted_peft(tiny_llama_path, 3)
    # the learner's export (Learner.save_policy, a checkpoint's policy/): PEFT's format and the tokenizer
    folder = save_adapter(exporter, tmp_path / "policy", tokenizer_source=tiny_llama_path)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, folder).eval().get_base_model()
    engine = make_engine("vllm", tiny_llama_path, seed=0, max_model_len=512, weight_sync="lora",
                         lora=SETTINGS.to_dict())
    try:
        prompts = chat_prompts(engine.tokenizer)
        # what `vllm serve --lora-modules exported=<folder>` does for a request naming the adapter: a
        # LoRARequest on the folder, loaded by vLLM itself (no flashrl push); every request below uses it
        engine._adapters.served(LoRARequest("exported", 1, str(folder)))

        async def sample():
            return await asyncio.gather(
                *[engine.generate(p, SamplingConfig(max_tokens=12, seed=i)) for i, p in enumerate(prompts)])

        completions = event_loop_runner.run_until_complete(sample())
    finally:
        engine.close()
    model = exporter.get_base_model()
    report = measure_agreement(model, prompts, completions)
    assert report.mean_drift < 1e-5 and report.max_abs_diff < 1e-3  # the bound of the pushed versions above
    base_only = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    assert measure_agreement(base_only, prompts, completions).max_abs_diff > 1e-2  # vLLM served the adapter
    ids = torch.tensor([prompts[0] + completions[0].token_ids])
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        assert torch.equal(compute_token_logprobs(loaded, ids, mask)[0], compute_token_logprobs(model, ids, mask)[0])
