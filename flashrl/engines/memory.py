"""The KV-cache budget of an engine, from what the run needs: one function for the engine and the plan.

vLLM's CPU backend reads ``gpu_memory_utilization`` as a share of one NUMA node's memory and gives
the KV cache what is left of it once the worker has loaded; what is left depends on whatever else
runs on the host at that moment, so a run that started alone failed next to other processes. flashrl
therefore asks for an explicit number of bytes (vLLM's ``kv_cache_memory_bytes``, honoured by the
CPU worker as given) computed from the run itself::

    bytes_per_token = 2 x layers x kv_heads x head_dim x dtype bytes      (K and V of every layer)
    blocks          = num_seqs x ceil(context / block_size) + 1           (vLLM's pool keeps one
                                                                           null block back)
    need            = blocks x block_size x bytes_per_token
    budget          = max(floor, min(cap, need))

``num_seqs`` are the sequences in flight (an env runner's episodes in flight: each has at most one
request at a time) and ``context`` the context budget (``max_model_len`` = the run's
``max_episode_tokens``). Why each term:

- ``need`` is an upper bound: every sequence in flight at its full context at the same moment. With
  it the scheduler never has to preempt, and blocks left over hold the prefix cache.
- ``cap`` (``KV_CAP_BYTES``, 2 GiB): sequences rarely all reach the full context together, and when
  they do vLLM preempts one and recomputes it later: slower, never wrong. Reserving the worst case of
  a large run (64 sequences x 32k tokens is tens of GiB) would take the host's memory for a case
  that almost never occurs. Ask for more explicitly (``kv_cache_memory_bytes``) when it pays.
- ``floor`` (``KV_FLOOR_BYTES``, 64 MiB): a tiny model with short contexts would otherwise get a
  pool of a few blocks and no room for cached prefixes; 64 MiB costs nothing on any host.
- vLLM refuses to start unless one sequence at the full context fits (``min_bytes``: its blocks plus
  the null block). A cap or an explicit budget below that raises ``ValueError`` here, with the
  numbers and the fix, before vLLM starts.

The formula holds for full attention (every layer keeps every token). Sliding-window or hybrid
models need less, so for them it is an upper bound. On GPU the engine keeps vLLM's
``gpu_memory_utilization`` by default and the plan compares ``need`` with that share.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CPU_BLOCK_SIZE",
    "DEFAULT_MAX_NUM_SEQS",
    "GPU_BLOCK_SIZE",
    "KV_CAP_BYTES",
    "KV_FLOOR_BYTES",
    "KVCacheBudget",
    "check_kv_cache_bytes",
    "dtype_bytes",
    "kv_bytes_per_token",
    "kv_bytes_per_token_from_hf",
    "kv_cache_budget",
]

MIB = 1024**2
GIB = 1024**3

KV_FLOOR_BYTES = 64 * MIB
"""Smallest KV cache flashrl asks for (see the module docstring)."""
KV_CAP_BYTES = 2 * GIB
"""Largest KV cache flashrl asks for unless told otherwise (see the module docstring)."""
CPU_BLOCK_SIZE = 128
"""Tokens per KV block on vLLM's CPU backend (its default for standard attention)."""
GPU_BLOCK_SIZE = 16
"""Tokens per KV block on vLLM's CUDA backends (their default)."""
DEFAULT_MAX_NUM_SEQS = 64
"""Sequences a vLLM engine schedules at once (and its CPU KV budget is sized for) unless told."""

_DTYPE_BYTES = {
    "float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,  # vLLM's kv_cache_dtype names
}  # fmt: skip


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of ``dtype`` (``float32``, ``bfloat16``, ...; a ``torch.`` prefix is ok)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown KV-cache dtype {dtype!r}; expected one of {sorted(_DTYPE_BYTES)}.")
    return _DTYPE_BYTES[name]


def kv_bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int, element_bytes: int) -> int:
    """K and V of every layer for one token: ``2 x layers x kv_heads x head_dim x bytes``."""
    return 2 * num_layers * num_kv_heads * head_dim * element_bytes


def kv_bytes_per_token_from_hf(config: Any, dtype: str) -> int:
    """``kv_bytes_per_token`` from a Hugging Face config (a ``PretrainedConfig`` or its dict)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
    heads = int(get("num_attention_heads"))
    return kv_bytes_per_token(
        num_layers=int(get("num_hidden_layers")),
        num_kv_heads=int(get("num_key_value_heads") or heads),
        head_dim=int(get("head_dim") or int(get("hidden_size")) // heads),
        element_bytes=dtype_bytes(dtype),
    )


@dataclass(frozen=True)
class KVCacheBudget:
    """The KV cache an engine reserves for a run, and the numbers it came from."""

    reserved_bytes: int
    """What the engine reserves: ``max(floor, min(cap, need_bytes))``."""
    need_bytes: int
    """Every sequence in flight at the full context, in whole blocks, plus vLLM's null block."""
    min_bytes: int
    """One sequence at the full context plus the null block: vLLM's minimum to start."""
    bytes_per_token: int
    num_seqs: int
    context_tokens: int
    block_size: int

    @property
    def full_context_seqs(self) -> int:
        """How many sequences the budget holds at the full context at once."""
        blocks_per_seq = math.ceil(self.context_tokens / self.block_size)
        usable = self.reserved_bytes // (self.block_size * self.bytes_per_token) - 1
        return max(0, usable // blocks_per_seq)


def _blocks_bytes(num_seqs: int, context_tokens: int, bytes_per_token: int, block_size: int) -> int:
    blocks = num_seqs * math.ceil(context_tokens / block_size) + 1  # + the null block
    return blocks * block_size * bytes_per_token


def kv_cache_budget(
    *,
    num_seqs: int,
    context_tokens: int,
    bytes_per_token: int,
    block_size: int,
    floor_bytes: int = KV_FLOOR_BYTES,
    cap_bytes: int = KV_CAP_BYTES,
) -> KVCacheBudget:
    """The budget of the module docstring; ``ValueError`` when one full-context sequence exceeds the cap."""
    for name, value in (
        ("num_seqs", num_seqs),
        ("context_tokens", context_tokens),
        ("bytes_per_token", bytes_per_token),
        ("block_size", block_size),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1; got {value!r}.")
    need = _blocks_bytes(num_seqs, context_tokens, bytes_per_token, block_size)
    minimum = _blocks_bytes(1, context_tokens, bytes_per_token, block_size)
    if minimum > cap_bytes:
        raise ValueError(
            f"one sequence of {context_tokens} tokens needs {_fmt(minimum)} of KV cache "
            f"({bytes_per_token} bytes/token, blocks of {block_size}), above the cap of "
            f"{_fmt(cap_bytes)}. Fix: lower max_model_len / max_episode_tokens, or set "
            f"kv_cache_memory_bytes >= {minimum} in the engine options."
        )
    return KVCacheBudget(
        reserved_bytes=max(floor_bytes, min(cap_bytes, need)),
        need_bytes=need,
        min_bytes=minimum,
        bytes_per_token=bytes_per_token,
        num_seqs=num_seqs,
        context_tokens=context_tokens,
        block_size=block_size,
    )


def check_kv_cache_bytes(
    budget_bytes: int, *, context_tokens: int, bytes_per_token: int, block_size: int, source: str
) -> None:
    """``ValueError`` unless an explicit budget (named by ``source``) holds one full-context sequence."""
    minimum = _blocks_bytes(1, context_tokens, bytes_per_token, block_size)
    if budget_bytes < minimum:
        raise ValueError(
            f"{source} gives the KV cache {_fmt(budget_bytes)} ({budget_bytes} bytes), but one sequence "
            f"of max_model_len={context_tokens} tokens needs {_fmt(minimum)} ({minimum} bytes: "
            f"{bytes_per_token} bytes/token, blocks of {block_size} tokens, plus one null block). "
            f"Fix: raise it to at least {minimum} bytes, or lower max_model_len to "
            f"{max(0, (budget_bytes // (block_size * bytes_per_token) - 1) * block_size)} or less."
        )


def _fmt(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"
