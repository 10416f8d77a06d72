"""The KV-cache budget, with numbers computed by hand; the engine's arguments and the plan agree on it."""

from __future__ import annotations

import pytest

from flashrl.engines import engine_options_for_run
from flashrl.engines.memory import (
    GIB,
    KV_CAP_BYTES,
    KV_FLOOR_BYTES,
    check_kv_cache_bytes,
    kv_bytes_per_token_from_hf,
    kv_cache_budget,
)
from flashrl.engines.vllm_engine import VLLMEngineOptions, vllm_engine_args
from flashrl.plan.architectures import ARCHITECTURES
from flashrl.plan.memory import env_runner_memory

# SmolLM2-135M-Instruct's config.json fields that size the KV cache
SMOLLM2 = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "max_position_embeddings": 8192,
}
SMOLLM2_FP32_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # K and V x layers x kv heads x head_dim (576 / 9) x fp32
BLOCK = 128 * SMOLLM2_FP32_PER_TOKEN  # one CPU block: 5,898,240 bytes


class _Config:
    """Attribute access like a transformers ``PretrainedConfig``."""

    def __init__(self, **fields: object) -> None:
        self.__dict__.update(fields)


def test_kv_bytes_per_token_from_a_hf_config() -> None:
    assert SMOLLM2_FP32_PER_TOKEN == 46_080
    assert kv_bytes_per_token_from_hf(SMOLLM2, "float32") == 46_080
    assert kv_bytes_per_token_from_hf(_Config(**SMOLLM2), "torch.bfloat16") == 23_040
    assert kv_bytes_per_token_from_hf({**SMOLLM2, "head_dim": 128}, "float16") == 2 * 30 * 3 * 128 * 2
    with pytest.raises(ValueError, match="unknown KV-cache dtype 'int3'"):
        kv_bytes_per_token_from_hf(SMOLLM2, "int3")


def test_budget_is_whole_blocks_for_every_sequence_plus_the_null_block() -> None:
    b = kv_cache_budget(num_seqs=4, context_tokens=1000, bytes_per_token=46_080, block_size=128)
    assert b.need_bytes == (4 * 8 + 1) * BLOCK == 194_641_920  # ceil(1000 / 128) = 8 blocks a sequence
    assert b.min_bytes == (8 + 1) * BLOCK
    assert b.reserved_bytes == b.need_bytes
    assert b.full_context_seqs == 4


def test_budget_floor_and_cap() -> None:
    small = kv_cache_budget(num_seqs=2, context_tokens=256, bytes_per_token=1024, block_size=128)
    assert small.need_bytes == 5 * 128 * 1024 and small.reserved_bytes == KV_FLOOR_BYTES == 64 * 1024**2
    big = kv_cache_budget(num_seqs=64, context_tokens=8192, bytes_per_token=46_080, block_size=128)
    assert big.need_bytes == (64 * 64 + 1) * BLOCK
    assert big.reserved_bytes == KV_CAP_BYTES == 2 * GIB
    assert big.full_context_seqs == (2 * GIB // BLOCK - 1) // 64 == 5


def test_one_sequence_above_the_cap_is_a_clear_error() -> None:
    with pytest.raises(ValueError) as err:
        kv_cache_budget(num_seqs=1, context_tokens=50_000, bytes_per_token=46_080, block_size=128)
    minimum = (391 + 1) * BLOCK  # ceil(50000 / 128) = 391 blocks + the null block
    assert f"one sequence of 50000 tokens needs {minimum / GIB:.2f} GiB" in str(err.value)
    assert f"kv_cache_memory_bytes >= {minimum}" in str(err.value)
    with pytest.raises(ValueError, match="num_seqs must be an int >= 1; got 0"):
        kv_cache_budget(num_seqs=0, context_tokens=10, bytes_per_token=1, block_size=16)


def test_an_explicit_budget_must_hold_one_full_context_sequence() -> None:
    check_kv_cache_bytes(3 * BLOCK, context_tokens=256, bytes_per_token=46_080, block_size=128, source="x")
    with pytest.raises(ValueError) as err:
        check_kv_cache_bytes(3 * BLOCK - 1, context_tokens=256, bytes_per_token=46_080, block_size=128,
                             source="kv_cache_memory_bytes")  # fmt: skip
    msg = str(err.value)
    assert f"one sequence of max_model_len=256 tokens needs 16.9 MiB ({3 * BLOCK} bytes" in msg
    assert f"raise it to at least {3 * BLOCK} bytes, or lower max_model_len to 128 or less" in msg


def _args(on_cpu: bool = True, environ: dict[str, str] | None = None, **options: object) -> dict:
    return vllm_engine_args(
        VLLMEngineOptions(**options),  # type: ignore[arg-type]
        path="m",
        seed=0,
        on_cpu=on_cpu,
        hf_config=_Config(**SMOLLM2),
        environ=environ or {},
    )


def test_cpu_engine_args_carry_the_budget_in_bytes() -> None:
    args = _args(max_model_len=1024, max_num_seqs=8)
    assert (args["max_model_len"], args["max_num_seqs"]) == (1024, 8)
    assert args["kv_cache_memory_bytes"] == (8 * 8 + 1) * BLOCK == 383_385_600
    assert "gpu_memory_utilization" not in args  # vLLM's CPU worker ignores it once bytes are given
    default = _args()  # the model's 8192 tokens x 64 sequences: capped
    assert (default["max_model_len"], default["max_num_seqs"]) == (8192, 64)
    assert default["kv_cache_memory_bytes"] == 2 * GIB
    assert _args(max_model_len=1024, kv_cache_memory_bytes=10 * BLOCK)["kv_cache_memory_bytes"] == 10 * BLOCK


def test_an_impossible_cpu_budget_fails_before_vllm_starts() -> None:
    with pytest.raises(
        ValueError, match=r"kv_cache_memory_bytes gives the KV cache 1\.0 MiB .* needs 33\.8 MiB"
    ):
        _args(max_model_len=640, kv_cache_memory_bytes=1024**2)
    # vLLM's legacy environment variable wins over the engine argument, so it is checked too
    with pytest.raises(ValueError, match=r"VLLM_CPU_KVCACHE_SPACE=1 \(GiB\) gives the KV cache 1\.00 GiB"):
        _args(environ={"VLLM_CPU_KVCACHE_SPACE": "1"}, max_model_len=8192 * 4)


def test_gpu_engine_args_keep_the_memory_share() -> None:
    args = _args(on_cpu=False)
    assert args["gpu_memory_utilization"] == 0.85 and args["max_model_len"] is None
    assert "kv_cache_memory_bytes" not in args
    assert _args(on_cpu=False, gpu_memory_utilization=0.5)["gpu_memory_utilization"] == 0.5


def test_engine_options_for_run_fill_only_what_the_user_left_out() -> None:
    assert engine_options_for_run("vllm", {"dtype": "float32"}, max_model_len=512, num_seqs=16) == {
        "dtype": "float32", "max_model_len": 512, "max_num_seqs": 16,
    }  # fmt: skip
    assert engine_options_for_run("vllm", {"max_model_len": 4096}, max_model_len=512, num_seqs=16) == {
        "max_model_len": 4096, "max_num_seqs": 16,
    }  # fmt: skip
    assert engine_options_for_run("torch", {}, max_model_len=512, num_seqs=3) == {
        "max_model_len": 512, "max_batch_size": 3,
    }  # fmt: skip
    with pytest.raises(ValueError, match="unknown engine kind 'sglang'"):
        engine_options_for_run("sglang", {}, max_model_len=1, num_seqs=1)


@pytest.mark.parametrize(("seqs", "tokens"), [(32, 256), (16, 2048), (64, 8192), (3, 50)])
def test_the_plan_and_the_cpu_engine_reserve_the_same_bytes(seqs: int, tokens: int) -> None:
    arch = ARCHITECTURES["HuggingFaceTB/SmolLM2-135M-Instruct"]
    plan = env_runner_memory(
        arch, engine_dtype="float32", episodes_in_flight=seqs, max_episode_tokens=tokens, cpu_vllm=True
    )
    options = engine_options_for_run("vllm", {}, max_model_len=tokens, num_seqs=seqs)
    engine = _args(**options)
    assert plan.kv_cache_reserved == engine["kv_cache_memory_bytes"]
    assert plan.total == arch.num_parameters() * 4 + engine["kv_cache_memory_bytes"]


def test_a_tensor_parallel_engine_uses_worker_processes_not_rays_executor() -> None:
    """Inside an EnvRunner actor under Tune's placement group vLLM would pick its Ray executor and wait for
    GPUs the actor already holds: a multi-GPU engine gets the multiprocessing executor explicitly."""
    args = _args(on_cpu=False, engine_args={"tensor_parallel_size": 4, "enable_expert_parallel": True})
    assert args["distributed_executor_backend"] == "mp"
    assert _args(on_cpu=False, engine_args={"pipeline_parallel_size": 2})["distributed_executor_backend"] == "mp"
    assert "distributed_executor_backend" not in _args(on_cpu=False)  # one GPU: vLLM's own "uni"
    given = _args(on_cpu=False, engine_args={"tensor_parallel_size": 2, "distributed_executor_backend": "ray"})
    assert given["distributed_executor_backend"] == "ray"  # the user's choice stands
