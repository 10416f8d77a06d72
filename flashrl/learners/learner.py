"""The policy, its optimizer and the FlashREINFORCE update: one optimizer step per batch.

Data parallelism keeps the method exact. Every rank receives the WHOLE batch (token ids are small)
and computes the batch-global quantities on it: the baseline's advantages ``A_i = R_i - b_i`` and the
normaliser (B for sample-mean, the valid-token count for token-mean). It then recomputes log-probs on
its own contiguous shard only and evaluates the loss with those global values (B, the valid-token
count, the constant length), so its loss is that shard's share of the global loss,
``-(1/B) sum_{i in shard} ...``. Summing the gradients over ranks
(all-reduce SUM) then gives exactly the gradient of the global loss; each rank clips and steps on the
same summed gradient, so the replicas stay identical. Metrics are reduced the same way (sums and maxes
over ranks), so every rank returns the metrics of the global batch.

Returned metrics (flat floats): ``loss``, ``grad_norm`` (before clipping), ``accepted_fraction``,
``num_rejected``, ``drift_mean``, ``drift_max``, ``ratio_mean``, ``ratio_min``, ``ratio_max``,
``advantage_mean``, ``advantage_std``, ``reward_mean``, ``entropy_mean``, ``tokens_valid`` (sampled
tokens), ``tokens_kept`` (those in the loss), ``tokens_total`` (all non-padding tokens), ``episodes``,
``applied`` (1.0, or 0.0 for a skipped batch), ``num_skipped_batches``, ``version``, ``lr`` (the
learning rate this update used, after the schedule), ``logprob_time_s``, ``update_time_s``. The
``ratio_*`` metrics are the current/behavior probability ratios of the sampled tokens, a diagnostic of
the policy lag, whether or not the loss corrects by them (``importance_sampling="none"`` does not).

The optimizer takes one step per applied batch and the learning-rate schedule (``schedule.py``) one
step after it; both states are part of ``get_state``, so a restored learner continues the schedule.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrl.learners import distributed as ddp
from flashrl.learners.batch import TrainBatch
from flashrl.learners.schedule import make_lr_scheduler
from flashrl.learners.spec import OPTIMIZERS, LearnerSpec

__all__ = ["STATE_FORMAT", "Learner"]

logger = logging.getLogger(__name__)

STATE_FORMAT = 1
"""Version of the ``get_state`` dictionary layout."""

_SKIP_REASONS = ("non_finite_rewards", "non_finite_behavior_logprobs", "non_finite_logprobs", "non_finite_loss",
                 "non_finite_gradients")


class Learner:
    """One replica of the policy and its optimizer.

    Used directly (``LearnerGroup(..., local=True)``, tests, notebooks) and inside the Ray actors of a
    ``LearnerGroup``. With ``world_size > 1`` the default ``torch.distributed`` process group must be
    initialised before construction (``LearnerGroup`` does it; ``torchrun`` works too).
    """

    def __init__(self, spec: LearnerSpec, *, rank: int = 0, world_size: int = 1) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"Expected 0 <= rank < world_size; got rank={rank}, world_size={world_size}.")
        if world_size > 1 and not ddp.is_distributed():
            raise RuntimeError(
                f"Learner rank {rank} of {world_size}: torch.distributed is not initialised. Use "
                "LearnerGroup(num_learners=...), or call flashrl.learners.distributed.init_process_group first."
            )
        if world_size > 1 and (torch.distributed.get_rank() != rank or torch.distributed.get_world_size() != world_size):
            raise RuntimeError(
                f"Learner built as rank {rank} of {world_size}, but the process group says rank "
                f"{torch.distributed.get_rank()} of {torch.distributed.get_world_size()}."
            )
        from transformers import AutoModelForCausalLM

        from flashrl.algorithms.flash_reinforce.components import BASELINES

        if not Path(spec.model, "config.json").is_file():
            raise FileNotFoundError(
                f"LearnerSpec.model must be a local Hugging Face model folder with a config.json; got "
                f"{spec.model!r}. Use flashrl.models.resolve_model(...) to obtain one."
            )
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.device = spec.resolve_device()
        _seed_everything(spec.seed)

        self.model = AutoModelForCausalLM.from_pretrained(spec.model, dtype=spec.torch_dtype).to(self.device)
        self.model.config.use_cache = False
        # Eval mode: no dropout, so recomputed log-probs describe the policy the engines sample from.
        self.model.eval()
        if spec.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            # Transformers checkpoints a decoder layer only while that layer is in training mode; flag the
            # layers themselves (not their children) so checkpointing runs while dropout stays off.
            from transformers.modeling_layers import GradientCheckpointingLayer

            for module in self.model.modules():
                if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing:
                    module.training = True
        ddp.broadcast_parameters(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # Low-precision training keeps float32 master weights (and so float32 optimizer state): a bf16
        # weight cannot register a step smaller than about 0.4% of itself, which RL learning rates are.
        if spec.torch_dtype == torch.float32:
            self.master_params = self.params
        else:
            self.master_params = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.optimizer = OPTIMIZERS[spec.optimizer](self.master_params, spec)
        self.lr_scheduler = make_lr_scheduler(self.optimizer, spec)
        self._baseline = BASELINES.build(spec.baseline)
        self.version = 0
        """Number of applied updates (a skipped batch does not count)."""
        self.skip_counts: Counter[str] = Counter()
        """Skipped batches by reason."""

    # ------------------------------------------------------------------------------------------
    @property
    def num_skipped_batches(self) -> int:
        return sum(self.skip_counts.values())

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One FlashREINFORCE update on ``batch`` (the whole global batch, on every rank)."""
        start = time.perf_counter()
        if not isinstance(batch, TrainBatch):
            raise TypeError(f"Learner.update expects a TrainBatch; got {type(batch).__name__}.")
        # Every rank holds the same batch, so every rank takes this decision identically.
        reason = batch.non_finite_reason()
        if reason is not None:
            return self._skip(reason, batch, start)

        advantages = self._advantages(batch)  # [B] over the GLOBAL batch
        shard = batch.shard(self.rank, self.world_size).to(self.device)
        t0 = time.perf_counter()
        logprobs, entropy, out, local_reason = self._shard_loss(batch, shard, advantages)
        logprob_time = time.perf_counter() - t0
        reason = self._agree_on_skip(local_reason)
        if reason is not None:
            return self._skip(reason, batch, start)

        lr = float(self.optimizer.param_groups[0]["lr"])  # this update's (scheduled) learning rate
        grad_norm = self._step(out.loss)
        if grad_norm is None:
            return self._skip("non_finite_gradients", batch, start)
        self.version += 1

        metrics = self._metrics(batch, advantages, shard, logprobs, entropy, out)
        metrics.update(
            grad_norm=grad_norm,
            applied=1.0,
            num_skipped_batches=float(self.num_skipped_batches),
            version=float(self.version),
            lr=lr,
            logprob_time_s=logprob_time,
            update_time_s=time.perf_counter() - start,
        )
        return metrics

    def _shard_loss(self, batch: TrainBatch, shard: TrainBatch, advantages: torch.Tensor):
        """Current log-probs, entropies and this shard's share of the global loss.

        Returns ``(logprobs [b_r, T_r], entropy [b_r, T_r], loss output or None, skip reason or None)``.
        """
        from flashrl.algorithms.flash_reinforce.loss import flash_reinforce_loss
        from flashrl.models import compute_token_logprobs

        logprobs, entropy = compute_token_logprobs(
            self.model,
            shard.token_ids,
            shard.attention_mask,
            temperature=self.spec.temperature,
            chunk_size=self.spec.logprob_chunk_size,
            with_entropy=True,
        )  # [b_r, T_r], [b_r, T_r]
        valid = shard.loss_mask  # [b_r, T_r]
        if not (bool(torch.isfinite(logprobs.detach()[valid]).all())
                and bool(torch.isfinite(entropy.detach()[valid]).all())):
            return logprobs, entropy, None, "non_finite_logprobs"
        lo, hi = batch.shard_bounds(self.rank, self.world_size)
        spec = self.spec
        filter_on = spec.negative_token_fraction < 1.0
        out = flash_reinforce_loss(
            logprobs,
            shard.behavior_logprobs,
            shard.rewards,
            valid,
            delta=spec.delta,
            entropy=entropy,
            # [b_r] from the env's success labels; raises (on every rank alike) when the batch has none
            failures=shard.failures if filter_on else None,
            negative_token_fraction=spec.negative_token_fraction,
            importance_sampling=spec.importance_sampling,
            trust_region=spec.trust_region,
            aggregation=spec.aggregation,
            advantages=advantages[lo:hi].to(self.device),  # [b_r] the global batch's advantages
            num_trajectories=batch.batch_size,  # the global B of the 1/B normaliser
            num_tokens=batch.num_loss_tokens,  # the global valid-token count of token_mean
            constant_length_normalizer=spec.constant_length_normalizer,
        )
        if not bool(torch.isfinite(out.loss.detach())):
            return logprobs, entropy, out, "non_finite_loss"
        return logprobs, entropy, out, None

    def _step(self, loss: torch.Tensor) -> float | None:
        """Backward, all-reduce, clip and one optimizer step; None (and no step) if a gradient is non-finite.

        Returns the global gradient norm before clipping.
        """
        self._zero_grad()
        loss.backward()
        self._gather_master_grads()
        ddp.all_reduce_gradients(self.master_params)
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.master_params])
        if not bool(torch.isfinite(grad_norm)):  # identical on every rank: the grads were summed
            self._zero_grad()
            return None
        if self.spec.grad_clip is not None:
            torch.nn.utils.clip_grads_with_norm_(self.master_params, self.spec.grad_clip, grad_norm)
        self.optimizer.step()
        self.lr_scheduler.step()  # after the optimizer, as Molt (molt/trainer/fsdp/strategy.py)
        self._copy_master_to_model()
        self._zero_grad()
        return float(grad_norm)

    def _zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for p in self.master_params:
            p.grad = None

    def _gather_master_grads(self) -> None:
        """Move the model's gradients to the (float32) master parameters; a missing one becomes 0.

        Every parameter then takes part in the step, and every rank all-reduces the same tensors.
        """
        for p, master in zip(self.params, self.master_params):
            if p.grad is None:
                master.grad = torch.zeros_like(master)
            elif master is not p:
                master.grad = p.grad.to(master.dtype)
                p.grad = None

    def _copy_master_to_model(self) -> None:
        if self.master_params is self.params:
            return
        with torch.no_grad():
            for p, master in zip(self.params, self.master_params):
                p.copy_(master)

    def _advantages(self, batch: TrainBatch) -> torch.Tensor:
        """The advantages [B] of the spec's baseline (``A_i = R_i - mean_j R_j`` by default), on the whole batch."""
        rewards = batch.rewards.to(torch.float32)  # [B]
        return self._baseline(rewards, group_ids=batch.group_ids).detach()  # [B]

    def _agree_on_skip(self, local_reason: str | None) -> str | None:
        """The first skip reason any rank found (all ranks must skip together or step together)."""
        code = torch.tensor(
            [0 if local_reason is None else _SKIP_REASONS.index(local_reason) + 1], dtype=torch.int64,
            device=self._collective_device,
        )
        code = int(ddp.all_reduce_max(code))
        return None if code == 0 else _SKIP_REASONS[code - 1]

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

    def _metrics(self, batch, advantages, shard, logprobs, entropy, out) -> dict[str, Any]:
        """Metrics of the global batch: per-shard sums and maxes reduced over ranks."""
        with torch.no_grad():
            valid = shard.loss_mask  # [b_r, T_r]
            logq = logprobs.detach().float()[valid]  # [N_r]
            logp = shard.behavior_logprobs[valid].clamp(max=0.0)  # [N_r]
            ratio = torch.exp(logq.clamp(max=0.0) - logp)  # [N_r]
            has = ratio.numel() > 0
            kept = out.metrics["tokens_kept"]
            sums = torch.tensor(
                [
                    float(out.loss.detach()),
                    float(out.trust_mask.sum()),
                    float(out.drift.sum()),
                    float(ratio.sum()),
                    float(valid.sum()),
                    float(kept),
                    float(entropy.detach().float()[valid].sum()),
                    float(shard.attention_mask.sum()),
                ],
                dtype=torch.float64,
                device=self._collective_device,
            )
            maxes = torch.tensor(
                [
                    float(out.drift.max()),
                    float(ratio.max()) if has else -np.inf,
                    -float(ratio.min()) if has else -np.inf,
                ],
                dtype=torch.float64,
                device=self._collective_device,
            )
            loss, accepted, drift_sum, ratio_sum, n_valid, n_kept, entropy_sum, n_total = (
                ddp.all_reduce_sum(sums).tolist()
            )
            drift_max, ratio_max, neg_ratio_min = ddp.all_reduce_max(maxes).tolist()
            b = batch.batch_size
            # Per-trajectory drift of the global batch (for the TensorBoard histogram): each rank fills
            # its own rows, the sum over ranks assembles the vector.
            start, stop = batch.shard_bounds(self.rank, self.world_size)
            drift_all = torch.zeros(b, dtype=torch.float64, device=self._collective_device)
            drift_all[start:stop] = out.drift.detach().to(torch.float64)
            drift_values = ddp.all_reduce_sum(drift_all).tolist()
            return {
                "loss": loss,
                "accepted_fraction": accepted / b,
                "num_rejected": b - accepted,
                "drift_mean": drift_sum / b,
                "drift_max": drift_max,
                "ratio_mean": ratio_sum / n_valid if n_valid else 1.0,
                "ratio_max": ratio_max if n_valid else 1.0,
                "ratio_min": -neg_ratio_min if n_valid else 1.0,
                "advantage_mean": float(advantages.mean()),
                "advantage_std": float(advantages.std(unbiased=False)),
                "reward_mean": float(batch.rewards.mean()),
                "entropy_mean": entropy_sum / n_valid if n_valid else 0.0,
                "tokens_valid": n_valid,
                "tokens_kept": n_kept,
                "tokens_total": n_total,
                "episodes": float(b),
                "drift_values": drift_values,
            }

    # ------------------------------------------------------------------------------------------
    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's ``state_dict`` as CPU tensor copies, under Hugging Face names.

        Tied parameters (e.g. ``lm_head.weight`` and ``model.embed_tokens.weight``) appear under every
        name, as in ``state_dict``, but share one CPU copy.
        """
        copies: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, tensor in self.model.state_dict().items():
                key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
                if key not in copies:
                    copies[key] = tensor.detach().to("cpu", copy=True)
                out[name] = copies[key]
        return out

    def get_state(self) -> dict[str, Any]:
        """Everything needed to continue training exactly: model, optimizer, RNG, version, counters.

        A plain dict of tensors and Python scalars (CPU copies), loadable with
        ``torch.load(..., weights_only=True)``.
        """
        state = {
            "format": STATE_FORMAT,
            "model": self.get_weights(),
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "rng": _rng_state(),
            "version": self.version,
            "skip_counts": dict(self.skip_counts),
            "spec": self.spec.to_dict(),
        }
        if self.master_params is not self.params:
            state["master_params"] = [p.detach().to("cpu", copy=True) for p in self.master_params]
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore what ``get_state`` returned (possibly from another learner of the same model)."""
        missing = {"format", "model", "optimizer", "rng", "version"} - set(state)
        if missing:
            raise ValueError(f"Learner state is missing {sorted(missing)}; pass what Learner.get_state() returned.")
        if state["format"] != STATE_FORMAT:
            raise ValueError(f"Learner state format {state['format']!r} is not supported; expected {STATE_FORMAT}.")
        self.model.load_state_dict(state["model"], strict=True)
        if self.master_params is not self.params:
            masters = state.get("master_params") or [p.detach().float() for p in self.params]
            if len(masters) != len(self.master_params):
                raise ValueError(
                    f"Learner state has {len(masters)} master parameters; this model has {len(self.master_params)}."
                )
            with torch.no_grad():
                for master, value in zip(self.master_params, masters):
                    master.copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        if "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        else:  # a state saved before schedules existed: the schedule is at its `version`-th update
            self.lr_scheduler = make_lr_scheduler(self.optimizer, self.spec)
            with warnings.catch_warnings():  # fast-forwarding without optimizer steps is the point here
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)`")
                for _ in range(int(state["version"])):
                    self.lr_scheduler.step()
        _set_rng_state(state["rng"])
        self.version = int(state["version"])
        self.skip_counts = Counter(state.get("skip_counts", {}))

    def save_policy(self, path: str | os.PathLike[str]) -> str:
        """Write the policy as a Hugging Face folder (config, safetensors, tokenizer); returns the path.

        transformers (``AutoModelForCausalLM.from_pretrained``) and vLLM load it directly. The folder is
        written beside the target and renamed into place, so a reader never sees a half-written policy.
        An existing policy folder at ``path`` is replaced.
        """
        from transformers import AutoTokenizer

        target = Path(path).resolve()
        if target.exists() and any(target.iterdir()) and not (target / "config.json").is_file():
            raise FileExistsError(
                f"{target} exists and is not a saved policy folder (no config.json); refusing to replace it. "
                "Pass a new or empty folder."
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; a policy folder is meant to be read by other processes
        try:
            self.model.save_pretrained(tmp, safe_serialization=True)
            AutoTokenizer.from_pretrained(self.spec.model).save_pretrained(tmp)
            if target.exists():
                old = target.with_name(f".{target.name}.old-{os.getpid()}")
                target.rename(old)
                tmp.rename(target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return str(target)


# --------------------------------------------------------------------------------------------------
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


def _to_cpu(value: Any) -> Any:
    """A deep copy of a nested structure with every tensor copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
