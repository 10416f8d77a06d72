"""Memory estimates of a run: what one learner and one env runner hold, from the model's shape.

The formulas are deliberately simple (they are a plan, not a profiler). With P parameters, b the
learner's dtype bytes, L layers, H hidden size, I MLP width, V vocabulary:

Learner (every learner holds a full replica: flashrl's learners are data parallel, not sharded)::

    weights     = P x b
    gradients   = P x b
    master      = P x 4 x 2            only when b < 4: float32 master weights + their gradients
    optimizer   = P x 4 x 2            AdamW's two moments, float32 (SGD: 0)
    activations = N x H x L x b        N = ceil(B / learners) x max_episode_tokens (padded rows);
                  (gradient checkpointing keeps each layer's input; without it a layer keeps about
                   6H + 3I values per token, so H becomes 6H + 3I)
                + N x H x b            the final hidden states fed to the chunked output projection
                + chunk x V x 4 x 3    one chunk of float32 logits, softmax and their gradient

Env runner (one vLLM engine, split over its GPUs by tensor / expert parallelism)::

    weights  = P x e                   e = the engine's dtype bytes (bfloat16 on GPU, float32 on CPU)
    kv_cache = K x max_episode_tokens x 2 x L x kv_heads x head_dim x e
               (K episodes in flight, each at its full context budget: an upper bound)
    reserved = on vLLM's CPU build, the bytes the engine asks for: ``kv_cache_budget`` of
               ``flashrl/engines/memory.py`` (the same call the engine makes: whole blocks, a floor
               and a cap), or the engine options' ``kv_cache_memory_bytes``; on GPU the engine takes
               its ``gpu_memory_utilization`` share and the plan compares the need with it

This mirrors ``flashrl/learners/learner.py`` (float32 master weights and AdamW state under bfloat16)
and ``flashrl/models/logprobs.py`` (one forward pass over a learner's whole shard of the batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashrl.engines.memory import (
    CPU_BLOCK_SIZE,
    GPU_BLOCK_SIZE,
    check_kv_cache_bytes,
    kv_bytes_per_token,
    kv_cache_budget,
)
from flashrl.recipes.architectures import DTYPE_BYTES, Architecture

__all__ = ["EnvRunnerMemory", "LearnerMemory", "env_runner_memory", "format_bytes", "learner_memory"]

GIB = 1024**3


@dataclass(frozen=True)
class LearnerMemory:
    """Bytes one learner holds during an update."""

    weights: int
    gradients: int
    master: int
    optimizer: int
    activations: int
    tokens: int
    """Tokens in one learner's forward pass (padded): ceil(B / learners) x max_episode_tokens."""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.master + self.optimizer + self.activations


@dataclass(frozen=True)
class EnvRunnerMemory:
    """Bytes one env runner's engine holds (over all its GPUs)."""

    weights: int
    kv_cache: int
    """What the episodes in flight hold at their full context budget."""
    kv_bytes_per_token: int
    kv_cache_reserved: int | None = None
    """KV-cache bytes the engine reserves when it reserves a fixed number (vLLM's CPU build)."""

    @property
    def total(self) -> int:
        return self.weights + (self.kv_cache if self.kv_cache_reserved is None else self.kv_cache_reserved)


def learner_memory(
    arch: Architecture,
    *,
    dtype: str,
    optimizer: str,
    train_batch_size: int,
    num_learners: int,
    max_episode_tokens: int,
    gradient_checkpointing: bool,
    logprob_chunk_size: int,
) -> LearnerMemory:
    """The learner formula of the module docstring."""
    p = arch.num_parameters()
    b = DTYPE_BYTES[dtype]
    master = p * 4 * 2 if b < 4 else 0
    optimizer_bytes = p * 4 * 2 if optimizer == "adamw" else 0
    rows = math.ceil(train_batch_size / max(1, num_learners))
    tokens = rows * max_episode_tokens
    per_token_layer = (
        arch.hidden_size if gradient_checkpointing else 6 * arch.hidden_size + 3 * arch.intermediate_size
    )
    activations = (
        tokens * per_token_layer * arch.num_layers * b
        + tokens * arch.hidden_size * b
        + logprob_chunk_size * arch.vocab_size * 4 * 3
    )
    return LearnerMemory(
        weights=p * b,
        gradients=p * b,
        master=master,
        optimizer=optimizer_bytes,
        activations=activations,
        tokens=tokens,
    )


def env_runner_memory(
    arch: Architecture,
    *,
    engine_dtype: str,
    episodes_in_flight: int,
    max_episode_tokens: int,
    cpu_vllm: bool = False,
    kv_cache_memory_bytes: int | None = None,
) -> EnvRunnerMemory:
    """The env-runner formula of the module docstring.

    ``cpu_vllm``: the engine is vLLM's CPU build, which reserves ``kv_cache_budget`` bytes (or
    ``kv_cache_memory_bytes`` when given, on either platform); raises its ``ValueError`` when one
    full-context sequence cannot fit.
    """
    e = DTYPE_BYTES[engine_dtype]
    per_token = kv_bytes_per_token(
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        element_bytes=e,
    )
    reserved = kv_cache_memory_bytes
    if reserved is not None:
        check_kv_cache_bytes(
            int(reserved),
            context_tokens=max_episode_tokens,
            bytes_per_token=per_token,
            block_size=CPU_BLOCK_SIZE if cpu_vllm else GPU_BLOCK_SIZE,
            source="kv_cache_memory_bytes",
        )
    elif cpu_vllm:
        reserved = kv_cache_budget(
            num_seqs=episodes_in_flight,
            context_tokens=max_episode_tokens,
            bytes_per_token=per_token,
            block_size=CPU_BLOCK_SIZE,
        ).reserved_bytes
    return EnvRunnerMemory(
        weights=arch.num_parameters() * e,
        kv_cache=episodes_in_flight * max_episode_tokens * per_token,
        kv_bytes_per_token=per_token,
        kv_cache_reserved=reserved,
    )


def format_bytes(n: float) -> str:
    """'1.50 GiB', '340.0 MiB', '12.0 KiB'."""
    for unit, size in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit in ("TiB", "GiB") else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
