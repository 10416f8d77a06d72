"""The GPU weight-sync routes without a GPU: route selection, and flashrl's arguments checked
against vLLM 0.32's real weight-transfer classes (signatures, dataclass fields, its own checks).

What these cannot show: that the NCCL broadcast and the CUDA-IPC mapping run (that needs a GPU).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from flashrl.learners.weight_gather import PolicyWeights, weight_manifest
from flashrl.weight_sync.push import JoinInfo, PushTransport, bucket_weight_source
from flashrl.weight_sync.registry import TRANSPORTS, transport
from flashrl.weight_sync.resolve import resolve_weight_sync, vllm_transfer_args
from flashrl.weight_sync.vllm_push import (
    AbortTransfer,
    BeginTransfer,
    CheckPlan,
    EndTransfer,
    EnvRunnerSyncClient,
    InitTransfer,
    ReleaseTransfer,
)

pytestmark = pytest.mark.vllm  # imports vLLM (starts no engine)


def push_init_info(route: str, *, rank: int, world_size: int, master_address: str | None, master_port: int | None,
                   ipc_buffer: int | None = None):  # fmt: skip
    """The transport's trainer init info; ``ipc_buffer``: a manifest whose largest tensor is that big."""
    from flashrl.weight_sync.wire import TensorMeta

    manifest = ((TensorMeta("w", "uint8", (ipc_buffer,)),),) if ipc_buffer else ()
    return transport(route).init_info(JoinInfo(rank, world_size, master_address, master_port, manifest))


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
    # only vLLM's backends have a trainer init info; the registry says which those are
    assert [name for name in TRANSPORTS if isinstance(transport(name), PushTransport)] == ["nccl", "ipc"]
    assert [name for name, entry in TRANSPORTS.items() if entry.vllm_backend] == ["nccl", "ipc"]


def test_the_runner_client_gives_each_engine_its_own_nccl_ranks() -> None:
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

    client = EnvRunnerSyncClient(["r0", "r1", "r2"], [2, 1, 4], version=lambda: 7)  # TP 2, 1, 4
    assert isinstance(client, VLLMWeightSyncClient)
    assert client.world_size == 8
    calls: list[list] = []
    client._all = calls.append  # type: ignore[method-assign]  # one message per runner
    # exactly what vLLM's NCCLTrainerWeightTransferEngine.trainer_init sends (workers from rank 1)
    payload = worker_init_payload(NCCLWeightTransferInitInfo(
        master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=8, packed=True))  # fmt: skip
    client.init_weight_transfer_engine(payload)
    infos = [message.init_info for message in calls[-1]]
    assert all(isinstance(m, InitTransfer) for m in calls[-1]) and [i["rank_offset"] for i in infos] == [1, 3, 4]
    assert all(NCCLWeightTransferInitInfo(**i).world_size == 8 for i in infos)  # vLLM parses each
    client.finish_weight_update()
    assert calls[-1] == [EndTransfer(7)] * 3
    client.finish_weight_update("9")
    assert calls[-1] == [EndTransfer(9)] * 3
    client.init_weight_transfer_engine({"packed": True})  # IPC: no ranks, same payload for all
    assert calls[-1] == [InitTransfer({"packed": True})] * 3
    with pytest.raises(ValueError, match="one worker count per runner"):
        EnvRunnerSyncClient(["r0"], [1, 2], version=lambda: 0)


def test_the_bucket_source_passes_vllms_own_checks(tiny_llama_path: str) -> None:
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import WeightSource
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    manifest = weight_manifest(model, bucket_bytes=2**18, dtype=torch.bfloat16)
    source = bucket_weight_source(PolicyWeights(lambda: model, dtype=torch.bfloat16, device="cpu"), manifest)
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


# -- the ipc route: vLLM's serializer and buffer ---------------------------------------------------
def _ipc_update_info() -> dict:
    """One packed IPC update exactly as vLLM's trainer builds it (``_do_send``), its handle shaped as
    ``torch.multiprocessing.reductions.reduce_tensor`` returns it for a CUDA buffer: the tensor and
    storage classes and a ``torch.dtype`` among plain values (no GPU is needed to spell them)."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    ipc_args = (torch.Tensor, torch.Size([2**20]), (1,), 0, torch.storage.UntypedStorage, torch.uint8, 0,
                b"cuda-ipc-handle", 2**20, 0, False, b"ref-counter", 0, b"event", True)  # fmt: skip
    info = IPCWeightTransferUpdateInfo(names=["model.norm.weight"], dtype_names=["bfloat16"], shapes=[[64]],
                                       ipc_handles={"GPU-uuid": ipc_args}, tensor_sizes=[128])  # fmt: skip
    return dataclasses.asdict(info)


def test_ipc_updates_need_the_insecure_serialization_setting_the_engine_sets(monkeypatch) -> None:
    """vLLM's engine client encodes an update as a utility call (`core_client._call_utility_async`);
    its msgpack encoder refuses the handle's classes unless the setting that `route_environment`
    gives an ipc engine is on, and then the engine core's decoder gets them back."""
    from vllm import envs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from flashrl.weight_sync.resolve import route_environment

    envs.disable_envs_cache()  # read the environment at each access, as before an engine starts
    call = (0, 1, "collective_rpc", ("update_weights", None, (), {"update_info": _ipc_update_info()}))
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    with pytest.raises(TypeError, match="is not serializable"):
        MsgpackEncoder().encode(call)
    assert route_environment("nccl") == {} and route_environment("shm") == {}
    for key, value in route_environment("ipc").items():
        monkeypatch.setenv(key, value)
    decoded = MsgpackDecoder().decode(MsgpackEncoder().encode(call))
    handle = decoded[3][3]["update_info"]["ipc_handles"]["GPU-uuid"]
    assert handle[0] is torch.Tensor and handle[4] is torch.storage.UntypedStorage and handle[5] is torch.uint8


def test_the_ipc_buffer_holds_the_largest_tensor() -> None:
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES

    from flashrl.weight_sync.ipc import ipc_buffer_bytes
    from flashrl.weight_sync.wire import VLLM_PACKED_BUFFER_BYTES, TensorMeta

    assert VLLM_PACKED_BUFFER_BYTES == DEFAULT_PACKED_BUFFER_SIZE_BYTES == 2**30
    embed = TensorMeta("model.embed_tokens.weight", "bfloat16", (152064, 3584))  # Qwen2.5-7B
    norm = TensorMeta("model.norm.weight", "bfloat16", (3584,))
    assert embed.nbytes == 1_089_994_752 > 2**30
    assert ipc_buffer_bytes(((embed,), (norm,))) == 1_089_994_752
    assert ipc_buffer_bytes(((norm,),)) == 2**30  # small models keep vLLM's default
    info = push_init_info("ipc", rank=0, world_size=2, master_address=None, master_port=None,
                          ipc_buffer=1_089_994_752)  # fmt: skip
    assert isinstance(info, IPCTrainerInitInfo) and info.packed_buffer_size_bytes == 1_089_994_752


# -- the plan before any rendezvous; a deadline on every transfer ------------------------------------
def test_the_engines_check_the_plan_before_the_rendezvous(tiny_llama_path: str, monkeypatch) -> None:
    """`start_push_transfer` has every engine check the names and shapes before vLLM's trainer engine
    (the NCCL rendezvous) is reached; a refusal stops it there."""
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import factory

    from flashrl.weight_sync.push import start_push_transfer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    reached: list = []
    monkeypatch.setattr(factory.WeightTransferTrainerFactory, "trainer_init",
                        classmethod(lambda cls, info, **kw: reached.append(info) or "engine"))  # fmt: skip
    client = EnvRunnerSyncClient(["r0", "r1"], [1, 1], version=lambda: 0)
    calls: list = []

    def refuse(messages):
        calls.append(messages)
        raise ValueError("update_weights needs the model's full state_dict(): unknown ['x']")

    weights = PolicyWeights(lambda: model, device="cpu")
    nccl = transport("nccl")
    client._all = refuse  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="unknown"):
        start_push_transfer(nccl, weights, client, rank=0, master_address="h", master_port=1)
    (messages,) = calls
    assert all(isinstance(m, CheckPlan) for m in messages) and len(messages) == 2 and reached == []
    assert messages[0].plan == [(n, str(t.dtype).removeprefix("torch."), list(t.shape))
                                for n, t in model.state_dict().items() if n != "lm_head.weight"]  # fmt: skip  (tied head sent once)
    calls.clear()
    client._all = calls.append  # type: ignore[method-assign]
    assert start_push_transfer(nccl, weights, client, rank=0, master_address="h", master_port=1) == "engine"
    assert [type(m) for messages in calls for m in messages] == [CheckPlan, CheckPlan] and len(reached) == 1
    calls.clear()
    start_push_transfer(nccl, weights, client, rank=1, master_address="h", master_port=1)
    assert calls == []  # only the sender talks to the runners


def test_the_client_leases_aborts_and_releases_every_runner() -> None:
    from flashrl.weight_sync.wire import LEASE_FACTOR

    client = EnvRunnerSyncClient(["r0", "r1"], [1, 1], version=lambda: 3, timeout_s=5.0)
    calls: list = []
    client._all = calls.append  # type: ignore[method-assign]
    client.start_weight_update()
    assert calls[-1] == [BeginTransfer(LEASE_FACTOR * 5.0)] * 2
    client.abort("a broadcast hung")
    client.shutdown()
    assert calls[-2:] == [[AbortTransfer("a broadcast hung")] * 2, [ReleaseTransfer()] * 2]

    def fail(messages):
        raise RuntimeError("runner died")

    client._all = fail  # type: ignore[method-assign]
    client.abort("x")  # teardown never raises: the runners are replaced anyway
    client.shutdown()


def test_a_send_past_its_deadline_is_torn_down_and_raises() -> None:
    import threading
    import time

    from flashrl.weight_sync.vllm_push import TransferTimeout, send_with_deadline

    release = threading.Event()

    class Hung:
        def send_weights(self) -> None:  # a broadcast whose peer never arrives, until aborted
            release.wait(30)

    torn: list = []
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match="within 0.3 s"):
        send_with_deadline(Hung(), 0.3, on_timeout=lambda: torn.append("abort") or release.set())
    assert torn == ["abort"] and time.monotonic() - start < 5

    class Fails:
        def send_weights(self) -> None:
            raise ValueError("WeightSource metadata() disagrees with iteration")

    with pytest.raises(ValueError, match="disagrees"):
        send_with_deadline(Fails(), 5.0, on_timeout=lambda: torn.append("unexpected"))
    assert torn == ["abort"]
