"""The learner's side of weight sync: the policy's weights as bounded buckets.

``weight_plan`` declares every tensor (Hugging Face names, a tied parameter once under its first
name, global shapes of sharded tensors) cut into buckets of at most ``bucket_bytes`` at layer
boundaries (``flashrl.engines.weight_stream.plan_buckets``), without gathering anything.
``iter_weight_buckets`` then materialises them one bucket at a time (for a sharded model each tensor
is all-gathered: a collective, so every rank consumes the generator to the end) and
``put_weight_buckets`` puts each bucket into the Ray object store as soon as it is complete, so the
learner holds at most one bucket beyond its model; the env runners fetch the refs one at a time.

The GPU push routes (vLLM's NCCL / IPC weight-transfer engines, fed from the same buckets) are
``start_push_transfer`` below, and ``WeightPusher`` keeps a run's transfer group (formed again after a
runner restart); the algorithm uses it when the runners' engines resolved ``weight_sync`` to ``nccl``
or ``ipc``. They have not run yet (no GPU where they were written): their control flow is tested
on CPU, their data plane is vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from flashrl.engines.weight_stream import DEFAULT_BUCKET_BYTES, TensorMeta, WeightBuckets, plan_buckets

__all__ = [
    "EnvRunnerSyncClient",
    "WeightPusher",
    "bucket_weight_source",
    "iter_weight_buckets",
    "put_weight_buckets",
    "start_push_transfer",
    "weight_plan",
]

Plan = tuple[tuple[TensorMeta, ...], ...]


def _unique_entries(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """State-dict entries, each tensor object once (a tied head is left out), HF names."""
    from flashrl.learners.fsdp import clean_name

    seen: set[int] = set()
    # keep_vars: the registered parameters themselves, so a tied weight is one object under two names
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        yield clean_name(name), tensor


def weight_plan(model: nn.Module, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None) -> Plan:
    """The buckets ``iter_weight_buckets`` will produce (names, dtypes after the cast, full shapes)."""
    metas = []
    for name, tensor in _unique_entries(model):
        out = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        metas.append(TensorMeta(name, str(out).removeprefix("torch."), tuple(int(s) for s in tensor.shape)))
    return plan_buckets(metas, bucket_bytes)


def iter_weight_buckets(
    model: nn.Module,
    plan: Plan,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = "cpu",
) -> Iterator[dict[str, torch.Tensor]]:
    """Bucket ``k`` of ``plan`` as ``{name: full tensor}``, one bucket at a time.

    Sharded tensors are gathered tensor by tensor (``flashrl.learners.fsdp.iter_full_tensors``, a
    collective: every rank iterates to the end); a tensor already on ``device`` in its dtype is
    handed out as is (no copy), so an unsharded model on the CPU costs nothing extra here. The
    generator keeps no reference to a bucket it has yielded.
    """
    from flashrl.learners.fsdp import iter_full_tensors

    tensors = iter_full_tensors(model, dtype=dtype, device=device)
    for index, planned in enumerate(plan):
        bucket: dict[str, torch.Tensor] = {}
        for meta in planned:
            name, tensor = next(tensors)
            if name != meta.name:
                raise RuntimeError(
                    f"bucket {index}: the model yielded {name!r} where the plan has {meta.name!r}; the plan "
                    "was made from another model (or the model changed). Fix: weight_plan(model) again."
                )
            bucket[name] = tensor
        yield bucket
        del bucket  # the consumer owns it now
    leftover = next(tensors, None)
    if leftover is not None:
        raise RuntimeError(f"the model has tensors the plan lacks (first: {leftover[0]!r}); rebuild the plan.")


def put_weight_buckets(
    model: nn.Module,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    is_sender: bool = True,
    put: Callable[[Any], Any] | None = None,
) -> WeightBuckets | None:
    """The weights as a ``WeightBuckets`` of Ray object refs, one ``ray.put`` per bucket.

    Each bucket is put as soon as it is complete and then dropped: the learner holds at most one
    bucket beyond its model. On a sharded model every rank calls this (the gathers are collectives);
    ranks with ``is_sender=False`` put nothing and get None. ``put`` defaults to ``ray.put``.
    """
    if put is None:
        import ray

        put = ray.put
    plan = weight_plan(model, bucket_bytes=bucket_bytes, dtype=dtype)
    refs = []
    for bucket in iter_weight_buckets(model, plan, dtype=dtype):
        if is_sender:
            refs.append(put(bucket))
        del bucket
    return WeightBuckets(plan, refs) if is_sender else None


# --------------------------------------------------------------------------------------------------
# GPU push routes: vLLM's weight-transfer engines (not run yet: no GPU where this was written)
# --------------------------------------------------------------------------------------------------
def bucket_weight_source(model: nn.Module, plan: Plan, *, dtype: torch.dtype | None, device: torch.device | str) -> Any:
    """A vLLM ``WeightSource`` over ``plan``: ``metadata()`` from the plan, iteration bucket by bucket.

    vLLM's NCCL trainer engine sizes the workers' receive buffers from ``metadata()`` and checks
    every yielded tensor against it; its packed producer moves them in bounded buffers
    (``packed_buffer_size_bytes`` x ``packed_num_buffers``), so the learner holds one bucket plus
    those buffers beyond the model.
    """
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class _BucketSource(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(m.name, getattr(torch, m.dtype), tuple(m.shape)) for b in plan for m in b]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in iter_weight_buckets(model, plan, dtype=dtype, device=device):
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

    plan = weight_plan(model, bucket_bytes=bucket_bytes, dtype=dtype)
    source = bucket_weight_source(model, plan, dtype=dtype, device=device)
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


class WeightPusher:
    """A run's push route: each new version goes from the learners straight into the runners' workers.

    ``push(runners)`` before every transfer pings the runners (``EnvRunnerGroup.check_alive``: a dead
    member would leave the others waiting inside the collective), forms the transfer group again
    whenever the runner set changed (a restart, or a new ``EnvRunnerGroup`` after a restore), then has
    every learner rank send (``LearnerGroup.push_weights``). A replacement runner is outside the group
    until then, so it loads the learner's current weights through the ``shm`` stream first (the group's
    ``weights_source``). A runner that dies *during* a transfer fails the learner call (the collective
    cannot complete); restore from the last checkpoint. Not run on a GPU yet.

    Args:
        route: ``nccl`` or ``ipc`` (what the runners' engines resolved ``weight_sync`` to).
        learners: the run's ``LearnerGroup``.
        bucket_bytes: bucket size of the gathers feeding vLLM's packed producer.
    """

    def __init__(self, route: str, learners: Any, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        from flashrl.engines.weight_transfer import PUSH_ROUTES

        if route not in PUSH_ROUTES:
            raise ValueError(f"WeightPusher: route must be one of {PUSH_ROUTES}; got {route!r} (shm is pulled).")
        self.route = route
        self.learners = learners
        self.bucket_bytes = bucket_bytes
        self.num_formations = 0
        """How many times the transfer group was formed (1 + the re-formations after restarts)."""
        self._formed: tuple[Any, int] | None = None

    def ensure_group(self, runners: Any) -> bool:
        """Form the transfer group over ``runners`` unless it is formed with exactly these actors; True if formed."""
        runners.weights_source = self._current_weights
        if self._formed is not None and self._formed[0] is runners and self._formed[1] == runners.generation:
            return False
        self.learners.start_weight_push(
            self.route, runners.actors, runners.transfer_workers, bucket_bytes=self.bucket_bytes
        )
        self._formed = (runners, runners.generation)
        self.num_formations += 1
        return True

    def push(self, runners: Any) -> float:
        """Send the learners' current weights to every runner; returns the seconds it took."""
        import time

        start = time.perf_counter()
        runners.check_alive()
        self.ensure_group(runners)
        self.learners.push_weights()
        return time.perf_counter() - start

    def stop(self) -> None:
        """Tear the transfer group down (idempotent)."""
        if self._formed is not None:
            self._formed = None
            self.learners.stop_weight_push()

    def _current_weights(self) -> tuple[int, Any]:
        return self.learners.version, self.learners.weight_buckets_refs(self.bucket_bytes)
