"""The torch engine on the tiny Llama and on SmolLM2: batching, exact log-probs, limits, errors, updates."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from flashrl.engines import Completion, RequestError, SamplingConfig, make_engine
from flashrl.engines.agreement import measure_agreement


@pytest.fixture(scope="module")
def engine(tiny_llama_path: str):
    with make_engine("torch", tiny_llama_path, seed=0) as eng:
        yield eng


def _gather(engine, prompts, samplings) -> list[Completion]:
    async def run():
        return await asyncio.gather(*[engine.generate(p, s) for p, s in zip(prompts, samplings)])

    return asyncio.run(run())


def test_concurrent_calls_are_batched_and_seeds_are_batch_invariant(
    chat_prompts, tiny_llama_path: str
) -> None:
    with make_engine("torch", tiny_llama_path, seed=0, max_batch_size=4) as eng:
        prompts = chat_prompts(eng.tokenizer, 6)
        batched = _gather(eng, prompts, [SamplingConfig(max_tokens=12, seed=i) for i in range(6)])
        assert eng.largest_batch == 4  # 6 concurrent requests ran as batches of 4 and 2
        alone = _gather(eng, prompts[5:], [SamplingConfig(max_tokens=12, seed=5)])[0]
    assert alone.token_ids == batched[5].token_ids
    torch.testing.assert_close(
        torch.tensor(alone.logprobs), torch.tensor(batched[5].logprobs), atol=1e-4, rtol=0
    )
    assert all(len(c.token_ids) == len(c.logprobs) and c.version == 0 for c in batched)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_recorded_logprobs_match_learner_recomputation(chat_prompts, engine, temperature: float) -> None:
    prompts = chat_prompts(engine.tokenizer)
    comps = _gather(
        engine, prompts, [SamplingConfig(temperature=temperature, max_tokens=16, seed=i) for i in range(8)]
    )
    report = measure_agreement(engine.model, prompts, comps, temperature=temperature)
    assert report.num_tokens >= 8 * 4
    assert report.max_abs_diff < 1e-3
    assert report.mean_drift < 1e-6


def test_truncated_sampling_records_renormalised_logprobs(chat_prompts, engine) -> None:
    """With top-k, each recorded log-prob is the untruncated one minus the log of the kept mass."""
    prompt = chat_prompts(engine.tokenizer, 1)[0]
    comp = _gather(engine, [prompt], [SamplingConfig(top_k=5, max_tokens=6, seed=3)])[0]
    ids = torch.tensor([prompt + comp.token_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # [n, V]
    full = logits.log_softmax(-1)  # [n, V]
    kept_mass = full.topk(5, dim=-1).values.logsumexp(-1)  # [n]
    expected = full.gather(-1, torch.tensor(comp.token_ids).unsqueeze(-1)).squeeze(-1) - kept_mass
    torch.testing.assert_close(torch.tensor(comp.logprobs), expected, atol=1e-4, rtol=0)
    top5 = full.topk(5, dim=-1).indices
    assert all(t in top5[i].tolist() for i, t in enumerate(comp.token_ids))


def test_greedy_is_deterministic(chat_prompts, engine) -> None:
    prompt = chat_prompts(engine.tokenizer, 1)[0]
    a, b = _gather(engine, [prompt, prompt], [SamplingConfig(temperature=0.0, max_tokens=8)] * 2)
    assert a.token_ids == b.token_ids
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert a.token_ids[0] == int(logits.argmax())


def test_stop_token_ends_and_is_kept(chat_prompts, engine) -> None:
    prompt = chat_prompts(engine.tokenizer, 1)[0]
    free = _gather(engine, [prompt], [SamplingConfig(max_tokens=10, seed=11)])[0]
    cut = next(i for i in range(1, len(free.token_ids)) if free.token_ids[i] not in free.token_ids[:i])
    stopped = _gather(
        engine, [prompt], [SamplingConfig(max_tokens=10, seed=11, stop_token_ids=(free.token_ids[cut],))]
    )[0]
    assert stopped.token_ids == free.token_ids[: cut + 1]
    assert stopped.finish_reason == "stop"
    assert free.finish_reason == "length" and len(free.token_ids) == 10


def test_context_end_truncates_and_overlong_prompt_fails_alone(chat_prompts, tiny_llama_path: str) -> None:
    with make_engine("torch", tiny_llama_path, seed=0, max_model_len=40) as eng:
        prompts = chat_prompts(eng.tokenizer, 2)
        assert len(prompts[0]) < 40
        long_prompt = prompts[1] * 3  # >= 40 tokens

        async def run():
            return await asyncio.gather(
                eng.generate(prompts[0], SamplingConfig(max_tokens=100, seed=0)),
                eng.generate(long_prompt, SamplingConfig(max_tokens=4)),
                eng.generate(prompts[0], SamplingConfig(max_tokens=-1)),
                return_exceptions=True,
            )

        ok, too_long, bad = asyncio.run(run())
    assert isinstance(ok, Completion)
    assert ok.finish_reason == "length" and len(ok.token_ids) == 40 - len(prompts[0])
    assert isinstance(too_long, RequestError) and "context holds 40" in str(too_long)
    assert isinstance(bad, RequestError) and "max_tokens" in str(bad)


def test_update_weights_changes_the_policy_and_version(
    chat_prompts, tiny_llama_path: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in reference.state_dict().items()}
    reference.load_state_dict(new)
    with make_engine("torch", tiny_llama_path, seed=0) as eng:
        prompts = chat_prompts(eng.tokenizer, 4)
        before = _gather(eng, prompts, [SamplingConfig(max_tokens=8, seed=i) for i in range(4)])
        asyncio.run(eng.update_weights(reference.state_dict(), version=3))
        assert eng.version == 3
        after = _gather(eng, prompts, [SamplingConfig(max_tokens=8, seed=i) for i in range(4)])
        assert [c.version for c in after] == [3] * 4
        assert measure_agreement(reference, prompts, after).max_abs_diff < 1e-3
        assert measure_agreement(reference, prompts, before).max_abs_diff > 1e-2  # old policy differs
        with pytest.raises(ValueError, match="Missing"):
            asyncio.run(eng.update_weights({"model.norm.weight": new["model.norm.weight"]}, version=4))
        bad = dict(new)
        bad["model.norm.weight"] = torch.zeros(3)
        with pytest.raises(ValueError, match="wrong shapes"):
            asyncio.run(eng.update_weights(bad, version=4))
        assert eng.version == 3


def test_make_engine_rejects_unknown_kind_and_options(tiny_llama_path: str) -> None:
    with pytest.raises(ValueError, match="unknown engine kind 'tgi'"):
        make_engine("tgi", tiny_llama_path, seed=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_batch"):
        make_engine("torch", tiny_llama_path, seed=0, max_batch=3)


def test_smollm2_torch_engine_agrees_with_transformers(chat_prompts, smollm2_path: str) -> None:
    """The acceptance check for the torch engine: SmolLM2-135M-Instruct, float32, drift < 1e-3."""
    from transformers import AutoModelForCausalLM

    with make_engine("torch", "smollm2-135m-instruct", seed=0) as eng:
        prompts = chat_prompts(eng.tokenizer)
        comps = _gather(eng, prompts, [SamplingConfig(max_tokens=24, seed=i) for i in range(8)])
    independent = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    report = measure_agreement(independent, prompts, comps)
    print(f"torch engine vs transformers on SmolLM2: {report}")
    assert report.num_tokens >= 8 * 8
    assert report.mean_drift < 1e-3
    assert report.max_abs_diff < 1e-2
