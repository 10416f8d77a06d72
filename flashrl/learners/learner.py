"""The generic learner: the policy, its parallelism, micro-batching, accumulation and ONE step per batch.

``Learner`` knows nothing of any algorithm. The algorithm's loss arrives as a ``Loss`` object
(``LearnerSpec.loss``; ``flashrl.learners.loss``), called once per micro-batch. An update on a batch
of B trajectories (``docs/design.md`` §1, step 6: exactly one optimizer step per batch):

1. ``context = loss.prepare(batch)`` on the WHOLE batch: the batch-global quantities (advantages,
   normalisers), identical on every rank.
2. Every rank computes the same layout from the same batch (``packing.plan_micro_batches``): trajectories
   assigned to ranks with balanced token counts, then into micro-batches under
   ``max_tokens_per_micro_batch`` (None: one per rank). A trajectory is never split. The batch moves to
   the device once; every micro-batch is gathered there.
3. For each of this rank's micro-batches: the current log-probs and entropies (packed into one row
   without padding, or right-padded), ``loss.compute_loss``, backward at once. Gradients accumulate;
   the shares add up to the whole batch's gradient because the loss divides by global normalisers.
   With several learners (FSDP2, ``policies.ShardedPolicy``) every backward reduce-scatters its shard
   gradients as a SUM, and every rank runs as many passes as the busiest one (an idle rank runs a pass
   that contributes zero), because each pass is a collective. Nothing is read back to the host in this
   loop (except, for episodes of several segments, their segment lengths once per pass: ``_logprobs``):
   the loss, the metrics and whether the pass was finite accumulate on the device.
4. One MAX collective agrees on a skip (a non-finite recomputed log-prob or loss on any rank) and
   reduces the metric maxima, one SUM reduces the metric sums; both come back to the host in ONE
   transfer. Then the global gradient norm, clipping, ONE optimizer step and one step of the
   learning-rate schedule.

Finiteness is checked once per quantity: the batch's rewards and recorded log-probs by
``TrainBatch.non_finite_reason`` before anything runs (skips ``non_finite_rewards`` and
``non_finite_behavior_logprobs``); the learner's own recomputed log-probs and entropies, and the loss,
on the device in step 3 (``non_finite_logprobs``, ``non_finite_loss``); the gradient by the policy's
clipping (``non_finite_gradients``). The loss function is called without value checks.

Metrics are the loss's (combined over micro-batches and ranks, ``LossMetrics``) plus the learner's:
``loss``, ``grad_norm`` (before clipping), ``tokens_total`` (non-padding tokens), ``episodes``,
``num_micro_batches`` (passes per rank), ``applied`` (1.0, or 0.0 for a skipped batch),
``num_skipped_batches``, ``version``, ``lr`` (this update's, after the schedule), ``logprob_time_s``
(forward passes), ``update_time_s``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import os
import random
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrl.learners import distributed
from flashrl.learners.batch import TrainBatch
from flashrl.learners.cpu_bfloat16 import slow_bfloat16_warning
from flashrl.learners.loss import BatchContext, LossMetrics, MicroBatch
from flashrl.learners.packing import BatchLayout, gather_rows, pack_rows, plan_micro_batches, unpack_rows
from flashrl.learners.policies import LocalPolicy, ShardedPolicy
from flashrl.learners.schedule import make_lr_scheduler
from flashrl.learners.segments import from_segments, split_segments, to_segments
from flashrl.learners.spec import LearnerSpec
from flashrl.learners.weight_gather import PolicyWeights
from flashrl.models.lora import is_adapter_name
from flashrl.weight_sync.endpoints import WeightOutbox
from flashrl.weight_sync.sender import LearnerMessage

__all__ = ["STATE_FORMAT", "Learner"]

logger = logging.getLogger(__name__)

STATE_FORMAT = 2
"""Version of the ``get_state`` dictionary layout (2: weights and optimizer state keyed by parameter name)."""

_SKIP_REASONS = ("non_finite_rewards", "non_finite_behavior_logprobs", "non_finite_logprobs", "non_finite_loss",
                 "non_finite_gradients")
_SKIP_CODES = {reason: i + 1 for i, reason in enumerate(_SKIP_REASONS)}
"""What ranks exchange (a MAX) to agree on a skip: 0 for none."""


class Learner:
    """One data-parallel rank of the policy and its optimizer (the only one with ``world_size=1``).

    Used directly (``LearnerGroup(..., local=True)``, tests, notebooks) and inside the Ray actors of a
    ``LearnerGroup``. With ``world_size > 1`` the default ``torch.distributed`` process group must be
    initialised before construction (``LearnerGroup`` does it; ``torchrun`` works too); the policy is
    then sharded with FSDP2 and every method is a collective.
    """

    def __init__(self, spec: LearnerSpec, *, rank: int = 0, world_size: int = 1) -> None:
        _check_group(rank, world_size)
        if spec.loss is None:
            raise ValueError(
                "LearnerSpec.loss is None; expected the algorithm's Loss object (e.g. "
                "flashrl.algorithms.flash_reinforce.learner_loss.FlashReinforceLossSpec(delta=...)). "
                "config.learner_spec(model=...) builds it from the algorithm's config."
            )
        if not Path(spec.model, "config.json").is_file():
            raise FileNotFoundError(
                f"LearnerSpec.model must be a local Hugging Face model folder with a config.json; got "
                f"{spec.model!r}. Use flashrl.models.resolve_model(...) to obtain one."
            )
        if spec.optimizer_offload and world_size == 1:
            raise ValueError(
                "LearnerSpec.optimizer_offload=True needs sharded learners (FSDP2, num_learners >= 2); got one "
                "learner. Set optimizer_offload=False, or use several learners."
            )
        self.spec = spec
        self.loss = spec.loss
        self.rank = rank
        self.world_size = world_size
        self.device = spec.resolve_device()
        slow = slow_bfloat16_warning(spec.dtype, str(self.device))
        if slow is not None and rank == 0:
            logger.warning("%s.", slow)
        _seed_everything(spec.seed)
        self.policy = ShardedPolicy(spec, self.device, rank) if world_size > 1 else LocalPolicy(spec, self.device)
        self.pack_sequences = self._resolve_packing()
        if spec.routing_replay:
            from flashrl.models.routing_replay import router_modules

            router_modules(self.model)  # a dense model, or a router that cannot be replayed, fails here
        self.lr_scheduler = make_lr_scheduler(self.optimizer, spec)
        self.version = 0
        """Number of applied updates (a skipped batch does not count)."""
        # LoRA: the adapter only, at its own float32 unless weight_sync_dtype says otherwise (it is small, and a
        # bfloat16-rounded adapter would move in coarse steps on a float32 engine)
        lora_dtype = None if spec.weight_sync_dtype is None else spec.sync_torch_dtype
        weights = PolicyWeights(lambda: self.policy.sync_model, device=self.device,
                                dtype=spec.sync_torch_dtype if spec.lora is None else lora_dtype,
                                select=None if spec.lora is None else is_adapter_name)
        self.weight_outbox = WeightOutbox(weights, rank=rank, version=lambda: self.version)
        """This rank's side of weight sync (``flashrl.weight_sync.endpoints``): every transport's sender."""
        self.skip_counts: Counter[str] = Counter()
        """Skipped batches by reason."""

    @property
    def model(self) -> torch.nn.Module:
        return self.policy.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.policy.optimizer

    @property
    def num_skipped_batches(self) -> int:
        return sum(self.skip_counts.values())

    def _resolve_packing(self) -> bool:
        """Pack when asked (or, for None, when attention is a varlen flash kernel), after a probe.

        A packing learner switches its model to the attention of ``spec.pack_attention``
        (``flashrl.models.packed_attention``: FlexAttention on CUDA unless flash attention is loaded).
        """
        from flashrl.models import packed_attention_implementation, packing_tolerance, verify_packed_attention

        implementation = str(getattr(self.model.config, "_attn_implementation", ""))
        pack = self.spec.pack_sequences if self.spec.pack_sequences is not None else "flash" in implementation
        if pack:
            packed = packed_attention_implementation(self.spec.pack_attention, self.device, implementation,
                                                     supports_flex=getattr(self.model, "_supports_flex_attn", False))
            if packed != implementation:
                self.model.set_attn_implementation(packed)
            # Refuses (with the fix) a model whose mask code would let packed sequences see each other; the
            # tolerance is the compute dtype's (the parameters are float32 under FSDP2 mixed precision).
            tolerance = packing_tolerance(self.spec.torch_dtype)
            self.policy.run(functools.partial(verify_packed_attention, atol=tolerance), self.model)
        return bool(pack)

    # ------------------------------------------------------------------------------------------
    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One update on ``batch`` (the whole global batch, on every rank): one optimizer step, or a skip."""
        start = time.perf_counter()
        if not isinstance(batch, TrainBatch):
            raise TypeError(f"Learner.update expects a TrainBatch; got {type(batch).__name__}.")
        # The one finiteness check of the batch's data (rewards, recorded log-probs), on the host copy.
        # Every rank holds the same batch, so every rank takes this decision identically.
        reason = batch.non_finite_reason()
        if reason is not None:
            return self._skip(reason, batch, start)
        if self.spec.routing_replay:
            self._check_routing(batch)
        layout = plan_micro_batches(batch.attention_mask.sum(-1), world_size=self.world_size,
                                    max_tokens_per_micro_batch=self.spec.max_tokens_per_micro_batch)
        batch = batch.to(self.device)  # once per update: every micro-batch is then gathered on the device
        context = self.loss.prepare(batch)
        lr = float(self.optimizer.param_groups[0]["lr"])  # this update's (scheduled) learning rate
        passes = _Passes(batch.batch_size, self._collective_device)
        self._accumulate(batch, layout, context, passes)
        reason, reduced = self._reduce(passes, context)
        if reason is not None:
            self.policy.zero_grad()
            return self._skip(reason, batch, start)
        grad_norm = self.policy.clip_and_step(self.spec.grad_clip)
        if grad_norm is None:
            return self._skip("non_finite_gradients", batch, start)
        self.lr_scheduler.step()  # after the optimizer, as Molt (molt/trainer/fsdp/strategy.py)
        self.version += 1

        metrics = {"loss": reduced.pop("loss"), "tokens_total": float(sum(layout.rank_tokens)),
                   "episodes": float(batch.batch_size)}
        metrics.update(reduced)
        metrics.update(
            grad_norm=grad_norm,
            num_micro_batches=float(max(len(r.micro_batches) for r in layout.ranks)),
            applied=1.0,
            num_skipped_batches=float(self.num_skipped_batches),
            version=float(self.version),
            lr=lr,
            logprob_time_s=passes.forward_time_s,
            update_time_s=time.perf_counter() - start,
        )
        return metrics

    def release_memory(self) -> int:
        """Give the device what the update cached and no longer holds, before a colocated engine wakes.

        After ``update`` the gradients are gone (the step sets them to None) and so are the activations
        and the batch (its locals); a garbage collection drops tensors that reference cycles still hold,
        and ``torch.cuda.empty_cache()`` returns the caching allocator's free blocks to the device,
        where vLLM's wake from sleep mode needs fresh physical memory (``flashrl.engines.colocation``).
        Returns the bytes the allocator still reserves (0 off CUDA: nothing to give back there).
        """
        if self.device.type != "cuda":
            return 0
        gc.collect()
        torch.cuda.empty_cache()
        return int(torch.cuda.memory_reserved(self.device))

    def _accumulate(self, batch: TrainBatch, layout: BatchLayout, context: BatchContext, passes: _Passes) -> None:
        """Forward and backward over this rank's micro-batches, reading nothing back to the host.

        Every rank runs the same number of passes (each is a collective under FSDP2). Whether a pass's
        recomputed log-probs and loss are finite is recorded on the device (``_Passes.add``); a pass
        whose values are not still runs its backward, and the batch is then skipped after the loop,
        once all ranks agree (its gradients are discarded, so what they hold does not matter).
        """
        mine = layout.for_rank(self.rank).micro_batches
        num_passes = max(len(r.micro_batches) for r in layout.ranks)
        # All of this rank's row indices in one host-to-device copy; each micro-batch is a slice of it.
        order = torch.tensor([i for mb in mine for i in mb.indices], dtype=torch.long, device=self.device)
        offsets = [0]
        for mb in mine:
            offsets.append(offsets[-1] + mb.num_sequences)
        self.policy.zero_grad()
        for k in range(num_passes):
            idle = k >= len(mine)  # an idle pass: the first row, weight 0
            members = mine[0] if idle else mine[k]
            indices, lengths = (members.indices[:1], members.lengths[:1]) if idle else (members.indices,
                                                                                          members.lengths)
            index = order[offsets[0]:offsets[0] + 1] if idle else order[offsets[k]:offsets[k + 1]]  # [b]
            rows = gather_rows(batch, indices, index=index, num_columns=max(lengths))
            with self._routing(rows):  # through the backward: checkpointed layers route again there
                t0 = time.perf_counter()
                logprobs, entropy = self.policy.run(self._logprobs, rows, lengths)  # [b, t], [b, t] or None
                passes.forward_time_s += time.perf_counter() - t0
                if idle:
                    _zero_loss(logprobs, entropy).backward()
                    continue
                loss, metrics = self.loss.compute_loss(MicroBatch(rows, index, logprobs, entropy), context)
                loss.backward()
            passes.add(loss, metrics, index, logprobs_ok=_all_finite(logprobs, entropy, rows.loss_mask))

    def _check_routing(self, batch: TrainBatch) -> None:
        """With ``routing_replay``: the batch carries routing that fits the policy (one host check per update)."""
        from flashrl.models.routing_replay import check_routing

        if batch.routed_experts is None:
            raise ValueError(
                "routing_replay=True, but no episode of the batch recorded its routed experts. Fix: sample with an "
                "engine that records them (the engine option record_routed_experts, which the env runners' "
                "routing_replay sets), or set routing_replay=False."
            )
        check_routing(batch.routed_experts, self.model)

    def _routing(self, rows: TrainBatch) -> contextlib.AbstractContextManager[None]:
        """The forward of ``rows`` routes to their recorded experts (``routing_replay``), else as it does.

        The routing is flattened as the forward flattens its tokens: packed, the real tokens row after
        row; padded, every position of the ``[b, t]`` rows, or of the ``[S, Ts]`` rows of their segments
        (padding carries -1: the live choice).
        """
        if not self.spec.routing_replay or rows.routed_experts is None:
            return contextlib.nullcontext()
        from flashrl.models.routing_replay import NO_ROUTING, replay_routing

        routed = rows.routed_experts  # [b, t, layers, k]
        if self.pack_sequences:
            flat = routed[rows.attention_mask]  # [N, layers, k] segments keep their tokens' order when packed
        elif rows.segment_positions is not None:  # one padded row per segment, as _logprobs lays them out
            split = split_segments(rows.segment_positions, rows.attention_mask)
            flat = to_segments(routed, split, fill=NO_ROUTING).flatten(0, 1)  # [S * Ts, layers, k]
        else:
            flat = routed.flatten(0, 1)  # [b * t, layers, k]
        return replay_routing(self.model, flat)

    def _logprobs(self, rows: TrainBatch, lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Current log-probs and entropies [b, t] of ``rows`` (packed into one row, or padded).

        Rows of several segments (``rows.segment_positions``): every segment is scored on its own context
        (``flashrl.learners.segments``), a packed sequence of its own or a padded row of its own whose
        results are folded back into the ``[b, t]`` rows. That reads the segments' lengths back once per
        micro-batch (the shape of the segment rows, or the packed sequences' longest), only for such rows.
        """
        from flashrl.models import compute_packed_token_logprobs, compute_token_logprobs

        options = {"temperature": self.spec.temperature, "chunk_size": self.spec.logprob_chunk_size,
                   "with_entropy": self.loss.needs_entropy}
        if not self.pack_sequences and rows.segment_positions is not None:
            split = split_segments(rows.segment_positions, rows.attention_mask)
            logprobs, entropy = compute_token_logprobs(self.model, to_segments(rows.token_ids, split), split.mask,
                                                       **options)  # [S, Ts], [S, Ts] or None
            return from_segments(logprobs, split), None if entropy is None else from_segments(entropy, split)
        if not self.pack_sequences:
            return compute_token_logprobs(self.model, rows.token_ids, rows.attention_mask, **options)
        packed = pack_rows(rows.token_ids, rows.attention_mask, lengths=lengths, positions=rows.segment_positions)
        logprobs, entropy = compute_packed_token_logprobs(  # pack_rows made the positions: no check
            self.model, packed.input_ids, packed.position_ids, check_positions=False, **options
        )  # [1, N], [1, N]
        return unpack_rows(logprobs, packed), None if entropy is None else unpack_rows(entropy, packed)

    def _reduce(self, passes: _Passes, context: BatchContext) -> tuple[str | None, dict[str, Any]]:
        """The skip reason all ranks agree on, and the whole batch's loss metrics, with one read-back.

        Two collectives: a SUM of this rank's loss, metric sums and per-row values packed into one
        tensor, and a MAX of its skip code, maxima and negated minima packed into another. Both are read
        back to the host together, the update's one transfer of its metrics (a skipped batch throws the
        metrics away; every rank runs both collectives either way, so they stay in step).
        """
        m = passes.metrics
        sum_keys, max_keys, min_keys, row_keys = sorted(m.sums), sorted(m.maxes), sorted(m.mins), sorted(passes.rows)
        sums = torch.cat([torch.stack([passes.loss] + [m.sums[k] for k in sum_keys])]
                         + [passes.rows[k] for k in row_keys])  # [1 + S + R * B]
        extremes = torch.stack([passes.skip_code.to(torch.float64)] + [m.maxes[k] for k in max_keys]
                               + [-m.mins[k] for k in min_keys])  # [1 + X + N]
        extremes, sums = distributed.all_reduce_max(extremes), distributed.all_reduce_sum(sums)
        # The context's tensor metrics are the same on every rank: read back, not reduced.
        batch_keys = [k for k, v in context.metrics.items() if isinstance(v, torch.Tensor)]
        batch_values = [context.metrics[k].detach().to(passes.device, torch.float64).reshape(1) for k in batch_keys]
        values = torch.cat([extremes, sums, *batch_values]).tolist()  # the one read-back
        code, extreme_values = int(values[0]), values[1:len(extremes)]
        loss, *rest = values[len(extremes):len(values) - len(batch_keys)]
        if code != 0:
            return _SKIP_REASONS[code - 1], {}
        out: dict[str, Any] = {"loss": loss}
        out.update(zip(sum_keys, rest[:len(sum_keys)]))
        batch_metrics = dict(zip(batch_keys, values[len(values) - len(batch_keys):]))
        out.update({k: batch_metrics.get(k, v) for k, v in context.metrics.items()})
        for i, key in enumerate(max_keys + min_keys):
            value = extreme_values[i] if i < len(max_keys) else -extreme_values[i]
            if math.isfinite(value):  # infinite: no micro-batch on any rank had a value
                out[key] = value
        b, row_values = passes.batch_size, rest[len(sum_keys):]
        for j, key in enumerate(row_keys):
            out[key] = row_values[j * b:(j + 1) * b]
        return None, out

    @property
    def _collective_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _skip(self, reason: str, batch: TrainBatch, start: float) -> dict[str, float]:
        self.skip_counts[reason] += 1
        logger.warning(
            "Skipped a batch of %d episodes (%s); %d skipped so far. The weights are unchanged.",
            batch.batch_size, reason, self.num_skipped_batches,
        )
        return {
            "applied": 0.0,
            f"skipped/{reason}": 1.0,
            "num_skipped_batches": float(self.num_skipped_batches),
            "version": float(self.version),
            "episodes": float(batch.batch_size),
            "update_time_s": time.perf_counter() - start,
        }

    # ------------------------------------------------------------------------------------------
    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's ``state_dict`` as CPU tensors under Hugging Face names (rank 0; {} on other ranks).

        Tied parameters (e.g. ``lm_head.weight`` and ``model.embed_tokens.weight``) appear under every
        name, as in ``state_dict``, but share one CPU copy. Sharded: gathered tensor by tensor from the
        shards (a collective).
        """
        return self.policy.full_weights()

    def sync_weights(self, message: LearnerMessage) -> Any:
        """One weight-sync message (``flashrl.weight_sync``), handed to this rank's sender of its transport.

        The weights sent are in ``weight_sync_dtype`` (default: the compute dtype); a bfloat16 learner
        syncing at float32 sends its float32 master weights (``LocalPolicy.sync_model``). Sharded,
        every rank takes every message (the gathers are collectives); rank 0 answers (e.g.
        ``PutBuckets``: the object refs, one ``ray.put`` per bucket; ``docs/engines.md``, Weight sync).
        """
        return self.weight_outbox.handle(message)

    def get_state(self) -> dict[str, Any]:
        """Everything needed to continue training exactly: weights, optimizer, schedule, RNG, counters.

        A plain dict of CPU tensors and Python values (``torch.load(..., weights_only=True)`` loads it):
        full tensors keyed by parameter name whatever the parallelism, so a state saved by one learner
        resumes on several and back. Sharded learners gather it to rank 0 (others return {}); for large
        models prefer ``save_state``, which never gathers.
        """
        model, optimizer = self.policy.train_state()
        if self.rank != 0:
            return {}
        return {"model": model, "optimizer": optimizer, **self._extra_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore what ``get_state`` returned (from any number of learners of the same model)."""
        missing = {"format", "model", "optimizer", "rng", "version"} - set(state)
        if missing:
            raise ValueError(f"Learner state is missing {sorted(missing)}; pass what Learner.get_state() returned.")
        self._check_format(state)
        self._check_lora(state)
        self.policy.load_train_state(state["model"], state["optimizer"])
        self._load_extra_state(state)

    def save_state(self, path: str | os.PathLike[str]) -> str:
        """Write the training state into the folder ``path`` without gathering it; returns the path.

        Sharded learners write torch DCP shards, every rank its own (the folder must be reachable by
        every rank); one learner writes one file. ``load_state`` reads either, on any number of sharded
        learners (DCP reshards). A collective when sharded.
        """
        return self.policy.save_state(path, self._extra_state())

    def load_state(self, path: str | os.PathLike[str], layout: str | None = None) -> None:
        """Restore what ``save_state`` wrote (a collective when sharded).

        ``layout``: ``single_file`` or ``dcp``, as a checkpoint's manifest says (``read_checkpoint`` gives
        it); None reads the one present and refuses a folder holding both.
        """
        # the adapter settings are checked before the weights load: a mismatch then says which setting
        extra = self.policy.load_state(path, layout, check=self._check_lora)
        self._check_format(extra)
        self._load_extra_state(extra)

    def _extra_state(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "rng": _rng_state(),
            "version": self.version,
            "skip_counts": dict(self.skip_counts),
            "spec": self.spec.to_dict(),
        }

    @staticmethod
    def _check_format(state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"Learner state format {state.get('format')!r} is not supported; expected {STATE_FORMAT}. Resume "
                "it with the flashrl version that saved it."
            )

    def _check_lora(self, state: dict[str, Any]) -> None:
        """The state's adapter settings (its saved spec's ``lora_*``) are this learner's (restore refuses others)."""
        saved = state.get("spec")
        if not isinstance(saved, dict):
            return
        keys = ("lora_rank", "lora_alpha", "lora_target_modules", "lora_dropout")
        mine = {k: getattr(self.spec, k) for k in keys}
        theirs = {k: saved.get(k, None if k == "lora_rank" else mine[k]) for k in keys}  # older states: full
        if theirs["lora_rank"] is None and mine["lora_rank"] is None:
            return
        if theirs["lora_rank"] is None or mine["lora_rank"] is None:  # full against adapter: the rank says it
            keys = ("lora_rank",)
            mine, theirs = {"lora_rank": mine["lora_rank"]}, {"lora_rank": theirs["lora_rank"]}
        if theirs != mine:
            diff = {k: (theirs[k], mine[k]) for k in keys if theirs[k] != mine[k]}
            raise ValueError(
                f"Learner state: expected the adapter settings this run trains with ({mine}), got a checkpoint "
                f"saved with {theirs} (differs in {sorted(diff)}). Fix: resume with the checkpoint's settings "
                f"({', '.join(f'{k}={v[0]!r}' for k, v in diff.items())}), or start a new run."
            )

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        else:  # a state saved without a schedule: the schedule is at its `version`-th update
            self.lr_scheduler = make_lr_scheduler(self.optimizer, self.spec)
            with warnings.catch_warnings():  # fast-forwarding without optimizer steps is the point here
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)`")
                for _ in range(int(state["version"])):
                    self.lr_scheduler.step()
        _set_rng_state(state["rng"])
        self.version = int(state["version"])
        self.skip_counts = Counter(state.get("skip_counts", {}))

    def save_policy(self, path: str | os.PathLike[str], *, merged: bool = False) -> str:
        """Write the policy as a Hugging Face folder (config, safetensors, tokenizer); returns the path.

        With LoRA: the adapter in PEFT's format (``PeftModel.from_pretrained`` loads it), or with
        ``merged`` the base model with the adapter merged in.

        transformers (``AutoModelForCausalLM.from_pretrained``) and vLLM load it directly. The folder is
        written beside the target and renamed into place, so a reader never sees a half-written policy.
        An existing policy folder at ``path`` is replaced. Sharded: gathered to rank 0, which writes.
        """
        if self.spec.lora is not None:
            return self.policy.save_policy(path, merged=merged)
        return self.policy.save_policy(path)


# --------------------------------------------------------------------------------------------------
class _Passes:
    """What this rank's passes of one update added up, on the device: loss, metrics, rows, skip code."""

    def __init__(self, batch_size: int, device: torch.device) -> None:
        self.batch_size = batch_size
        self.device = device
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.metrics = LossMetrics()
        self.rows: dict[str, torch.Tensor] = {}
        self.skip_code = torch.zeros((), dtype=torch.int64, device=device)
        """0, or 1 + the index in ``_SKIP_REASONS`` of this rank's first non-finite pass."""
        self.forward_time_s = 0.0
        self._first = True

    def add(self, loss: torch.Tensor, metrics: LossMetrics, indices: torch.Tensor, *, logprobs_ok: torch.Tensor) -> None:
        loss = loss.detach()
        # The learner's own finiteness check: its recomputed log-probs (a fault of the learner, not of the
        # data, which TrainBatch.non_finite_reason checked), then the loss. Kept on the device.
        code = torch.where(~logprobs_ok, _SKIP_CODES["non_finite_logprobs"],
                           torch.where(torch.isfinite(loss), 0, _SKIP_CODES["non_finite_loss"]))
        self.skip_code = torch.where(self.skip_code == 0, code, self.skip_code)  # the first reason stays
        self.loss = self.loss + loss.to(self.device, torch.float64)
        for key, values in metrics.rows.items():
            full = self.rows.setdefault(key, torch.zeros(self.batch_size, dtype=torch.float64, device=self.device))
            full.index_copy_(0, indices.to(self.device), values.detach().to(self.device, torch.float64))  # [B]
        metrics = LossMetrics(*(
            {k: torch.as_tensor(v).detach().to(self.device, torch.float64) for k, v in kind.items()}
            for kind in (metrics.sums, metrics.maxes, metrics.mins)
        ))
        if self._first:
            self.metrics = metrics
            self._first = False
        else:
            self.metrics.merge(metrics)


def _zero_loss(logprobs: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
    """A loss of exactly zero gradient through this pass (its backward keeps the ranks' collectives in step)."""
    loss = (logprobs * 0.0).sum()
    return loss if entropy is None else loss + (entropy * 0.0).sum()


def _all_finite(logprobs: torch.Tensor, entropy: torch.Tensor | None, valid: torch.Tensor) -> torch.Tensor:
    """0-d bool on the device: the recomputed log-probs (and entropies) are finite at every valid token."""
    ok = (torch.isfinite(logprobs.detach()) | ~valid).all()
    return ok if entropy is None else ok & (torch.isfinite(entropy.detach()) | ~valid).all()


def _check_group(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"Expected 0 <= rank < world_size; got rank={rank}, world_size={world_size}.")
    if world_size > 1 and not distributed.is_distributed():
        raise RuntimeError(
            f"Learner rank {rank} of {world_size}: torch.distributed is not initialised. Use "
            "LearnerGroup(num_learners=...), or call flashrl.learners.distributed.init_process_group first."
        )
    if world_size > 1 and (torch.distributed.get_rank() != rank or torch.distributed.get_world_size() != world_size):
        raise RuntimeError(
            f"Learner built as rank {rank} of {world_size}, but the process group says rank "
            f"{torch.distributed.get_rank()} of {torch.distributed.get_world_size()}."
        )


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    np_state = state["numpy"]
    np.random.set_state(
        (np_state["kind"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"], np_state["has_gauss"],
         np_state["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
