"""A vLLM engine next to a learner on one GPU: its derived memory share and its sleep / wake call order.

No GPU here: the share is checked through ``vllm_engine_args`` (pure), and the sleep-mode order
through a test double of vLLM's ``AsyncLLM`` that records every call, because vLLM 0.32's CPU build
has no sleep mode (the last test checks that fact on the installed build).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from flashrl.engines.colocation import (
    colocated_engine_options,
    colocated_memory_utilization,
    is_colocated,
    resolve_sleep_mode,
)
from flashrl.engines.vllm_engine import VLLMEngine, VLLMEngineOptions, vllm_engine_args

GIB = 2**30
HF_CONFIG = SimpleNamespace(max_position_embeddings=2048, dtype="bfloat16")


def _gpu_args(device_bytes: int | None = 80 * GIB, **options: Any) -> dict[str, Any]:
    return vllm_engine_args(
        VLLMEngineOptions(**options), path="m", seed=0, on_cpu=False, hf_config=HF_CONFIG, device_bytes=device_bytes
    )


# ------------------------------------------------------------------------------------ the share
def test_a_colocated_engine_leaves_the_learner_its_planned_bytes() -> None:
    # 80 GiB device, learner 20 GiB: floor(100 x 60 / 80) = 75 %, less the 5 % margin = 0.70
    args = _gpu_args(colocated_learner_bytes=20 * GIB, colocated_gpu_fraction=0.5)
    assert args["gpu_memory_utilization"] == 0.70
    # learner 34.38 GiB (the 1.5B model's planned peak): floor(100 x 45.62 / 80) = 57 % - 5 % = 0.52
    assert _gpu_args(colocated_learner_bytes=36919719936, colocated_gpu_fraction=0.5)["gpu_memory_utilization"] == 0.52


def test_the_share_falls_back_to_rays_fraction_and_a_whole_gpu_keeps_085() -> None:
    assert _gpu_args(colocated_gpu_fraction=0.4)["gpu_memory_utilization"] == 0.4  # no learner estimate
    assert _gpu_args()["gpu_memory_utilization"] == 0.85  # a GPU of its own
    # an explicit setting wins over the derivation
    args = _gpu_args(gpu_memory_utilization=0.3, colocated_learner_bytes=20 * GIB, colocated_gpu_fraction=0.5)
    assert args["gpu_memory_utilization"] == 0.3


def test_a_learner_that_leaves_nothing_is_refused_with_the_fixes() -> None:
    with pytest.raises(ValueError, match=r"76.00 GiB on a 80.00 GiB device.*a smaller learner.*a GPU of its own"):
        colocated_memory_utilization(80 * GIB, learner_bytes=76 * GIB, runner_gpus=0.5)
    assert colocated_memory_utilization(80 * GIB, learner_bytes=75 * GIB, runner_gpus=0.5) == 0.01


def test_the_colocated_layout_and_the_sleep_setting() -> None:
    assert is_colocated(0.5, 0.5) and is_colocated(0.3, 0.7)
    assert not is_colocated(1, 1) and not is_colocated(0.5, 0) and not is_colocated(0.6, 0.6)
    assert resolve_sleep_mode(None, engine="vllm", learner_gpus=0.5, runner_gpus=0.5) is True
    assert resolve_sleep_mode(None, engine="vllm", learner_gpus=1, runner_gpus=1) is False
    assert resolve_sleep_mode(None, engine="vllm", learner_gpus=0, runner_gpus=0) is False
    assert resolve_sleep_mode(False, engine="vllm", learner_gpus=0.5, runner_gpus=0.5) is False
    with pytest.raises(ValueError, match="CPU build has no sleep mode"):
        resolve_sleep_mode(True, engine="vllm", learner_gpus=0, runner_gpus=0)
    with pytest.raises(ValueError, match="only the vLLM engine sleeps"):
        resolve_sleep_mode(True, engine="torch", learner_gpus=0.5, runner_gpus=0.5)


def test_colocated_engine_options_carry_the_learners_peak() -> None:
    memory = SimpleNamespace(static=30 * GIB, total=35 * GIB)
    common = {"engine": "vllm", "learner_gpus": 0.5, "runner_gpus": 0.5, "learner_memory": memory}
    assert colocated_engine_options({"weight_sync": "ipc"}, sleep_mode=True, **common) == {
        "weight_sync": "ipc", "sleep_mode": True, "colocated_gpu_fraction": 0.5, "colocated_learner_bytes": 35 * GIB,
    }  # asleep through the update, but it wakes next to what the learner still holds: its peak, not 30 GiB
    assert colocated_engine_options({}, sleep_mode=False, **common)["colocated_learner_bytes"] == 35 * GIB
    assert colocated_engine_options({"gpu_memory_utilization": 0.4}, sleep_mode=False, **common) == {
        "gpu_memory_utilization": 0.4
    }
    assert colocated_engine_options({}, sleep_mode=False, **{**common, "engine": "torch"}) == {}
    assert colocated_engine_options({}, sleep_mode=False, **{**common, "runner_gpus": 1}) == {}


def test_sleep_mode_starts_vllm_with_it_and_is_refused_on_cpu() -> None:
    assert _gpu_args(sleep_mode=True)["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in _gpu_args()
    with pytest.raises(ValueError, match="CPU build has no sleep mode"):
        vllm_engine_args(
            VLLMEngineOptions(sleep_mode=True, max_model_len=64), path="m", seed=0, on_cpu=True,
            hf_config=SimpleNamespace(max_position_embeddings=64, num_hidden_layers=1, num_attention_heads=1,
                                      num_key_value_heads=1, hidden_size=8, torch_dtype="float32"),
        )  # fmt: skip


# ------------------------------------------------------------------------------------ sleep / wake order
class RecordingLLM:
    """The ``AsyncLLM`` methods the engine calls, recorded in order (vLLM's CPU build has no sleep mode)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        async def record(*args: Any, **kwargs: Any) -> Any:
            detail = args[0] if name == "collective_rpc" else kwargs.get("tags", kwargs.get("level", ""))
            self.calls.append(f"{name}({detail})" if detail != "" else name)
            return True

        return record


def _engine(tmp_path) -> tuple[VLLMEngine, RecordingLLM]:
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM start: the double stands in for AsyncLLM
    llm = RecordingLLM()
    engine.options = VLLMEngineOptions(sleep_mode=True, weight_transfer_dir=str(tmp_path))
    engine._llm, engine._version, engine._update_lock, engine._broken, engine._asleep = llm, 0, None, None, []
    engine._shapes, engine._tied, engine.weight_sync = {"w": torch.Size([2])}, False, "ipc"
    engine._adapters = None  # full weights: no LoRA adapter slot
    return engine, llm


SLEEP = ["pause_generation", "reset_prefix_cache", "sleep(1)"]


def test_streamed_update_wakes_the_weights_before_loading_and_the_kv_cache_after(tmp_path) -> None:
    engine, llm = _engine(tmp_path)

    async def run() -> None:
        await engine.sleep()
        assert engine.is_sleeping
        llm.calls.append("[learner update]")
        await engine.update_weights({"w": torch.ones(2)}, version=1)

    asyncio.run(run())
    assert llm.calls == [
        *SLEEP, "[learner update]",
        "pause_generation", "wake_up(['weights'])", "collective_rpc(flashrl_start_weight_update)",
        "collective_rpc(flashrl_load_bucket)", "collective_rpc(flashrl_finish_weight_update)",
        "reset_prefix_cache", "update_weight_version", "wake_up(['kv_cache'])", "resume_generation",
    ]  # fmt: skip
    assert not engine.is_sleeping and engine.version == 1


def test_pushed_update_wakes_the_same_way(tmp_path) -> None:
    engine, llm = _engine(tmp_path)

    async def run() -> None:
        await engine.sleep()
        llm.calls.append("[learner update]")
        await engine.begin_weight_transfer()
        await engine.receive_weight_transfer({"names": ["w"]})
        await engine.end_weight_transfer(version=3)

    asyncio.run(run())
    assert llm.calls == [
        *SLEEP, "[learner update]",
        "pause_generation", "wake_up(['weights'])", "start_weight_update", "update_weights",
        "finish_weight_update", "collective_rpc(flashrl_retie_output_embedding)", "reset_prefix_cache",
        "update_weight_version", "wake_up(['kv_cache'])", "resume_generation",
    ]  # fmt: skip
    assert engine.version == 3


def test_wake_up_without_an_update_and_twice_is_once(tmp_path) -> None:
    engine, llm = _engine(tmp_path)

    async def run() -> None:
        await engine.wake_up()  # awake: nothing
        await engine.sleep()
        await engine.sleep()  # asleep: nothing
        await engine.wake_up()
        await engine.wake_up()

    asyncio.run(run())
    assert llm.calls == [
        *SLEEP, "wake_up(['weights'])", "reset_prefix_cache", "wake_up(['kv_cache'])", "resume_generation"
    ]


def test_an_engine_without_sleep_mode_refuses_to_sleep(tmp_path) -> None:
    engine, llm = _engine(tmp_path)
    engine.options = VLLMEngineOptions()
    with pytest.raises(RuntimeError, match="without sleep_mode"):
        asyncio.run(engine.sleep())
    assert llm.calls == []


def test_vllms_cpu_build_has_no_sleep_mode() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("this checks vLLM's CPU build; a GPU build has sleep mode")
    assert current_platform.is_sleep_mode_available() is False


# ------------------------------------------------------------------------------------ a failed wake
class FailingWakeLLM(RecordingLLM):
    """``wake_up`` of one tag fails as vLLM's does when the memory is not there (``cumem``'s allocation)."""

    def __init__(self, failing_tag: str) -> None:
        super().__init__()
        self.failing_tag = failing_tag

    async def wake_up(self, tags: list[str]) -> None:
        self.calls.append(f"wake_up({tags})")
        if self.failing_tag in tags:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")


def _failing_engine(tmp_path, tag: str) -> tuple[VLLMEngine, FailingWakeLLM]:
    engine, _ = _engine(tmp_path)
    engine._llm = llm = FailingWakeLLM(tag)
    return engine, llm


def _fail_after_sleep(engine: VLLMEngine, llm: FailingWakeLLM, step) -> None:
    """Sleep, then run ``step`` (the engine's wake) and expect its out-of-memory error; then the engine
    is broken, generation was not resumed and the update lock is free."""

    async def run() -> None:
        await engine.sleep()
        llm.calls.append("[learner update]")
        with pytest.raises(torch.OutOfMemoryError):
            await step()

    asyncio.run(run())
    assert "resume_generation" not in llm.calls[llm.calls.index("[learner update]"):]  # generation stays paused
    assert engine._update_lock is not None and not engine._update_lock.locked()  # nothing waits on the lock
    with pytest.raises(RuntimeError, match="wake from sleep mode failed .*out of memory"):
        engine._check_usable()  # every later call raises: the runner fails and is restarted


@pytest.mark.parametrize("tag", ["kv_cache", "weights"])
def test_a_failed_wake_in_a_streamed_update_is_an_engine_error(tmp_path, tag: str) -> None:
    engine, llm = _failing_engine(tmp_path, tag)
    _fail_after_sleep(engine, llm, lambda: engine.update_weights({"w": torch.ones(2)}, version=1))


@pytest.mark.parametrize("tag", ["kv_cache", "weights"])
def test_a_failed_wake_in_a_pushed_update_is_an_engine_error(tmp_path, tag: str) -> None:
    engine, llm = _failing_engine(tmp_path, tag)

    async def push() -> None:
        await engine.begin_weight_transfer()
        await engine.receive_weight_transfer({"names": ["w"]})
        await engine.end_weight_transfer(version=3)

    _fail_after_sleep(engine, llm, push)
    assert engine.version == (3 if tag == "kv_cache" else 0)  # the weights loaded; the KV cache did not wake


def test_a_failed_wake_without_an_update_is_an_engine_error(tmp_path) -> None:
    engine, llm = _failing_engine(tmp_path, "kv_cache")
    _fail_after_sleep(engine, llm, engine.wake_up)
