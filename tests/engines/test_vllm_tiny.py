"""The vLLM engine on the tiny random Llama: concurrent generation and in-place weight updates.

An update during a request re-prefills it: tokens sampled before the update have the old weights'
log-probs, tokens after it exactly the new weights' (never a mix of new queries and old KV).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from flashrl.engines import Completion, SamplingConfig, make_engine
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


def test_a_request_in_flight_during_an_update_is_prefilled_again(
    engine, tiny_llama_path: str, chat_prompts, event_loop_runner
) -> None:
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        new.load_state_dict(
            {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in new.state_dict().items()}
        )
    prompt = chat_prompts(engine.tokenizer, 1)[0]
    event_loop_runner.run_until_complete(engine.update_weights(old.state_dict(), version=6))

    async def update_midway() -> Completion:
        task = asyncio.create_task(engine.generate(prompt, SamplingConfig(max_tokens=300, seed=3)))
        # vLLM's own per-request state says how far the request is (the engine returns it only at the end)
        states = engine._llm.output_processor.request_states
        while not any(s.detokenizer.num_output_tokens() >= 40 for s in states.values()):
            assert not task.done(), "the request finished before the update"
            await asyncio.sleep(0.01)
        await engine.update_weights(new.state_dict(), version=7)
        return await task

    comp = event_loop_runner.run_until_complete(update_midway())
    spans = comp.metrics["version_spans"]
    assert [v for v, _ in spans] == [6, 7] and spans[0][1] == 0, spans
    switch = spans[1][1]
    assert 40 <= switch < len(comp.token_ids) == 300
    head = Completion(comp.token_ids[:switch], comp.logprobs[:switch], "length", 6)
    tail = Completion(comp.token_ids[switch:], comp.logprobs[switch:], "length", 7)
    before = measure_agreement(old, [prompt], [head])
    after = measure_agreement(new, [prompt + head.token_ids], [tail])
    print(f"in-flight update at token {switch}: before {before}, after {after}")
    assert before.mean_abs_diff < 1e-3 and after.mean_abs_diff < 1e-3


def test_seeded_prompts_beyond_one_steps_token_budget(engine, event_loop_runner) -> None:
    """24 seeded 400-token prompts at once: 9,600 tokens, more than one step's 4,096. With chunked
    prefill vLLM's CPU worker died on the first prompt split over two steps ("CPU Generator does not
    use offset"); whole prefills serve them all, over several steps."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 1000, (400,), generator=gen).tolist() for _ in range(24)]

    async def sample():
        return await asyncio.gather(
            *[engine.generate(p, SamplingConfig(max_tokens=4, seed=i)) for i, p in enumerate(prompts)]
        )

    first = event_loop_runner.run_until_complete(sample())
    assert all(len(c.token_ids) == 4 and len(c.logprobs) == 4 for c in first)
    again = event_loop_runner.run_until_complete(sample())  # seeded: the same tokens
    assert [c.token_ids for c in again] == [c.token_ids for c in first]
