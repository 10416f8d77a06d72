"""The learner's side of the push routes: vLLM's trainer weight-transfer engines, fed from buckets.

``start_push_transfer`` rendezvous vLLM's ``nccl`` or ``ipc`` trainer engine on every learner rank,
over a ``WeightSource`` that gathers the policy bucket by bucket (``bucket_weight_source``: the
learner holds one bucket plus vLLM's packed buffers beyond its model). ``EnvRunnerSyncClient`` is
vLLM's client protocol over the EnvRunner actors: rank 0 drives their begin / receive / end calls.
``flashrl.weight_sync.route.PushRoute`` keeps a run's transfer group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from flashrl.weight_sync.buckets import DEFAULT_BUCKET_BYTES, WeightManifest
from flashrl.weight_sync.gather import iter_weight_buckets, weight_manifest

__all__ = ["EnvRunnerSyncClient", "bucket_weight_source", "push_init_info", "start_push_transfer"]


def bucket_weight_source(
    model: nn.Module, manifest: WeightManifest, *, dtype: torch.dtype | None, device: torch.device | str
) -> Any:
    """A vLLM ``WeightSource`` over ``manifest``: ``metadata()`` from it, iteration bucket by bucket.

    vLLM's NCCL trainer engine sizes the workers' receive buffers from ``metadata()`` and checks
    every yielded tensor against it; its packed producer moves them in bounded buffers
    (``packed_buffer_size_bytes`` x ``packed_num_buffers``), so the learner holds one bucket plus
    those buffers beyond the model.
    """
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class _BucketSource(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(m.name, getattr(torch, m.dtype), tuple(m.shape)) for b in manifest for m in b]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in iter_weight_buckets(model, manifest, dtype=dtype, device=device):
                yield from bucket.items()

    return _BucketSource()


class EnvRunnerSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over the EnvRunner actors (one engine each).

    ``init_weight_transfer_engine`` gives runner ``i`` the NCCL ranks after those of runners
    ``0..i-1`` (``rank_offset = 1 + sum(workers before it)``; the learner is rank 0), so one NCCL
    group spans every worker of every engine. The other calls fan out to all runners and wait;
    ``update_weights`` must run concurrently with the learner's broadcast (vLLM's trainer engine
    calls it on a side thread).
    """

    def __init__(self, runners: Sequence[Any], workers_per_runner: Sequence[int], *, version: Callable[[], int],
                 timeout_s: float = 600.0) -> None:  # fmt: skip
        if len(runners) != len(workers_per_runner):
            raise ValueError(
                f"one worker count per runner expected: {len(runners)} runners, {len(workers_per_runner)} counts."
            )
        self.runners = list(runners)
        self.workers = [int(w) for w in workers_per_runner]
        self.version = version
        self.timeout_s = timeout_s

    @property
    def world_size(self) -> int:
        """The NCCL group: the learner (rank 0) and every worker of every engine."""
        return 1 + sum(self.workers)

    def _all(self, method: str, per_runner: Sequence[Any] | None = None, *args: Any) -> None:
        import ray

        calls = [
            getattr(r, method).remote(*(((per_runner[i],) if per_runner is not None else ()) + args))
            for i, r in enumerate(self.runners)
        ]
        ray.get(calls, timeout=self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        infos = []
        offset = int(init_info.get("rank_offset", 1))
        for workers in self.workers:
            infos.append({**init_info, "rank_offset": offset} if "rank_offset" in init_info else dict(init_info))
            offset += workers
        self._all("init_weight_transfer", infos)

    def start_weight_update(self) -> None:
        self._all("begin_weight_transfer")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._all("receive_weight_transfer", None, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = int(weight_version) if weight_version is not None else int(self.version())
        self._all("end_weight_transfer", None, version)


def start_push_transfer(
    route: str,
    model: nn.Module,
    client: EnvRunnerSyncClient,
    *,
    rank: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cuda",
    master_address: str | None = None,
    master_port: int | None = None,
) -> Any:
    """Rendezvous a vLLM trainer weight-transfer engine (``nccl`` or ``ipc``); call on every learner rank.

    Returns the engine; each update is then ``engine.send_weights()`` on every rank (rank 0 drives
    the runners' begin / receive / end through ``client``). ``nccl`` needs ``master_address`` and a
    free ``master_port`` on learner rank 0's node.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    manifest = weight_manifest(model, bucket_bytes=bucket_bytes, dtype=dtype)
    source = bucket_weight_source(model, manifest, dtype=dtype, device=device)
    info = push_init_info(route, rank=rank, world_size=client.world_size,
                          master_address=master_address, master_port=master_port)  # fmt: skip
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def push_init_info(
    route: str, *, rank: int, world_size: int, master_address: str | None, master_port: int | None
) -> Any:
    """vLLM's ``NCCLTrainerInitInfo`` / ``IPCTrainerInitInfo`` for ``route`` (packed transfers)."""
    if route == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        if not master_address or not master_port:
            raise ValueError(
                "weight_sync='nccl' needs master_address and master_port (a free port on learner rank 0's node)."
            )
        return NCCLTrainerInitInfo(master_address=master_address, master_port=int(master_port),
                                   world_size=int(world_size), packed=True, rank=int(rank))  # fmt: skip
    if route == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(packed=True, rank=int(rank))
    raise ValueError(f"push routes are 'nccl' and 'ipc'; got {route!r} (the 'shm' route is put_weight_buckets).")
