"""The vLLM engine on the tiny random Llama: concurrent generation and an in-place weight update."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flashrl.engines import SamplingConfig, make_engine
from flashrl.engines.agreement import measure_agreement

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tiny_llama_path: str, event_loop_runner):  # the loop must outlive the engine
    eng = make_engine("vllm", tiny_llama_path, seed=0, max_model_len=512)
    yield eng
    eng.close()


def test_generate_and_update_weights(engine, tiny_llama_path: str, chat_prompts, event_loop_runner) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    prompts = chat_prompts(engine.tokenizer)
    assert engine.max_model_len == 512

    async def sample():
        return await asyncio.gather(
            *[engine.generate(p, SamplingConfig(max_tokens=12, seed=i)) for i, p in enumerate(prompts)]
        )

    before = event_loop_runner.run_until_complete(sample())
    assert [c.version for c in before] == [0] * 8
    assert measure_agreement(model, prompts, before).mean_drift < 1e-5

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.load_state_dict(
            {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
        )
    event_loop_runner.run_until_complete(engine.update_weights(model.state_dict(), version=5))
    after = event_loop_runner.run_until_complete(sample())
    assert engine.version == 5 and [c.version for c in after] == [5] * 8
    report = measure_agreement(model, prompts, after)
    assert report.mean_drift < 1e-5 and report.max_abs_diff < 1e-3
    assert measure_agreement(model, prompts, before).max_abs_diff > 1e-2  # the old samples: old policy
