"""The ``ipc`` transport: the engine's workers map the learner's CUDA tensors (GPU; learner and engine on one device).

vLLM's ``IPCWeightTransferEngine``; the halves and the driver's side are ``flashrl.weight_sync.push``'s.
It needs every engine worker on the GPU of a learner rank (``flashrl.weight_sync.layout``: CUDA IPC
does not cross devices): the colocated layout.
"""

from __future__ import annotations

from typing import Any

from flashrl.weight_sync.push import JoinInfo, PushTransport
from flashrl.weight_sync.wire import VLLM_PACKED_BUFFER_BYTES, WeightManifest

__all__ = ["INSECURE_SERIALIZATION", "IpcTransport", "ipc_buffer_bytes"]

INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"
"""vLLM's setting (``vllm/envs.py``) that lets its msgpack encoder fall back to pickle."""


def ipc_buffer_bytes(manifest: WeightManifest) -> int:
    """The IPC packed buffer: vLLM's 1 GiB, or the largest tensor when that is larger.

    vLLM's ``packed_ipc_producer`` copies each tensor whole into one reusable CUDA buffer and raises
    for a tensor larger than it (``vllm/distributed/weight_transfer/packed_tensor.py``); Qwen2.5-7B's
    embedding alone is 152,064 x 3,584 x 2 bytes = 1.09 GB.
    """
    largest = max((m.nbytes for bucket in manifest for m in bucket), default=0)
    return max(VLLM_PACKED_BUFFER_BYTES, int(largest))


class IpcTransport(PushTransport):
    name = "ipc"

    def init_info(self, join: JoinInfo) -> Any:
        """vLLM's ``IPCTrainerInitInfo``, its packed buffer at least the largest tensor (``ipc_buffer_bytes``)."""
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(packed=True, rank=int(join.rank), packed_buffer_size_bytes=ipc_buffer_bytes(join.manifest))

    def engine_environment(self) -> dict[str, str]:
        """``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, set before vLLM starts.

        Each update carries CUDA IPC handles (``torch.multiprocessing.reductions.reduce_tensor``'s
        arguments: the tensor and storage classes, a ``torch.dtype``), which vLLM's msgpack encoder
        refuses without it (``vllm/v1/serial_utils.py``, ``MsgpackEncoder.enc_hook``): the first push
        would fail and leave the engine broken. With it they are pickled over the engine's local
        process sockets; vLLM's own example (``examples/rl/rlhf_ipc.py``) and Molt 0.2.1
        (``molt/trainer/vllm/vllm_engine.py``, ``_configure_vllm_env``) set the same. ``nccl`` and
        ``shm`` send only names, dtype names and shapes, and need nothing.
        """
        return {INSECURE_SERIALIZATION: "1"}
