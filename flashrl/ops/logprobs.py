"""Memory-efficient token log-probabilities and entropies.

The learner needs, for every position of a batch, the log-probability of one given token and the
entropy of the full next-token distribution. Computing ``log_softmax`` over the whole vocabulary at
once materialises an ``[N, V]`` float32 tensor (and autograd keeps it for the backward pass): at
V = 151,936 and N = 8k tokens that is 4.9 GB. Here the rows are processed in chunks, only ``[N]``
statistics are saved, and the backward pass recomputes each chunk's logits. Peak extra memory is
``O(chunk_size * V)`` instead of ``O(N * V)``. On CUDA each chunk's statistics and gradient run
through ``torch.compile`` (:data:`COMPILE_ON_CUDA`), which fuses their float32 passes: on an H200 the
op then takes 0.62x the naive op's time (docs/engines.md, "Checking a GPU machine").

Gradients, with ``z`` the (temperature-scaled) logits of a row, ``p = softmax(z)``, ``y`` the target:

* ``d log p_y / d z = onehot(y) - p``
* ``d H / d z = -p * (log p + H)``  where ``H = -sum p log p``
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["TokenLogprobs", "chunked_token_logprobs", "token_logprobs_from_logits"]


@dataclass(frozen=True)
class TokenLogprobs:
    """Per-token statistics of the next-token distribution."""

    logprobs: torch.Tensor
    """``[N]``: log-probability of each target token (float32; float64 for float64 inputs)."""
    entropy: torch.Tensor | None
    """``[N]``: entropy of each row's distribution (None when not requested)."""


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (gradient checks); everything else is computed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _row_stats(z: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    """Log-prob of the targets, log-sum-exp and entropy of logits ``z`` [c, V] (overwrites ``z``)."""
    lse = torch.logsumexp(z, dim=-1)  # [c]
    logp_target = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # [c]
    if not with_entropy:
        return logp_target, lse, None
    logp = z.sub_(lse.unsqueeze(-1))  # [c, V] in place; H = -sum p log p avoids lse - sum p z cancellation
    entropy = -torch.linalg.vecdot(torch.exp(logp), logp)  # [c]
    return logp_target, lse, entropy


def _logits_grad(
    z: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> torch.Tensor:
    """Gradient w.r.t. logits ``z`` [c, V] of sum(g_lp * logp_y + g_H * H).

    Overwrites ``z`` (a temporary recomputed chunk) and keeps at most two [c, V] buffers alive.
    """
    logp = z.sub_(lse.unsqueeze(-1))  # [c, V], in place
    grad_z = torch.exp(logp)  # [c, V]  p
    entropy_term = None
    if grad_entropy is not None and entropy is not None:
        # dH/dz = -p (log p + H)
        entropy_term = logp.add_(entropy.unsqueeze(-1)).mul_(grad_z).mul_(-grad_entropy.unsqueeze(-1))
    if grad_logp is not None:
        # d logp_y/dz = onehot(y) - p
        grad_z.mul_(-grad_logp.unsqueeze(-1))
        grad_z.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
    else:
        grad_z.zero_()
    if entropy_term is not None:
        grad_z.add_(entropy_term)
    return grad_z


def _fused_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """:func:`_row_stats` of a chunk's raw logits as one pure function (no in-place ops).

    On a GPU it runs compiled (:func:`_call_fused`), which fuses the float32 passes over the ``[c, V]``
    chunk into a few kernels that read the logits in their own dtype; eager, it allocates more than
    the in-place :func:`_row_stats` and is not used.
    """
    z = logits.to(_compute_dtype(logits)) / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp_target = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp_target, lse, None
    logp = z - lse.unsqueeze(-1)
    return logp_target, lse, -(torch.exp(logp) * logp).sum(-1)


def _fused_grad(
    logits: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    entropy: torch.Tensor | None,
    temperature: float,
    out_dtype: torch.dtype,
    with_sum: bool,
):
    """:func:`_logits_grad` of a chunk's raw logits, divided by T, as one pure function.

    Returns the gradient w.r.t. the raw logits in ``out_dtype`` (the backward products' dtype) and,
    with ``with_sum``, its column sum in the statistics' dtype (the bias gradient).
    """
    z = logits.to(lse.dtype) / temperature
    logp = z - lse.unsqueeze(-1)
    p = torch.exp(logp)
    grad = torch.zeros_like(p)
    if grad_entropy is not None and entropy is not None:
        grad = -p * (logp + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
    if grad_logp is not None:
        grad = (grad - p * grad_logp.unsqueeze(-1)).scatter_add(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
    grad = grad / temperature
    return grad.to(out_dtype), (grad.sum(0) if with_sum else None)


COMPILE_ON_CUDA = os.environ.get("FLASHRL_COMPILE_LOGPROBS", "1") != "0"
"""Whether CUDA inputs run the chunk's statistics and gradient through ``torch.compile``
(``FLASHRL_COMPILE_LOGPROBS=0`` turns it off). CPU inputs always run the eager in-place code."""

_compiled: dict[Callable, Callable] = {}
_compile_error: list[str] = []


def _compile(fn: Callable) -> Callable:
    return torch.compile(fn)


def _use_fused(x: torch.Tensor) -> bool:
    return x.is_cuda and COMPILE_ON_CUDA and not _compile_error


def _call_fused(fn: Callable, *args):
    """``fn`` compiled (once per function); if compiling fails, warns once and runs the eager code."""
    if _compile_error:
        return fn(*args)
    try:
        if fn not in _compiled:
            _compiled[fn] = _compile(fn)
        return _compiled[fn](*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:  # noqa: BLE001 (inductor, triton or a compiler missing or failing)
        _compile_error.append(repr(error))
        warnings.warn(f"torch.compile of the chunked log-prob kernel failed ({error!r}); it runs eagerly from "
                      "now on (set FLASHRL_COMPILE_LOGPROBS=0 to skip the attempt)", RuntimeWarning, stacklevel=2)
        return fn(*args)


def _product_dtype(hidden: torch.Tensor, stats_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the backward's two products (``grad_z @ W`` and ``grad_z^T h``).

    On CUDA, the hidden states' dtype, as autograd of ``F.linear`` does: bfloat16 inputs use bfloat16
    products (tensor cores, float32 accumulation inside each product; the weight gradient is summed
    over chunks in float32). Float32 products there made the op 4x slower than the naive path on an
    H200 (benchmarks/results/gpu_check_h200_before.json; docs/engines.md, "Checking a GPU machine").
    On CPU, the statistics' dtype (float32 for bfloat16 inputs): a CPU without native bfloat16 runs
    bfloat16 products 17.7x slower than float32 (benchmarks/results/cpu_bfloat16.json).
    """
    return hidden.dtype if hidden.is_cuda else stats_dtype


def _check_targets(targets: torch.Tensor, n: int, vocab: int) -> None:
    if targets.dim() != 1 or targets.shape[0] != n:
        raise ValueError(f"targets must have shape [{n}] (one per row); got {tuple(targets.shape)}.")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be an integer tensor; got {targets.dtype}.")
    if n and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(
            f"targets must lie in [0, {vocab}); got values in [{int(targets.min())}, {int(targets.max())}]."
        )


class _ChunkedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, with_entropy):
        n, dt = hidden.shape[0], _compute_dtype(hidden)
        logps = torch.empty(n, dtype=dt, device=hidden.device)
        lses = torch.empty(n, dtype=dt, device=hidden.device)
        ents = torch.empty(n, dtype=dt, device=hidden.device) if with_entropy else None
        fused = _use_fused(hidden)
        for start in range(0, n, chunk_size):
            sl = slice(start, start + chunk_size)
            if fused:
                logp, lse, ent = _call_fused(_fused_stats, F.linear(hidden[sl], weight, bias), targets[sl],
                                             temperature, with_entropy)
            else:
                z = F.linear(hidden[sl], weight, bias).to(dt) / temperature  # [c, V]
                logp, lse, ent = _row_stats(z, targets[sl], with_entropy)
            logps[sl], lses[sl] = logp, lse
            if ents is not None:
                ents[sl] = ent
        ctx.save_for_backward(hidden, weight, bias, targets, lses, ents)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        if ents is None:
            return logps, torch.zeros(0, device=hidden.device)
        return logps, ents

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, bias, targets, lses, ents = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.zeros_like(hidden) if need_h else None
        dt = lses.dtype
        grad_w = torch.zeros(weight.shape, dtype=dt, device=weight.device) if need_w else None
        grad_b = (
            torch.zeros(bias.shape, dtype=dt, device=bias.device)
            if (need_b and bias is not None)
            else None
        )
        if ents is None or ents.numel() == 0:
            grad_ent = None
        mm_dt = _product_dtype(hidden, dt)
        w_mm = weight if weight.dtype == mm_dt else weight.to(mm_dt)  # cast once, not per chunk
        fused = _use_fused(hidden)
        for start in range(0, hidden.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            h = hidden[sl]
            chunk_grads = (
                lses[sl],
                targets[sl],
                None if grad_logp is None else grad_logp[sl].to(dt),
                None if grad_ent is None else grad_ent[sl].to(dt),
                None if grad_ent is None else ents[sl],
            )
            if fused:
                g, g_sum = _call_fused(_fused_grad, F.linear(h, weight, bias), *chunk_grads, temperature, mm_dt,
                                       grad_b is not None)
                if grad_b is not None:
                    grad_b += g_sum
            else:
                z = F.linear(h, weight, bias).to(dt) / temperature  # [c, V]
                grad_z = _logits_grad(z, *chunk_grads)
                grad_z.div_(temperature)  # [c, V]: chain rule through z = logits / T
                if grad_b is not None:
                    grad_b += grad_z.sum(0)
                g = grad_z if mm_dt == dt else grad_z.to(mm_dt)
            if grad_h is not None:
                grad_h[sl] = (g @ w_mm).to(hidden.dtype)  # [c, H]
            if grad_w is not None:
                h_mm = h if h.dtype == mm_dt else h.to(mm_dt)
                if mm_dt == dt:
                    grad_w.addmm_(g.t(), h_mm)  # [V, H], accumulated without a temporary
                else:
                    grad_w += g.t() @ h_mm  # a [V, H] product in mm_dt, summed in float32
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


class _ChunkedLogitsLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk_size, with_entropy):
        n, dt = logits.shape[0], _compute_dtype(logits)
        logps = torch.empty(n, dtype=dt, device=logits.device)
        lses = torch.empty(n, dtype=dt, device=logits.device)
        ents = torch.empty(n, dtype=dt, device=logits.device) if with_entropy else None
        for start in range(0, n, chunk_size):
            sl = slice(start, start + chunk_size)
            z = logits[sl].to(dt) / temperature  # [c, V]
            logp, lse, ent = _row_stats(z, targets[sl], with_entropy)
            logps[sl], lses[sl] = logp, lse
            if ents is not None:
                ents[sl] = ent
        ctx.save_for_backward(logits, targets, lses, ents)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        if ents is None:
            return logps, torch.zeros(0, device=logits.device)
        return logps, ents

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        logits, targets, lses, ents = ctx.saved_tensors
        if ents is None or ents.numel() == 0:
            grad_ent = None
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_size):
            sl = slice(start, start + ctx.chunk_size)
            z = logits[sl].to(lses.dtype) / ctx.temperature  # [c, V]
            grad_z = _logits_grad(
                z,
                lses[sl],
                targets[sl],
                None if grad_logp is None else grad_logp[sl].to(lses.dtype),
                None if grad_ent is None else grad_ent[sl].to(lses.dtype),
                None if grad_ent is None else ents[sl],
            )
            grad_logits[sl] = (grad_z / ctx.temperature).to(logits.dtype)
        return grad_logits, None, None, None, None


def _check_common(temperature: float, chunk_size: int) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}.")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}.")


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 256,
    with_entropy: bool = True,
) -> TokenLogprobs:
    """Log-probs of ``targets`` and row entropies under ``softmax((hidden @ weight.T + bias) / T)``.

    Args:
        hidden: ``[N, H]`` final hidden states (any float dtype).
        weight: ``[V, H]`` output projection (the LM head).
        targets: ``[N]`` token ids whose log-probability is wanted.
        bias: optional ``[V]`` output bias.
        temperature: the sampling temperature; log-probs are those of the scaled distribution.
        chunk_size: rows processed at once; bounds the extra memory to ``chunk_size * V`` floats.
        with_entropy: also return the per-row entropy (differentiable too).

    Returns:
        log-probs ``[N]`` and entropies ``[N]`` in float32 (float64 for float64 inputs), differentiable
        w.r.t. hidden, weight and bias.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H] with the same H; got {tuple(hidden.shape)} "
            f"and {tuple(weight.shape)}."
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must have shape [{weight.shape[0]}]; got {tuple(bias.shape)}.")
    _check_targets(targets, hidden.shape[0], weight.shape[0])
    _check_common(temperature, chunk_size)
    logps, ents = _ChunkedLinearLogprobs.apply(
        hidden, weight, bias, targets.long(), float(temperature), int(chunk_size), bool(with_entropy)
    )
    return TokenLogprobs(logprobs=logps, entropy=ents if with_entropy else None)


def token_logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 256,
    with_entropy: bool = True,
) -> TokenLogprobs:
    """Same as :func:`chunked_token_logprobs` for logits that already exist (``[N, V]``).

    The logits themselves are not copied to float32 as a whole: each chunk is upcast, used and freed,
    and the backward pass recomputes the chunk's softmax from the saved logits.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V]; got shape {tuple(logits.shape)}.")
    _check_targets(targets, logits.shape[0], logits.shape[1])
    _check_common(temperature, chunk_size)
    logps, ents = _ChunkedLogitsLogprobs.apply(
        logits, targets.long(), float(temperature), int(chunk_size), bool(with_entropy)
    )
    return TokenLogprobs(logprobs=logps, entropy=ents if with_entropy else None)
