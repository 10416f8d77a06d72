"""The GPU weight-sync routes without a GPU: route selection, and flashrl's arguments checked
against vLLM 0.32's real weight-transfer classes (signatures, dataclass fields, its own checks).

What these cannot show: that the NCCL broadcast and the CUDA-IPC mapping run (that needs a GPU).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from flashrl.weight_sync.gather import weight_manifest
from flashrl.weight_sync.resolve import resolve_weight_sync, vllm_transfer_args
from flashrl.weight_sync.vllm_push import EnvRunnerSyncClient, bucket_weight_source, push_init_info

pytestmark = pytest.mark.vllm  # imports vLLM (starts no engine)


def test_route_per_platform() -> None:
    assert resolve_weight_sync("auto", on_cpu=True) == "shm"
    assert resolve_weight_sync("auto", on_cpu=False) == "nccl"
    assert resolve_weight_sync("shm", on_cpu=False) == "shm"
    assert resolve_weight_sync("ipc", on_cpu=False) == "ipc"
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        resolve_weight_sync("nccl", on_cpu=True)
    with pytest.raises(ValueError, match="one of"):
        resolve_weight_sync("rdma", on_cpu=False)
    assert vllm_transfer_args("shm") == {}


@pytest.mark.parametrize("route", ["nccl", "ipc"])
def test_engine_args_configure_vllms_transfer_engine(route: str, tiny_llama_path: str) -> None:
    from transformers import AutoConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )
    from vllm.engine.arg_utils import AsyncEngineArgs

    from flashrl.engines.vllm_engine import VLLMEngineOptions, vllm_engine_args

    args = vllm_engine_args(VLLMEngineOptions(weight_sync=route), path=tiny_llama_path, seed=0, on_cpu=False,
                            hf_config=AutoConfig.from_pretrained(tiny_llama_path))  # fmt: skip
    assert args["weight_transfer_config"] == {"backend": route}
    assert "weight_transfer_config" in {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert WeightTransferConfig(**args["weight_transfer_config"]).backend == route
    assert route in WeightTransferEngineFactory._registry and route in WeightTransferTrainerFactory._registry
    cpu = vllm_engine_args(VLLMEngineOptions(), path=tiny_llama_path, seed=0, on_cpu=True,
                           hf_config=AutoConfig.from_pretrained(tiny_llama_path))  # fmt: skip
    assert "weight_transfer_config" not in cpu
    # CPU: whole prefills only (vLLM cannot rewind a seeded request's CPU generator after a partial one)
    assert cpu["enable_chunked_prefill"] is False and cpu["max_num_batched_tokens"] >= cpu["max_model_len"]
    assert "enable_chunked_prefill" not in args  # GPU: vLLM's own defaults


def test_trainer_init_info_is_vllms() -> None:
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    info = push_init_info("nccl", rank=0, world_size=5, master_address="10.0.0.1", master_port=29500)
    assert isinstance(info, NCCLTrainerInitInfo) and info.backend == "nccl" and info.is_sender
    assert (info.master_address, info.master_port, info.world_size, info.packed) == ("10.0.0.1", 29500, 5, True)
    assert not push_init_info("nccl", rank=1, world_size=5, master_address="h", master_port=1).is_sender
    assert isinstance(push_init_info("ipc", rank=0, world_size=2, master_address=None, master_port=None),
                      IPCTrainerInitInfo)  # fmt: skip
    with pytest.raises(ValueError, match="master_address and master_port"):
        push_init_info("nccl", rank=0, world_size=5, master_address=None, master_port=None)
    with pytest.raises(ValueError, match="push routes"):
        push_init_info("shm", rank=0, world_size=2, master_address=None, master_port=None)


def test_the_runner_client_gives_each_engine_its_own_nccl_ranks() -> None:
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

    client = EnvRunnerSyncClient(["r0", "r1", "r2"], [2, 1, 4], version=lambda: 7)  # TP 2, 1, 4
    assert isinstance(client, VLLMWeightSyncClient)
    assert client.world_size == 8
    calls: list[tuple] = []
    client._all = lambda method, per_runner=None, *args: calls.append((method, per_runner, args))  # type: ignore[method-assign]
    # exactly what vLLM's NCCLTrainerWeightTransferEngine.trainer_init sends (workers from rank 1)
    payload = worker_init_payload(NCCLWeightTransferInitInfo(
        master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=8, packed=True))  # fmt: skip
    client.init_weight_transfer_engine(payload)
    method, infos, _ = calls[-1]
    assert method == "init_weight_transfer" and [i["rank_offset"] for i in infos] == [1, 3, 4]
    assert all(NCCLWeightTransferInitInfo(**i).world_size == 8 for i in infos)  # vLLM parses each
    client.finish_weight_update()
    assert calls[-1] == ("end_weight_transfer", None, (7,))
    client.finish_weight_update("9")
    assert calls[-1] == ("end_weight_transfer", None, (9,))
    client.init_weight_transfer_engine({"packed": True})  # IPC: no ranks, same payload for all
    assert calls[-1][1] == [{"packed": True}] * 3
    with pytest.raises(ValueError, match="one worker count per runner"):
        EnvRunnerSyncClient(["r0"], [1, 2], version=lambda: 0)


def test_the_bucket_source_passes_vllms_own_checks(tiny_llama_path: str) -> None:
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import WeightSource
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    manifest = weight_manifest(model, bucket_bytes=2**18, dtype=torch.bfloat16)
    source = bucket_weight_source(model, manifest, dtype=torch.bfloat16, device="cpu")
    assert isinstance(source, WeightSource)
    meta = source.metadata()
    assert [m.name for m in meta] == [m.name for b in manifest for m in b]
    # the sender's check that iteration matches metadata (names, dtypes, shapes, count)
    sent = list(NCCLTrainerWeightTransferEngine._checked_iter(source, meta))
    assert len(sent) == len(meta) and all(t.dtype == torch.bfloat16 for _, t in sent if t.is_floating_point())
    groups = list(source.iter_groups())  # vLLM's per-layer grouping of the same stream
    assert sum(len(names) for names, _ in groups) == len(meta)


def test_vllm_calls_flashrl_makes_exist_with_these_signatures() -> None:
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.v1.engine.async_llm import AsyncLLM

    def params(fn) -> list[str]:
        return list(inspect.signature(fn).parameters)

    assert params(AsyncLLM.init_weight_transfer_engine) == ["self", "request"]
    assert params(AsyncLLM.start_weight_update) == ["self"]
    assert params(AsyncLLM.update_weights) == ["self", "request"]
    assert params(AsyncLLM.finish_weight_update) == ["self", "weight_version"]
    assert {f.name for f in dataclasses.fields(WeightTransferInitRequest)} == {"init_info"}
    assert {f.name for f in dataclasses.fields(WeightTransferUpdateRequest)} == {"update_info"}
    trainer_init = inspect.signature(WeightTransferTrainerFactory.trainer_init).parameters
    assert list(trainer_init) == ["init_info", "client", "source"]
    assert trainer_init["client"].kind is inspect.Parameter.KEYWORD_ONLY


def test_a_push_on_an_shm_engine_is_refused() -> None:
    from flashrl.engines.vllm_engine import VLLMEngine

    engine = object.__new__(VLLMEngine)  # no vLLM process: only the route check runs
    engine._llm, engine._broken, engine.weight_sync = object(), None, "shm"
    with pytest.raises(RuntimeError, match="weight_sync='shm'.*'nccl' or 'ipc'"):
        engine._check_push_route()
