"""Engines that record MoE routing: the experts of every fed token, aligned with prompt + completion."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from flashrl.conversation import TokenizedConversation
from flashrl.engines import RequestError, SamplingConfig, make_engine
from flashrl.models.routing_replay import NO_ROUTING, record_routing


def _full_forward_routing(model_path: str, ids: list[int]) -> np.ndarray:
    """The experts of every token of ``ids`` in one forward without a cache: [len(ids), layers, k]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad(), record_routing(model) as recorder:
        model(torch.tensor([ids]))
        return recorder.take().numpy()


def test_torch_engine_returns_the_routing_of_every_token_it_fed(tiny_qwen3_moe_path: str) -> None:
    engine = make_engine("torch", tiny_qwen3_moe_path, seed=0, record_routed_experts=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]  # batched together: the short one is left-padded

    async def sample():
        return await asyncio.gather(
            engine.generate(prompts[0], SamplingConfig(max_tokens=6, seed=1)),
            engine.generate(prompts[1], SamplingConfig(max_tokens=6, seed=2, routed_experts_start=2)),
        )

    first, second = asyncio.run(sample())
    assert engine.largest_batch == 2
    for prompt, completion, start in ((prompts[0], first, 0), (prompts[1], second, 2)):
        fed = prompt + completion.token_ids[:-1]  # the last sampled token never goes through the model
        routed = completion.routed_experts
        assert routed.dtype == np.int16 and routed.shape == (len(fed) - start, 2, 2)
        np.testing.assert_array_equal(routed, _full_forward_routing(tiny_qwen3_moe_path, fed)[start:])
    with pytest.raises(RequestError, match="routed_experts_start=4 lies beyond the prompt's 3"):
        asyncio.run(engine.generate(prompts[1], SamplingConfig(max_tokens=2, routed_experts_start=4)))
    plain = asyncio.run(make_engine("torch", tiny_qwen3_moe_path, seed=0).generate(prompts[0], SamplingConfig(seed=1)))
    assert plain.routed_experts is None


def test_a_dense_model_cannot_record_routing(tiny_llama_path: str) -> None:
    with pytest.raises(ValueError, match="routing replay: expected a mixture-of-experts model"):
        make_engine("torch", tiny_llama_path, seed=0, record_routed_experts=True)


def test_a_multi_turn_episode_keeps_each_positions_first_routing(tiny_qwen3_moe_path: str) -> None:
    """Two model turns and an env turn: every position but the last carries its routing, in order."""
    engine = make_engine("torch", tiny_qwen3_moe_path, seed=0, record_routed_experts=True)
    conversation = TokenizedConversation(engine.tokenizer, [{"role": "user", "content": "2+3?"}], prompt_id="p")
    for turn in range(2):
        request = SamplingConfig(max_tokens=5, seed=turn, routed_experts_start=conversation.routed_positions)
        completion = asyncio.run(engine.generate(conversation.token_ids, request))
        conversation.add_model_turn(completion.token_ids, completion.logprobs, version=0,
                                    routed_experts=completion.routed_experts)
        assert conversation.routed_positions == len(conversation) - 1
        if turn == 0:
            assert conversation.add_env_messages([{"role": "user", "content": "Are you sure?"}])
    episode = conversation.to_episode(reward=1.0)
    routed = episode.routed_experts
    n = conversation.routed_positions  # the tokens the engine was fed
    assert routed.shape == (len(episode.token_ids), 2, 2) and len(episode.token_ids) > n + 1  # a closing tail
    # no update in between: the first turn's routing is what one forward over the episode routes
    np.testing.assert_array_equal(routed[:n], _full_forward_routing(tiny_qwen3_moe_path, episode.token_ids[:n]))
    assert (routed[n:] == NO_ROUTING).all()  # the last sampled token and the closing tail: not recorded


def test_vllm_engine_args_ask_for_routed_experts_on_gpu_and_refuse_on_cpu(tiny_qwen3_moe_path: str) -> None:
    pytest.importorskip("vllm")
    from transformers import AutoConfig

    from flashrl.engines.vllm_engine import VLLMEngineOptions, vllm_engine_args

    options = VLLMEngineOptions(record_routed_experts=True, max_model_len=256)
    hf_config = AutoConfig.from_pretrained(tiny_qwen3_moe_path)
    args = vllm_engine_args(options, path=tiny_qwen3_moe_path, seed=0, on_cpu=False, hf_config=hf_config)
    assert args["enable_return_routed_experts"] is True and args["enable_prefix_caching"] is True
    from vllm.engine.arg_utils import AsyncEngineArgs

    AsyncEngineArgs(**args)  # the names are vLLM's
    with pytest.raises(ValueError, match="vLLM 0.32's CPU build cannot return routed experts"):
        vllm_engine_args(options, path=tiny_qwen3_moe_path, seed=0, on_cpu=True, hf_config=hf_config)


@pytest.mark.vllm
def test_vllms_cpu_build_still_cannot_return_routed_experts(tiny_qwen3_moe_path: str) -> None:
    """Why the vLLM engine refuses record_routed_experts on CPU; fails (lift the refusal) once vLLM can."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("not vLLM's CPU build: this test pins that build's refusal (CI runs the CPU build, where it runs)")
    args = AsyncEngineArgs(model=tiny_qwen3_moe_path, max_model_len=256, enforce_eager=True,
                           enable_return_routed_experts=True, enable_prefix_caching=True)
    with pytest.raises(Exception, match="requires Model Runner V2|Model Runner V2 requires Triton"):
        args.create_engine_config()
