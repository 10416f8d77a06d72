"""Learner-side log-probs of packed sequences: several sequences in one row, no padding.

The input is one row of ``N`` tokens holding ``S`` sequences back to back, with ``position_ids``
restarting at 0 where each sequence starts (``flashrl.learners.packing.pack_rows`` builds it).
Attention must never cross a sequence boundary; how that is obtained depends on the attention
implementation of the Hugging Face model (``config._attn_implementation``):

* ``sdpa``, ``eager``, ``flex_attention``: the model is called with
  ``attention_mask=None`` and the packed ``position_ids``. transformers' ``create_causal_mask``
  (``masking_utils``) then detects the packed format from the positions (a new sequence wherever a
  position is not its predecessor + 1, ``find_packed_sequence_indices``) and ANDs the causal mask with a
  same-sequence mask: the block-diagonal causal mask, materialised for sdpa/eager, a ``BlockMask`` (a
  document mask whose empty blocks the kernel skips) for flex_attention. Passing a 2D padding mask would
  disable that detection, so none is passed (a packed row has no padding).
* ``flash_attention_*``: the boundaries are also passed explicitly (``cu_seq_lens_q/k``,
  ``max_length_q/k``), so the varlen kernel runs without re-deriving them from the positions.

Anything else is refused. Which of these a learner packs with is ``LearnerSpec.pack_attention``
(``flashrl.models.packed_attention``). Because the detection lives in the model's own mask code, an architecture
with custom mask code could ignore packing silently; :func:`verify_packed_attention` runs a few-token
probe that catches it, for a learner to call once when it loads a model.

The head is applied with ``flashrl.ops.logprobs.chunked_token_logprobs``: the ``[N, V]`` log-softmax is
never built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashrl.models.logprobs import _check_plain_head
from flashrl.models.packed_attention import flex_dtype_context
from flashrl.ops.logprobs import chunked_token_logprobs

__all__ = [
    "PACKED_ATTENTION_IMPLEMENTATIONS",
    "compute_packed_token_logprobs",
    "packing_tolerance",
    "verify_packed_attention",
]

PACKED_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")
"""Attention implementations whose mask transformers builds from packed ``position_ids`` (plus flash)."""


def _is_flash(implementation: str | None) -> bool:
    return implementation is not None and "flash" in implementation


def _check_attention(model: torch.nn.Module) -> str:
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation in PACKED_ATTENTION_IMPLEMENTATIONS or _is_flash(implementation):
        return implementation
    raise NotImplementedError(
        f"Packed log-probs need an attention implementation that keeps packed sequences apart: one of "
        f"{', '.join(PACKED_ATTENTION_IMPLEMENTATIONS)} or a flash_attention_* one; the model uses "
        f"{implementation!r}. Load it with attn_implementation='sdpa' (or a flash one), or use padded "
        "batches (flashrl.models.compute_token_logprobs)."
    )


def _check_packed(input_ids: torch.Tensor, position_ids: torch.Tensor, *, check_positions: bool) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or position_ids.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and position_ids must both be [1, N] (sequences packed into one row); got "
            f"{tuple(input_ids.shape)} and {tuple(position_ids.shape)}. Build them with "
            "flashrl.learners.packing.pack_rows."
        )
    if input_ids.shape[1] == 0:
        raise ValueError("A packed row needs at least one token; got N = 0.")
    if not check_positions:
        return
    pos = position_ids[0]  # [N]
    # Sequences start exactly where the position is 0, and transformers splits where a position is not
    # its predecessor + 1: the two agree only if every position is 0 or its predecessor + 1.
    steps_ok = (pos[1:] == 0) | (pos[1:] == pos[:-1] + 1)  # [N-1]
    if int(pos[0]) != 0 or not bool(steps_ok.all()):
        bad = 0 if int(pos[0]) != 0 else int((~steps_ok).nonzero()[0]) + 1
        raise ValueError(
            f"position_ids must restart at 0 for each sequence and grow by 1 inside it; position {bad} is "
            f"{int(pos[bad])} after {int(pos[bad - 1]) if bad else 'the start'}. Build them with "
            "flashrl.learners.packing.pack_rows."
        )


def compute_packed_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    check_positions: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every packed token given its own sequence's prefix, and that distribution's entropy.

    Args:
        model: a Hugging Face causal LM with a plain linear output layer and an attention implementation
            in ``PACKED_ATTENTION_IMPLEMENTATIONS`` or a flash one.
        input_ids: ``[1, N]`` token ids of S sequences back to back.
        position_ids: ``[1, N]``, 0 at the first token of each sequence, then +1 per token.
        temperature: divides the logits, as the inference engine did when it sampled.
        chunk_size: rows of the output projection computed at once.
        with_entropy: also return the entropies.
        check_positions: verify that ``position_ids`` restart at 0 and grow by 1. That reads values
            back from the device (a host sync per call), so a caller whose positions come from
            ``pack_rows`` (the learner) passes False; shapes are checked either way.

    Returns:
        ``(logprobs [1, N], entropy [1, N] or None)``, float32 (float64 for a float64 model). Column ``p``
        is ``log p(token p | the earlier tokens of its sequence)``; both are 0 at every sequence's first
        token. ``flashrl.learners.packing.unpack_rows`` turns them into the ``[S, T]`` layout of
        ``flashrl.models.compute_token_logprobs``, with which they agree. Differentiable w.r.t. the
        model's parameters.
    """
    _check_packed(input_ids, position_ids, check_positions=check_positions)
    _check_plain_head(model)
    implementation = _check_attention(model)
    position_ids = position_ids.to(input_ids.device)
    starts = position_ids[0] == 0  # [N]
    kwargs = {}
    if _is_flash(implementation):
        end = torch.tensor([starts.shape[0]], device=starts.device)  # [1]
        cu = torch.cat([starts.nonzero().flatten(), end]).to(torch.int32)  # [S + 1]
        longest = int(cu.diff().max())
        kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    body = model.get_decoder()
    head = model.get_output_embeddings()
    with flex_dtype_context(implementation, head.weight.dtype, input_ids.device):
        hidden = body(
            input_ids=input_ids, attention_mask=None, position_ids=position_ids, use_cache=False, **kwargs
        ).last_hidden_state  # [1, N, H]
    valid = ~starts[1:]  # [N-1] token p+1 is predicted from position p of the same sequence
    stats = chunked_token_logprobs(
        hidden[0, :-1][valid],  # [M, H]
        head.weight,  # [V, H]
        input_ids[0, 1:][valid],  # [M]
        bias=head.bias,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
    )
    logprobs = _scatter(stats.logprobs, valid)  # [1, N]
    entropy = _scatter(stats.entropy, valid) if stats.entropy is not None else None  # [1, N]
    return logprobs, entropy


def _scatter(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``values`` [M] at the True cells of ``valid`` [N-1], shifted by one token; [1, N]."""
    full = values.new_zeros(valid.shape).masked_scatter(valid, values)  # [N-1]
    return F.pad(full, (1, 0)).unsqueeze(0)  # [1, N]


@torch.no_grad()
def packing_tolerance(dtype: torch.dtype) -> float:
    """How far packed and separate log-probs may differ in :func:`verify_packed_attention` for a model
    computing in ``dtype``: 1e-4 for float32/float64, 0.2 for 16-bit floats.

    Measured on one H200 with a random-weight Qwen2.5-1.5B-shaped model (``scripts/gpu_check.py``'s,
    ``benchmarks/results/gpu_check_h200_packed.json``, its ``probe``): a working mask leaves at most 1e-5 apart in
    float32 and 0.041 in bfloat16 (sdpa picks different kernels for a masked packed row and an unmasked
    single sequence: rounding), while a leak (every token seeing the sequence before it) moves the
    probe's log-probs by 1.1 to 2.5. 0.2 sits 5x above the first and 5x below the second.
    """
    return 0.2 if torch.finfo(dtype).bits <= 16 else 1e-4


def verify_packed_attention(model: torch.nn.Module, *, atol: float | None = None) -> float:
    """Check on a few tokens that packed sequences do not attend to each other; return the max deviation.

    Packs two short sequences and compares their log-probs with each sequence scored alone. Raises
    ``RuntimeError`` if they differ by more than ``atol`` (the model's mask code ignores packed
    position ids), ``NotImplementedError`` for an unsupported attention implementation. ``atol`` None:
    :func:`packing_tolerance` of the output layer's dtype; a caller whose compute dtype differs from its
    parameters' (FSDP2 mixed precision keeps float32 parameters) passes ``packing_tolerance`` of it.
    """
    _check_attention(model)
    if atol is None:
        atol = packing_tolerance(model.get_output_embeddings().weight.dtype)
    device = next(model.parameters()).device
    vocab = int(model.get_output_embeddings().weight.shape[0])
    first = torch.arange(5, device=device) * 7 % vocab  # [5]
    second = (torch.arange(4, device=device) * 11 + 3) % vocab  # [4]
    ids = torch.cat([first, second]).unsqueeze(0)  # [1, 9]
    pos = torch.cat([torch.arange(5, device=device), torch.arange(4, device=device)]).unsqueeze(0)  # [1, 9]
    with torch.no_grad():
        packed, _ = compute_packed_token_logprobs(model, ids, pos, with_entropy=False)  # [1, 9]
        alone = [
            compute_packed_token_logprobs(
                model, s.unsqueeze(0), torch.arange(s.shape[0], device=device).unsqueeze(0), with_entropy=False
            )[0]
            for s in (first, second)
        ]  # [1, 5], [1, 4]
    deviation = float((packed - torch.cat(alone, dim=1)).abs().max())
    if not deviation <= atol:
        raise RuntimeError(
            f"{type(model).__name__} ({model.config._attn_implementation}) lets packed sequences attend to "
            f"each other: packed and separate log-probs differ by {deviation:.3g} (expected <= {atol}). Its "
            "mask code ignores packed position_ids; train it with padded batches (micro-batching without "
            "packing) or another attention implementation."
        )
    return deviation
