"""Which attention kernel keeps a learner's packed sequences apart (``LearnerSpec.pack_attention``).

A packed row holds several sequences back to back with ``position_ids`` restarting at 0 for each
(``flashrl.learners.packing.pack_rows``). transformers derives the sequences from those positions
(``masking_utils.find_packed_sequence_indices``); what it does with them depends on the model's
attention implementation, which this module chooses for the packed passes:

* ``"flex"``: FlexAttention (``attn_implementation="flex_attention"``). transformers builds a
  ``BlockMask`` from the packed positions: causal AND same-sequence (a document mask), plus the
  architecture's sliding window. The compiled kernel skips every 128 x 128 block outside the
  sequences, so a row of S sequences costs about the sum of their squared lengths, not the square of
  the row. This is what verl, SkyRL and prime-rl pack with (or flash varlen, below). On CPU, torch's
  FlexAttention has no backward (torch 2.13: ``NotImplementedError``) and its compiled CPU kernel takes
  float32 and 16-bit floats only: there it serves forward passes (the probe, log-probs without
  gradients), float64 through the unfused reference (:func:`flex_dtype_context`), and a learner refuses it.
* ``"sdpa_mask"``: sdpa with the block-diagonal causal mask materialised (``[N, N]`` booleans), every
  device, dtype and backward. sdpa then runs its masked kernel over the whole row: on an H200 this
  was 1.71x slower than padding (``docs/benchmarks.md``, "Packed sequences on a GPU").
* ``"flash_varlen"``: the ``flash_attention_*`` implementation the model was loaded with (the
  flash-attn package, 16-bit floats on CUDA: ``flashrl.learners.policies.attention_implementation``),
  given the sequences' boundaries (``cu_seq_lens``) by ``compute_packed_token_logprobs``.

``None`` (auto): ``flash_varlen`` when the model was loaded with flash attention, ``flex`` on CUDA
(where the architecture has a FlexAttention path), else the masked attention the model was loaded
with (``sdpa_mask``, or eager where the architecture has no sdpa): on CPU the only ones with a
backward. The choice only matters where the learner packs (``pack_sequences``); see
``docs/engines.md``.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["PACK_ATTENTION", "flex_dtype_context", "packed_attention_implementation"]

PACK_ATTENTION = ("flex", "sdpa_mask", "flash_varlen")
"""The values of ``LearnerSpec.pack_attention`` besides None (auto)."""

_IMPLEMENTATION = {"flex": "flex_attention", "sdpa_mask": "sdpa"}
"""transformers' attention implementation of each choice (flash_varlen keeps the loaded flash one)."""

_FLEX_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""What torch 2.13's compiled FlexAttention takes on CPU (inductor's CPU template)."""


def packed_attention_implementation(choice: str | None, device: torch.device, loaded: str | None,
                                    *, supports_flex: bool = True, training: bool = True) -> str:
    """The attention implementation a learner's packed passes run with.

    Args:
        choice: ``LearnerSpec.pack_attention``: one of ``PACK_ATTENTION``, or None for auto.
        device: where the model runs.
        loaded: the implementation the model was loaded with (``config._attn_implementation``).
        supports_flex: the architecture has a FlexAttention path (``_supports_flex_attn``); auto keeps the
            loaded implementation without one.
        training: passes need a backward (a learner): FlexAttention is then refused on CPU.

    Raises:
        ValueError: an unknown choice, ``flash_varlen`` for a model not loaded with flash attention, or
            ``flex`` on CPU for training, each with the fix.
    """
    loaded = loaded or ""
    if choice is None:
        if "flash" in loaded or (device.type == "cuda" and not supports_flex):
            return loaded
        if device.type != "cuda":  # CPU: no FlexAttention backward; sdpa (or eager, as loaded) masks
            return loaded if loaded in ("sdpa", "eager") else "sdpa"
        choice = "flex"
    if choice not in PACK_ATTENTION:
        raise ValueError(f"pack_attention: expected None (auto) or one of {', '.join(PACK_ATTENTION)}; got "
                         f"{choice!r}. Use None.")
    if choice == "flash_varlen":
        if "flash" not in loaded:
            raise ValueError(
                f"pack_attention='flash_varlen' needs a model loaded with a flash_attention_* implementation (the "
                f"flash-attn package, bfloat16 on CUDA); this one uses {loaded!r}. Install flash-attn, or use "
                "pack_attention='flex' (CUDA) or None."
            )
        return loaded
    if choice == "flex" and device.type == "cpu" and training:
        raise ValueError(
            f"pack_attention='flex' on CPU: FlexAttention in torch {torch.__version__} has no backward on CPU, and "
            "a learner trains. Use pack_attention=None (sdpa_mask on CPU) or 'sdpa_mask', or train on a GPU."
        )
    return _IMPLEMENTATION[choice]


def flex_dtype_context(implementation: str | None, dtype: torch.dtype,
                       device: torch.device) -> contextlib.AbstractContextManager:
    """Run FlexAttention unfused where its compiled kernel refuses the dtype (float64 on CPU), else nothing.

    transformers always calls a compiled FlexAttention; inductor's CPU kernel takes float32 and 16-bit
    floats only. ``torch.compiler.set_stance("force_eager")`` runs the reference implementation instead
    (it materialises the scores: exact, for checks in float64, not for speed).
    """
    if implementation == "flex_attention" and device.type == "cpu" and dtype not in _FLEX_CPU_DTYPES:
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()
