"""The sampling transform (temperature, top-k, top-p) and its exact log-probs, as pure functions.

Follows vLLM's sampler so both engines record the same quantity: temperature first, then top-k
(ties with the k-th logit kept), then top-p (remove the least likely tokens while the removed mass
stays <= 1 - top_p, always keeping the most likely one). Greedy rows (temperature 0) use temperature
1 for their log-probs.
"""

from __future__ import annotations

import torch

__all__ = ["processed_logprobs", "sample_tokens"]

_GREEDY_EPS = 1e-5


def processed_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Log-probs of the distribution actually sampled from, ``-inf`` outside the kept support.

    Args:
        logits: ``[B, V]`` raw logits.
        temperature: ``[B]``; values below 1e-5 mean greedy (scaled as 1).
        top_k: ``[B]`` long; 0 or -1 (or >= V) keeps every token.
        top_p: ``[B]`` in (0, 1].

    Returns:
        ``[B, V]`` float32 log-probs.
    """
    z = logits.float()  # [B, V]
    vocab = z.shape[-1]
    temp = torch.where(temperature < _GREEDY_EPS, torch.ones_like(temperature), temperature).float()  # [B]
    z = z / temp.unsqueeze(-1)  # [B, V]
    k = torch.where((top_k <= 0) | (top_k >= vocab), torch.full_like(top_k, vocab), top_k)  # [B]
    if bool((k < vocab).any()):
        kth = z.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1).unsqueeze(-1))  # [B, 1]
        z = z.masked_fill(z < kth, float("-inf"))  # [B, V]
    if bool((top_p < 1.0).any()):
        z_sorted, order = z.sort(dim=-1)  # [B, V] ascending
        cum = z_sorted.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
        drop_sorted = cum <= (1.0 - top_p.float()).unsqueeze(-1)  # [B, V]
        drop_sorted[:, -1] = False  # the most likely token always stays
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # [B, V] back in vocabulary order
        z = z.masked_fill(drop, float("-inf"))
    return z.log_softmax(dim=-1)  # [B, V]


def sample_tokens(
    logprobs: torch.Tensor,
    greedy: torch.Tensor,
    generators: list[torch.Generator],
) -> torch.Tensor:
    """Draw one token per row from ``exp(logprobs)``; greedy rows take the argmax.

    Args:
        logprobs: ``[B, V]`` output of ``processed_logprobs``.
        greedy: ``[B]`` bool.
        generators: one ``torch.Generator`` per row (per-request seeds stay reproducible whatever the
            batch composition).

    Returns:
        ``[B]`` long token ids.
    """
    # Exponential race (Gumbel-max): argmax p_i / E_i with E_i ~ Exp(1) is a draw from p. Unlike
    # torch.multinomial it needs no CDF, and each row uses its own generator.
    noise = torch.empty_like(logprobs)  # [B, V]
    for i, gen in enumerate(generators):
        noise[i].exponential_(generator=gen)
    sampled = (logprobs.exp() / noise).argmax(dim=-1)  # [B]
    return torch.where(greedy, logprobs.argmax(dim=-1), sampled)  # [B]
