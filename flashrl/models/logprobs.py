"""Learner-side log-probabilities of given token sequences under the current weights.

The final hidden states come from the transformer body and the output projection is applied in
chunks (``flashrl.ops.logprobs.chunked_token_logprobs``), so the ``[N, V]`` logits of a batch are
never materialised at once, in the forward or in the backward pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashrl.ops.logprobs import chunked_token_logprobs

__all__ = ["compute_token_logprobs"]


def compute_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every token given its prefix, and the entropy of the distribution it came from.

    Args:
        model: a Hugging Face causal LM (``*ForCausalLM``) whose output layer is a plain linear map
            (models with logit soft-capping or logit scaling are refused).
        input_ids: ``[B, T]`` token ids; padding may be on either side.
        attention_mask: ``[B, T]``, 1 for real tokens, 0 for padding.
        temperature: divides the logits, as the inference engine did when it sampled.
        chunk_size: rows of the output projection computed at once.
        with_entropy: also return the entropies (costs one more pass over each chunk).

    Returns:
        ``(logprobs [B, T], entropy [B, T] or None)``, float32. ``logprobs[:, t]`` is
        ``log p(input_ids[:, t] | input_ids[:, :t])`` and ``entropy[:, t]`` the entropy of that
        distribution; both are 0 at position 0 and wherever the token or its predecessor is padding.
        Differentiable w.r.t. the model's parameters.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [B, T]; got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}."
        )
    _check_plain_head(model)
    mask = attention_mask.to(torch.bool)  # [B, T]
    position_ids = (mask.long().cumsum(-1) - 1).clamp_min(0)  # [B, T] positions count real tokens only
    body = model.get_decoder()
    hidden = body(
        input_ids=input_ids, attention_mask=attention_mask.long(), position_ids=position_ids, use_cache=False
    ).last_hidden_state  # [B, T, H]
    valid = mask[:, 1:] & mask[:, :-1]  # [B, T-1] token t+1 predicted from a real position t
    head = model.get_output_embeddings()
    stats = chunked_token_logprobs(
        hidden[:, :-1][valid],  # [N, H]
        head.weight,  # [V, H]
        input_ids[:, 1:][valid],  # [N]
        bias=head.bias,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
    )
    logprobs = _scatter_rows(stats.logprobs, valid)  # [B, T]
    entropy = _scatter_rows(stats.entropy, valid) if stats.entropy is not None else None  # [B, T]
    return logprobs, entropy


def _scatter_rows(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Place ``values`` [N] at the True cells of ``valid`` [B, T-1]; prepend position 0 as 0."""
    full = values.new_zeros(valid.shape).masked_scatter(valid, values)  # [B, T-1]
    return F.pad(full, (1, 0))  # [B, T]


def _check_plain_head(model: torch.nn.Module) -> None:
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        value = getattr(config, attr, None)
        if value not in (None, 1, 1.0):
            raise NotImplementedError(
                f"{type(model).__name__} transforms its logits ({attr}={value}); compute_token_logprobs "
                "supports plain linear output layers only."
            )
