"""The vLLM engine (CPU build on CPU machines) on SmolLM2-135M-Instruct: the acceptance checks.

One engine for the whole module. Recorded log-probs must agree with an independent float32
transformers recomputation (mean Bernoulli-KL drift < 1e-3), bad requests fail alone, and after an
in-place weight update the log-probs follow the new weights and the version advances.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from flashrl.engines import Completion, RequestError, SamplingConfig, make_engine
from flashrl.engines.agreement import measure_agreement

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(smollm2_path: str, event_loop_runner):  # the loop must outlive the engine
    eng = make_engine("vllm", "smollm2-135m-instruct", seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(smollm2_path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


def _gather(loop, engine, prompts, samplings, **kw) -> list:
    async def run():
        return await asyncio.gather(*[engine.generate(p, s) for p, s in zip(prompts, samplings)], **kw)

    return loop.run_until_complete(run())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_logprobs_agree_with_transformers(
    engine, reference, chat_prompts, event_loop_runner, temperature
) -> None:
    prompts = chat_prompts(engine.tokenizer)
    comps = _gather(
        event_loop_runner,
        engine,
        prompts,
        [SamplingConfig(temperature=temperature, max_tokens=24, seed=i) for i in range(8)],
    )
    assert all(isinstance(c, Completion) and len(c.token_ids) == len(c.logprobs) for c in comps)
    assert all(c.version == 0 and c.finish_reason in ("stop", "length") for c in comps)
    report = measure_agreement(reference, prompts, comps, temperature=temperature)
    print(f"vLLM vs transformers on SmolLM2 (T={temperature}): {report}")
    assert report.num_tokens >= 8 * 8
    assert report.mean_drift < 1e-3
    assert report.mean_abs_diff < 1e-2


def test_truncated_sampling_records_the_processed_distribution(
    engine, reference, chat_prompts, event_loop_runner
) -> None:
    prompt = chat_prompts(engine.tokenizer, 1)[0]
    comp = _gather(event_loop_runner, engine, [prompt], [SamplingConfig(top_k=5, max_tokens=8, seed=1)])[0]
    ids = torch.tensor([prompt + comp.token_ids])
    with torch.no_grad():
        full = reference(input_ids=ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)  # [n, V]
    kept = full.topk(5, dim=-1).values.logsumexp(-1)  # [n]
    expected = full.gather(-1, torch.tensor(comp.token_ids).unsqueeze(-1)).squeeze(-1) - kept  # [n]
    torch.testing.assert_close(torch.tensor(comp.logprobs), expected, atol=2e-3, rtol=0)


def test_bad_requests_fail_alone(engine, chat_prompts, event_loop_runner) -> None:
    prompts = chat_prompts(engine.tokenizer, 2)
    too_long = prompts[0] * (engine.max_model_len // len(prompts[0]) + 1)
    results = _gather(
        event_loop_runner,
        engine,
        [prompts[0], too_long, prompts[1], prompts[1]],
        [SamplingConfig(max_tokens=6, seed=0), SamplingConfig(max_tokens=4), SamplingConfig(temperature=-1.0),
         SamplingConfig(max_tokens=6, seed=1)],
        return_exceptions=True,
    )  # fmt: skip
    assert isinstance(results[0], Completion) and isinstance(results[3], Completion)
    assert isinstance(results[1], RequestError) and f"context holds {engine.max_model_len}" in str(results[1])
    assert isinstance(results[2], RequestError) and "temperature" in str(results[2])


def test_max_tokens_and_seed_reproducibility(engine, chat_prompts, event_loop_runner) -> None:
    prompt = chat_prompts(engine.tokenizer, 3)[2]
    a, b = _gather(event_loop_runner, engine, [prompt, prompt], [SamplingConfig(max_tokens=5, seed=7)] * 2)
    assert a.token_ids == b.token_ids
    assert a.finish_reason == "length" and len(a.token_ids) == 5 or a.finish_reason == "stop"


def test_update_weights_in_place(engine, reference, chat_prompts, event_loop_runner) -> None:
    """Perturb every weight, update the running engine, and check it now samples from the new model."""
    gen = torch.Generator().manual_seed(0)
    state = reference.state_dict()
    with torch.no_grad():
        new = {k: v + 0.02 * v.std() * torch.randn(v.shape, generator=gen) for k, v in state.items()}
        reference.load_state_dict(new)  # lm_head stays tied to the embedding
    prompts = chat_prompts(engine.tokenizer)
    event_loop_runner.run_until_complete(engine.update_weights(reference.state_dict(), version=1))
    assert engine.version == 1
    comps = _gather(
        event_loop_runner, engine, prompts, [SamplingConfig(max_tokens=24, seed=i) for i in range(8)]
    )
    assert [c.version for c in comps] == [1] * 8
    assert all(c.metrics["version_spans"] == [(1, 0)] for c in comps)
    report = measure_agreement(reference, prompts, comps)
    print(f"vLLM vs transformers after update: {report}")
    assert report.mean_drift < 1e-3
    with pytest.raises(ValueError, match="Missing"):
        event_loop_runner.run_until_complete(
            engine.update_weights({"model.norm.weight": new["model.norm.weight"]}, 2)
        )
    assert engine.version == 1
