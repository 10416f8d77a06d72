"""Tiny random-weight models for tests (Llama, Qwen3-MoE): real architecture, real tokenizer, seconds to build."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["build_tiny_llama", "build_tiny_qwen3_moe"]

_TINY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,  # a head size every vLLM attention backend supports, CPU included
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "initializer_range": 0.2,  # logits with std ~2: peaked distributions, unlike the near-uniform 0.02
}

_TINY_MOE_DEFAULTS: dict[str, Any] = {
    **{k: v for k, v in _TINY_DEFAULTS.items() if k != "intermediate_size"},
    "intermediate_size": 256,  # the width of a dense layer (none unless mlp_only_layers names one)
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,  # as Qwen3-30B-A3B
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.0,
}


def build_tiny_llama(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    tokenizer_source: str | os.PathLike[str] = "smollm2-135m-instruct",
    **config_overrides: Any,
) -> str:
    """Save a random-weight ``LlamaForCausalLM`` with the tokenizer of ``tokenizer_source``.

    Args:
        out_dir: folder to write (created; an existing model there is overwritten).
        seed: seed of the weight initialisation; the same seed gives the same weights.
        tokenizer_source: model spec (see ``resolve_model``) whose tokenizer and chat template are
            copied; the vocabulary size follows it.
        **config_overrides: ``LlamaConfig`` fields replacing the tiny defaults (2 layers, hidden 128).

    Returns:
        The folder, as a string.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    return _build(LlamaConfig, LlamaForCausalLM, _TINY_DEFAULTS, out_dir, seed, tokenizer_source, config_overrides)


def build_tiny_qwen3_moe(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    tokenizer_source: str | os.PathLike[str] = "smollm2-135m-instruct",
    **config_overrides: Any,
) -> str:
    """Save a random-weight ``Qwen3MoeForCausalLM`` (2 layers, 8 experts, top-2) with ``tokenizer_source``'s tokenizer.

    The architecture of Qwen3-30B-A3B (softmax router, renormalised top-k weights), at a size that
    builds and runs in seconds on a CPU. Arguments as ``build_tiny_llama``; ``config_overrides`` are
    ``Qwen3MoeConfig`` fields (``num_experts``, ``num_experts_per_tok``, ``mlp_only_layers``, ...).
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return _build(
        Qwen3MoeConfig, Qwen3MoeForCausalLM, _TINY_MOE_DEFAULTS, out_dir, seed, tokenizer_source, config_overrides
    )


def _build(
    config_cls: Any,
    model_cls: Any,
    defaults: dict[str, Any],
    out_dir: str | os.PathLike[str],
    seed: int,
    tokenizer_source: str | os.PathLike[str],
    config_overrides: dict[str, Any],
) -> str:
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from flashrl.models.resolve import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(tokenizer_source))
    fields = {**defaults, **config_overrides}
    fields.setdefault("vocab_size", len(tokenizer))
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, attr)
        if value is not None:
            fields.setdefault(attr, value)
    config = config_cls(**fields)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)
