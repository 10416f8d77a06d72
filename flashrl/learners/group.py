"""A group of learners: one in-process ``Learner`` or data-parallel ``Learner`` Ray actors.

With ``num_learners = N > 1`` every actor is rank ``r`` of a ``torch.distributed`` process group
(gloo on CPU, NCCL on GPU) and the policy is sharded over them with FSDP2 (parameters, gradients and
optimizer state). Rank 0's actor picks a free TCP port on its own node for the rendezvous. Each update
sends the whole batch to every rank once through the object store; each rank trains on its share of
the trajectories and the backward passes reduce-scatter the gradients (see
``flashrl.learners.learner`` for why that is exact). Reading the weights or the full state gathers
the shards, so those calls go to every actor; rank 0 returns the result (``save_state`` never gathers:
every rank writes its own shards).

A dead actor is fatal for the group (its process group is broken): the call raises
``LearnerGroupError`` naming the rank, the other actors are stopped, and later calls raise too
(``failure`` says why). The group never restarts itself: the algorithm builds a new one and restores
the last checkpoint (``FlashReinforce``'s ``restart_failed_learners``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from flashrl.learners import distributed
from flashrl.learners.batch import TrainBatch
from flashrl.learners.learner import Learner
from flashrl.learners.spec import LearnerSpec
from flashrl.weight_sync.messages import PutBuckets
from flashrl.weight_sync.sender import LearnerMessage
from flashrl.weight_sync.vllm_push import StartPush

if TYPE_CHECKING:
    from typing import Self

__all__ = ["LearnerActor", "LearnerGroup", "LearnerGroupError"]

FINISH_GRACE_S = 60.0
"""After one rank's save raised: how long the other ranks may take to end the same call before the group
counts as out of step (stopped). flashrl's own choice."""


class LearnerGroupError(RuntimeError):
    """A learner actor died, timed out or the group was used after it broke or shut down."""


class LearnerActor:
    """The body of a learner Ray actor: builds its ``Learner`` once the process group exists."""

    def __init__(self, spec: LearnerSpec, rank: int, world_size: int) -> None:
        logging.getLogger("flashrl").setLevel(spec.log_level)  # the run's level, in this actor's process
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.learner: Learner | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a free port on it (asked of rank 0)."""
        import ray

        return ray.util.get_node_ip_address(), distributed.find_free_port()

    def transfer_devices(self) -> tuple[str, ...]:
        """The GPUs Ray gave this learner (``flashrl.weight_sync.layout.gpu_slots``); () on the CPU."""
        from flashrl.weight_sync.layout import gpu_slots

        return gpu_slots(self.spec.resolve_device())

    def setup(self, master_addr: str, master_port: int, timeout_s: float) -> int:
        if self.world_size > 1:
            device = self.spec.resolve_device()
            if device.type == "cuda":
                torch.cuda.set_device(device)
            distributed.init_process_group(
                master_addr=master_addr,
                master_port=master_port,
                rank=self.rank,
                world_size=self.world_size,
                backend=distributed.default_backend(device),
                timeout_s=timeout_s,
            )
        self.learner = Learner(self.spec, rank=self.rank, world_size=self.world_size)
        return os.getpid()

    def update(self, batch: TrainBatch) -> dict[str, float]:
        return self._learner.update(batch)

    def release_memory(self) -> int:
        return self._learner.release_memory()

    def get_weights(self) -> dict[str, torch.Tensor]:
        return self._learner.get_weights()

    def sync_weights(self, message: LearnerMessage) -> Any:
        return self._learner.sync_weights(message)

    def get_state(self) -> dict[str, Any]:
        return self._learner.get_state()

    def set_state(self, state: dict[str, Any]) -> int:
        self._learner.set_state(state)
        return self._learner.version

    def save_policy(self, path: str, merged: bool = False) -> str:
        return self._learner.save_policy(path, merged=merged)

    def save_state(self, path: str) -> str:
        return self._learner.save_state(path)

    def load_state(self, path: str, layout: str | None = None) -> tuple[int, int]:
        self._learner.load_state(path, layout)
        return self._learner.version, self._learner.num_skipped_batches

    def version(self) -> int:
        return self._learner.version

    def shutdown(self) -> None:
        if distributed.is_distributed():
            torch.distributed.destroy_process_group()

    @property
    def _learner(self) -> Learner:
        if self.learner is None:
            raise RuntimeError("LearnerActor.setup() has not run yet.")
        return self.learner


class LearnerGroup:
    """The learner side of training, with one API whether it runs in-process or as Ray actors.

    Args:
        spec: model, optimizer, micro-batching and the algorithm's loss, shared by every learner.
        num_learners: data-parallel replicas (Ray actors); 1 with ``local=True``.
        num_cpus_per_learner: CPUs each actor reserves (fractions allowed; see the 2-core notes).
        num_gpus_per_learner: GPUs each actor reserves (> 0 puts the policy on that GPU, NCCL between ranks).
        local: run one ``Learner`` in this process (tests, debugging); no Ray needed.
        timeout_s: upper bound on any single call to the actors (seconds); None waits forever.
    """

    def __init__(
        self,
        spec: LearnerSpec,
        *,
        num_learners: int = 1,
        num_cpus_per_learner: float = 1.0,
        num_gpus_per_learner: float = 0.0,
        local: bool = False,
        timeout_s: float | None = 1800.0,
    ) -> None:
        if num_learners < 1:
            raise ValueError(f"num_learners must be >= 1; got {num_learners}.")
        if local and num_learners != 1:
            raise ValueError(
                f"local=True runs exactly one in-process learner; got num_learners={num_learners}. Use "
                "local=False for data-parallel Ray actors."
            )
        if num_cpus_per_learner < 0 or num_gpus_per_learner < 0:
            raise ValueError(
                f"Resources per learner must be >= 0; got num_cpus_per_learner={num_cpus_per_learner}, "
                f"num_gpus_per_learner={num_gpus_per_learner}."
            )
        if num_gpus_per_learner > 0 and spec.device == "cpu":
            raise ValueError(
                f"num_gpus_per_learner={num_gpus_per_learner} but LearnerSpec.device='cpu'; use device='auto' "
                "(or 'cuda') to train on the reserved GPU, or num_gpus_per_learner=0."
            )
        if num_learners > 1 and 0 < num_gpus_per_learner < 1:
            raise ValueError(
                f"num_gpus_per_learner={num_gpus_per_learner} with num_learners={num_learners}: NCCL needs a "
                "whole GPU per rank. Use num_gpus_per_learner=1, or one learner."
            )
        self.spec = spec
        self.num_learners = num_learners
        self.local = local
        self.timeout_s = timeout_s
        self._local: Learner | None = None
        self._actors: list[Any] = []
        self._broken: str | None = None
        self._version = 0
        self._num_skipped = 0
        if local:
            self._local = Learner(spec)
        else:
            self._start_actors(num_cpus_per_learner, num_gpus_per_learner)

    def _start_actors(self, num_cpus: float, num_gpus: float) -> None:
        import ray

        if not ray.is_initialized():
            raise LearnerGroupError(
                "LearnerGroup(local=False) needs a running Ray cluster; call ray.init() first (or use local=True)."
            )
        actor_cls = ray.remote(
            num_cpus=num_cpus, num_gpus=num_gpus, resources=dict(self.spec.custom_resources_per_learner),
            max_restarts=0,
        )(LearnerActor)
        self._actors = [actor_cls.remote(self.spec, rank, self.num_learners) for rank in range(self.num_learners)]
        try:
            addr, port = self._call("find a rendezvous port", [self._actors[0].rendezvous_address.remote()])[0]
            setup_timeout = self.timeout_s if self.timeout_s is not None else 1800.0
            self._call(
                "set up the learners",
                [actor.setup.remote(addr, port, setup_timeout) for actor in self._actors],
            )
        except BaseException:
            self._kill_actors()
            raise

    # ------------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Number of updates applied so far (skipped batches do not count)."""
        return self._version

    @property
    def num_skipped_batches(self) -> int:
        return self._num_skipped

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One update on ``batch`` (the algorithm's loss, ``spec.loss``): exactly one optimizer step, or a skip."""
        self._check_usable()
        if not isinstance(batch, TrainBatch):
            raise TypeError(f"LearnerGroup.update expects a TrainBatch; got {type(batch).__name__}.")
        if batch.batch_size < self.num_learners:
            raise ValueError(
                f"A batch of {batch.batch_size} episodes cannot be split over {self.num_learners} learners; "
                "use train_batch_size >= num_learners."
            )
        if self._local is not None:
            metrics = self._local.update(batch)
        else:
            import ray

            ref = ray.put(batch)
            results = self._call("update", [actor.update.remote(ref) for actor in self._actors])
            versions = {int(m["version"]) for m in results}
            if len(versions) != 1:
                self._broken = f"learner replicas disagree on the version after an update: {sorted(versions)}"
                self._kill_actors()
                raise LearnerGroupError(f"LearnerGroup is inconsistent: {self._broken}.")
            metrics = results[0]
        self._version = int(metrics["version"])
        self._num_skipped = int(metrics["num_skipped_batches"])
        return metrics

    def release_memory(self) -> None:
        """Every learner gives its device back what its update cached (``Learner.release_memory``): the
        driver calls it before colocated engines wake from sleep mode."""
        self._check_usable()
        if self._local is not None:
            self._local.release_memory()
            return
        self._call("release their cached memory", [actor.release_memory.remote() for actor in self._actors])

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights (CPU tensors, Hugging Face names), gathered to rank 0."""
        self._check_usable()
        if self._local is not None:
            return self._local.get_weights()
        return self._call("get_weights", [actor.get_weights.remote() for actor in self._actors])[0]

    def sync_weights(self, message: LearnerMessage) -> Any:
        """One weight-sync message (``flashrl.weight_sync``) to every learner rank; rank 0's answer.

        Every rank takes it (the gathers of a sharded policy are collectives). ``PutBuckets``' answer is
        a ``WeightBuckets`` of object refs owned by learner rank 0 (or this process when local), which
        must stay alive while the runners fetch them. A ``StartPush`` without an address gets a free
        port on learner rank 0's node (this node for a local learner) for ``nccl``'s rendezvous.
        """
        import ray

        self._check_usable()
        if isinstance(message, StartPush) and message.master_address is None:
            if self._local is not None:
                address, port = ray.util.get_node_ip_address(), distributed.find_free_port()
            else:
                address, port = self._call("find a transfer port", [self._actors[0].rendezvous_address.remote()])[0]
            message = replace(message, master_address=address, master_port=port)
        if self._local is not None:
            if isinstance(message, PutBuckets) and not ray.is_initialized():
                raise LearnerGroupError("sync_weights(PutBuckets) needs a running Ray cluster; call ray.init() first.")
            return self._local.sync_weights(message)
        refs = [actor.sync_weights.remote(message) for actor in self._actors]
        return self._call(f"sync_weights({type(message).__name__})", refs)[0]

    # -- GPU push routes (vLLM's NCCL / IPC weight-transfer engines) ---------------------------------
    def transfer_devices(self) -> list[list[str]]:
        """Per learner rank, its GPUs as ``<node>/<GPU id>`` ([] on the CPU): a push route's layout check."""
        from flashrl.weight_sync.layout import gpu_slots

        self._check_usable()
        if self._local is not None:
            return [list(gpu_slots(self._local.device))]
        devices = self._call("report their devices", [actor.transfer_devices.remote() for actor in self._actors])
        return [list(d) for d in devices]

    def get_state(self) -> dict[str, Any]:
        """``Learner.get_state()``: full tensors gathered to rank 0 (loadable by any number of learners)."""
        self._check_usable()
        if self._local is not None:
            return self._local.get_state()
        return self._call("get_state", [actor.get_state.remote() for actor in self._actors])[0]

    def set_state(self, state: dict[str, Any]) -> None:
        """Load ``state`` into every replica."""
        self._check_usable()
        if self._local is not None:
            self._local.set_state(state)
            self._version = self._local.version
        else:
            import ray

            ref = ray.put(state)
            self._version = int(self._call("set_state", [a.set_state.remote(ref) for a in self._actors])[0])
        self._num_skipped = sum(state.get("skip_counts", {}).values())

    def save_state(self, path: str | os.PathLike[str]) -> str:
        """``Learner.save_state`` on every rank: sharded learners write DCP shards, never gathering them.

        Each rank holds its shards and one tensor in flight (DCP copies a tensor to the host and writes
        it); a single learner writes one file from its actor, nothing passes through the object store.
        The folder must be reachable by every rank (one node, or a shared filesystem).
        """
        self._check_usable()
        if self._local is not None:
            return self._local.save_state(path)
        path = os.fspath(path)
        return self._call("save_state", [actor.save_state.remote(path) for actor in self._actors],
                          keeps_state=True)[0]

    def load_state(self, path: str | os.PathLike[str], *, layout: str | None = None) -> None:
        """``Learner.load_state`` on every rank (DCP reshards a folder saved by another number of learners).

        ``layout``: a checkpoint's ``learner_layout`` (``single_file`` or ``dcp``); None: the file present.
        """
        self._check_usable()
        if self._local is not None:
            self._local.load_state(path, layout)
            self._version = self._local.version
            self._num_skipped = self._local.num_skipped_batches
            return
        path = os.fspath(path)
        version, skipped = self._call("load_state", [a.load_state.remote(path, layout) for a in self._actors])[0]
        self._version, self._num_skipped = int(version), int(skipped)

    def save_policy(self, path: str | os.PathLike[str], *, merged: bool = False) -> str:
        """Write the policy as a Hugging Face folder on rank 0's node (sharded: streamed to rank 0 in buckets).

        With LoRA: the adapter in PEFT's format; ``merged``: the base model with the adapter merged in
        (``Learner.save_policy``'s)."""
        self._check_usable()
        if self._local is not None:
            return self._local.save_policy(path, merged=merged)
        path = os.fspath(path)
        return self._call("save_policy", [actor.save_policy.remote(path, merged) for actor in self._actors],
                          keeps_state=True)[0]

    def shutdown(self) -> None:
        """Stop the actors (idempotent). The group cannot be used afterwards."""
        if self._actors and self._broken is None:
            try:
                self._call("shut down", [actor.shutdown.remote() for actor in self._actors], timeout_s=60.0)
            except LearnerGroupError:
                pass  # the actors are killed below either way
        self._kill_actors()
        self._local = None
        if self._broken is None:
            self._broken = "it was shut down"

    @property
    def failure(self) -> str | None:
        """Why the group cannot be used any more (an actor died or timed out, replicas disagree, it was
        shut down); None while it is usable."""
        return self._broken

    def kill(self, rank: int) -> None:
        """Kill learner actor ``rank`` (fault injection for tests and drills): the next call fails."""
        if not 0 <= rank < len(self._actors):
            raise ValueError(
                f"kill: expected the rank of a running learner actor, one of {list(range(len(self._actors)))}, "
                f"got {rank}. Fix: pass a rank below num_learners (an in-process learner, local=True, or a "
                "stopped group has no actor)."
            )
        from flashrl.ray_utils import kill_and_confirm

        kill_and_confirm(self._actors[rank])  # returns once the actor is dead: the next call fails

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._broken is not None:
            raise LearnerGroupError(f"This LearnerGroup cannot be used: {self._broken}. Build a new one.")

    def _call(
        self, what: str, refs: Sequence[Any], *, timeout_s: float | None = None, first_rank: int = 0,
        keeps_state: bool = False,
    ) -> list[Any]:
        """Results of ``refs`` (ranks ``first_rank``, ``first_rank + 1``, ... in order), failing fast on the
        first actor death, error or timeout.

        ``keeps_state``: the call changes no replica's training state (a save). An error it raises leaves
        the group usable when every rank finishes the call (none is left inside a collective), so a
        failed save can be retried; otherwise an error on one of several ranks stops the group."""
        import ray

        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        rank_of = {ref: first_rank + i for i, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                self._fail(
                    f"learner call '{what}' did not finish within {timeout_s:.0f} s (ranks "
                    f"{sorted(rank_of[r] for r in pending)} still running). Raise LearnerGroup(timeout_s=...) "
                    "if updates are legitimately slow, or check that the cluster has the CPUs/GPUs the "
                    "learners asked for"
                )
            try:
                ray.get(ready[0], timeout=0 if deadline is None else max(deadline - time.monotonic(), 0.0))
            except ray.exceptions.RayTaskError:
                if keeps_state and self._all_finish(pending, deadline):
                    raise  # every rank is out of the call: the replicas are still in step
                if len(self._actors) > 1:
                    # Its partners may now wait forever inside a collective: the group is unusable.
                    self._broken = f"learner rank {rank_of[ready[0]]} raised during '{what}'"
                    self._kill_actors()
                raise  # the actor's own exception (also an instance of its original type)
            except ray.exceptions.RayError as error:
                # Any other way the actor or its result went away (died, worker crashed, OOM-killed, node
                # died, object lost): a fault of the group, which the algorithm restarts.
                self._fail(
                    f"learner actor rank {rank_of[ready[0]]} died during '{what}' ({type(error).__name__}): {error}",
                    error,
                )
        return ray.get(list(refs))

    def _all_finish(self, refs: Sequence[Any], deadline: float | None) -> bool:
        """Whether every call of ``refs`` ends before ``deadline``, returning or raising in its actor (not
        with the actor's death)."""
        import ray

        if refs:
            # A save's ranks end together (DCP gathers their failures, the export ends in a barrier): one
            # still running a while later waits inside a collective for a partner that left it.
            remaining = FINISH_GRACE_S if deadline is None else min(FINISH_GRACE_S, deadline - time.monotonic())
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=max(remaining, 0.0))
            if len(ready) < len(refs):
                return False
        for ref in refs:
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError:
                continue
            except ray.exceptions.RayError:
                return False
        return True

    def _fail(self, message: str, cause: BaseException | None = None) -> None:
        self._broken = message
        self._kill_actors()
        raise LearnerGroupError(
            f"{message}. The learner group is stopped (its replicas can no longer stay in sync); build a "
            "new LearnerGroup and restore the last checkpoint."
        ) from cause

    def _kill_actors(self) -> None:
        import ray

        for actor in self._actors:
            ray.kill(actor, no_restart=True)  # a no-op for an actor that is already dead
        self._actors = []
