"""The vLLM engine (CPU build on CPU machines) on SmolLM2-135M-Instruct: the acceptance checks.

One engine for the whole module, started with a run-sized context (1024 tokens x 8 sequences).
Recorded log-probs must agree with an independent float32 transformers recomputation (mean
Bernoulli-KL drift < 1e-3), bad requests fail alone, the KV cache is exactly the budget computed from
need, and after an in-place weight update the log-probs follow the new weights (also for a long
prompt the engine has seen before: no stale prefix-cache blocks) and the version advances.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from flashrl.engines import Completion, RequestError, SamplingConfig, make_engine
from flashrl.engines.agreement import measure_agreement
from flashrl.engines.memory import kv_cache_budget

pytestmark = pytest.mark.vllm

CONTEXT, SEQS = 1024, 8


@pytest.fixture(scope="module")
def engine(smollm2_path: str, event_loop_runner):  # the loop must outlive the engine
    eng = make_engine("vllm", "smollm2-135m-instruct", seed=0, max_model_len=CONTEXT, max_num_seqs=SEQS)
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


def test_max_tokens_stop_tokens_and_seed_reproducibility(engine, chat_prompts, event_loop_runner) -> None:
    prompt = chat_prompts(engine.tokenizer, 5)[4]  # "Count from one to five.": longer than 5 tokens
    a, b = _gather(event_loop_runner, engine, [prompt, prompt], [SamplingConfig(max_tokens=5, seed=7)] * 2)
    assert a.token_ids == b.token_ids
    # the second may be served from the first's cached prompt blocks: the same numbers up to rounding
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    eos = engine.tokenizer.eos_token_id
    assert eos not in a.token_ids, "the prompt should not be answered within 5 tokens"
    assert (a.finish_reason, len(a.token_ids)) == ("length", 5)
    # the same seed samples the same tokens; a stop token chosen from them ends the completion there
    stop = a.token_ids[2]
    (c,) = _gather(
        event_loop_runner, engine, [prompt], [SamplingConfig(max_tokens=5, seed=7, stop_token_ids=(stop,))]
    )
    first = a.token_ids.index(stop)
    assert (c.finish_reason, c.token_ids) == ("stop", a.token_ids[: first + 1])


def test_kv_cache_is_the_budget_from_need(engine, event_loop_runner) -> None:
    """The KV cache vLLM allocated is exactly the computed budget: it does not depend on free memory."""
    per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2 in float32
    expected = kv_cache_budget(
        num_seqs=SEQS, context_tokens=CONTEXT, bytes_per_token=per_token, block_size=128
    )
    assert expected.reserved_bytes == (8 * 8 + 1) * 128 * per_token == 383_385_600
    assert engine.max_model_len == CONTEXT
    assert engine.kv_cache_memory_bytes == expected.reserved_bytes
    allocated = event_loop_runner.run_until_complete(engine._llm.collective_rpc("flashrl_kv_cache_bytes"))
    assert allocated == [expected.reserved_bytes]


def test_weight_route_and_transfer_workers_on_cpu(engine) -> None:
    """On CPU the engine pulls streamed buckets; it has one worker (a push route's group size is 1 + that)."""
    assert engine.weight_sync == "shm"
    assert engine.num_transfer_workers == 1


def test_a_push_plan_is_checked_against_the_checkpoint(engine, smollm2_path: str) -> None:
    """What learner rank 0 sends every engine before a push route's rendezvous: the checkpoint's names
    and shapes pass (a tied head may be left out), a name vLLM's loader would not know or a wrong shape
    is refused here, not inside a broadcast. The engine stays usable either way."""
    from transformers import AutoModelForCausalLM

    from flashrl.learners.weight_gather import weight_manifest
    from flashrl.weight_sync.vllm_push import plan_of

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    plan = plan_of(weight_manifest(model, dtype=torch.bfloat16, names="checkpoint"))
    assert engine.check_weight_plan(plan) == len(plan) == len(model.state_dict()) - 1  # tied head once
    bad_name = [("model.layers.0.mlp.experts.gate_up_proj", "bfloat16", [4, 8, 8]), *plan]
    with pytest.raises(ValueError, match=r"unknown \['model.layers.0.mlp.experts.gate_up_proj'\]"):
        engine.check_weight_plan(bad_name)
    name, dtype, shape = plan[1]
    with pytest.raises(ValueError, match=rf"wrong shapes \['{name}: expected"):
        engine.check_weight_plan([plan[0], (name, dtype, [shape[0] + 1, *shape[1:]]), *plan[2:]])
    with pytest.raises(ValueError, match="Missing"):
        engine.check_weight_plan(plan[1:])
    engine.check_weight_plan(plan)


def test_an_impossible_kv_budget_is_a_clear_error_before_vllm_starts(smollm2_path: str) -> None:
    with pytest.raises(ValueError) as err:
        make_engine("vllm", smollm2_path, seed=0, max_model_len=4096, kv_cache_memory_bytes=100 * 1024**2)
    msg = str(err.value)
    assert "kv_cache_memory_bytes gives the KV cache 100.0 MiB (104857600 bytes)" in msg
    assert "one sequence of max_model_len=4096 tokens needs 185.6 MiB (194641920 bytes" in msg
    assert "lower max_model_len to 2048 or less" in msg
    with pytest.raises(ValueError, match="one sequence of 50000 tokens needs 2.15 GiB .* above the cap"):
        make_engine("vllm", smollm2_path, seed=0, max_model_len=50_000)


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


def _long_chat_prompt(tokenizer) -> list[int]:
    """A chat prompt of about 600 tokens: several of the CPU build's 128-token KV blocks."""
    colours = ["red", "blue", "green", "yellow"]
    facts = " ".join(f"Box {i} is {colours[i % 4]} and holds {i * 7 % 13} marbles." for i in range(48))
    message = facts + " Which boxes hold exactly five marbles? Answer in one sentence."
    return list(tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True, return_dict=False
    ))  # fmt: skip


def test_no_stale_prefix_kv_after_a_weight_update(engine, smollm2_path: str, event_loop_runner) -> None:
    """A long prompt served before an update is served with the new weights after it.

    vLLM caches the prompt's full KV blocks (prefix caching); an update that keeps them makes the
    second generation attend to keys and values of the old weights (measured 0.32 nats/token).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    prompt = _long_chat_prompt(engine.tokenizer)
    assert 5 * 128 > len(prompt) > 4 * 128
    greedy = SamplingConfig(temperature=0.0, max_tokens=16)
    run = event_loop_runner.run_until_complete
    run(engine.update_weights(model.state_dict(), version=10))  # known weights, whatever ran before
    before = run(engine.generate(prompt, greedy))  # fills the prefix cache with the prompt's blocks
    assert measure_agreement(model, [prompt], [before]).mean_abs_diff < 1e-3
    layer = model.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        layer.mul_(2.0)  # changes every later layer's keys and values
    run(engine.update_weights(model.state_dict(), version=11))
    after = run(engine.generate(prompt, greedy))
    assert after.version == 11 and after.metrics["version_spans"] == [(11, 0)]
    report = measure_agreement(model, [prompt], [after])
    print(f"same long prompt after an update, vs the new weights: {report}")
    assert report.num_tokens == 16 and report.mean_abs_diff < 1e-3
    with torch.no_grad():
        layer.div_(2.0)  # exactly the old weights again: the update was visible on these tokens
    assert measure_agreement(model, [prompt], [after]).mean_abs_diff > 0.05
