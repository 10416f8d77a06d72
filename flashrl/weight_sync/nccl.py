"""The ``nccl`` transport: learner rank 0 broadcasts to every worker of every engine in one NCCL group (GPU).

vLLM's ``NCCLWeightTransferEngine``, across nodes and tensor-parallel ranks, packed into bounded
buffers; the halves and the driver's side are ``flashrl.weight_sync.push``'s. It needs learner rank 0
and every engine worker each on a GPU of its own (``flashrl.weight_sync.layout``), and a free port on
learner rank 0's node for the rendezvous.
"""

from __future__ import annotations

from typing import Any

from flashrl.weight_sync.push import JoinInfo, PushTransport

__all__ = ["NcclTransport"]


class NcclTransport(PushTransport):
    name = "nccl"

    def init_info(self, join: JoinInfo) -> Any:
        """vLLM's ``NCCLTrainerInitInfo``: no bound on the buffer (a tensor larger than it goes as a chunk of its own)."""
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        if not join.master_address or not join.master_port:
            raise ValueError(
                "weight_sync='nccl' needs master_address and master_port (a free port on learner rank 0's node)."
            )
        return NCCLTrainerInitInfo(master_address=join.master_address, master_port=int(join.master_port),
                                   world_size=int(join.world_size), packed=True, rank=int(join.rank))  # fmt: skip
