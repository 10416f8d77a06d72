"""The shapes of the models the presets train, and the parameter / KV-cache counts derived from them.

The dry-run must plan memory without downloading a model, so the architectures of the preset models
are written down here, copied from each model's ``config.json`` on the Hugging Face hub. A local model
folder (or a built-in model already in the cache) is read from its own ``config.json`` instead.

=====================================  ======  ====  =====  =====  ==  ==  ===  ======  ====  =======
model                                  arch    L     H      I      nh  kv  hd   vocab   tied  params
=====================================  ======  ====  =====  =====  ==  ==  ===  ======  ====  =======
HuggingFaceTB/SmolLM2-135M-Instruct    llama   30    576    1536   9   3   64   49152   yes   134.5M
Qwen/Qwen2.5-Math-1.5B                 qwen2   28    1536   8960   12  2   128  151936  yes   1.54B
deepseek-ai/DeepSeek-R1-Distill-Qwen-  qwen2   28    1536   8960   12  2   128  151936  no    1.78B
1.5B
Qwen/Qwen2.5-7B-Instruct               qwen2   28    3584   18944  28  4   128  152064  no    7.62B
Qwen/Qwen3-30B-A3B (MoE, 128 experts,  qwen3   48    2048   768*   32  4   128  151936  no    30.5B
8 active; * = per-expert width)        _moe                                                   (3.3B
                                                                                              active)
=====================================  ======  ====  =====  =====  ==  ==  ===  ======  ====  =======

L layers, H hidden size, I MLP width, nh attention heads, kv key/value heads, hd head dim. The
parameter counts are computed by :meth:`Architecture.num_parameters` and match the counts the hub
pages show (tests pin them).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ARCHITECTURES", "DTYPE_BYTES", "Architecture", "architecture_for", "read_architecture"]

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the dtypes a run uses."""


@dataclass(frozen=True)
class Architecture:
    """A decoder-only transformer's shape: enough to count parameters and KV-cache bytes."""

    name: str
    """Hub id (or folder) the shape was read from."""
    model_type: str
    """Hugging Face ``model_type``: 'llama', 'qwen2', 'qwen3_moe'."""
    num_layers: int
    """Decoder layers (L)."""
    hidden_size: int
    """Residual stream width (H)."""
    intermediate_size: int
    """Gated-MLP width (I); for a mixture of experts, the width of one expert."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (grouped-query attention)."""
    head_dim: int
    """Width of one attention head."""
    vocab_size: int
    """Rows of the embedding and the output projection."""
    tie_word_embeddings: bool
    """Whether the output projection shares the embedding matrix."""
    max_position_embeddings: int
    """Longest context the model was trained for."""
    attention_bias: bool = False
    """Biases on the q, k, v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm on queries and keys per head (Qwen3)."""
    num_experts: int = 0
    """Routed experts per layer; 0 for a dense MLP."""
    num_experts_per_token: int = 0
    """Experts each token is routed to."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def _attention_parameters(self) -> int:
        h, q, kv = (
            self.hidden_size,
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        )
        params = h * q + 2 * h * kv + q * h  # q, k, v, o projections
        if self.attention_bias:
            params += q + 2 * kv
        if self.qk_norm:
            params += 2 * self.head_dim
        return params

    def _mlp_parameters(self, experts: int) -> int:
        one = 3 * self.hidden_size * self.intermediate_size  # gate, up, down
        if not self.is_moe:
            return one
        return experts * one + self.hidden_size * self.num_experts  # experts + router

    def _embedding_parameters(self) -> int:
        embed = self.vocab_size * self.hidden_size
        return embed if self.tie_word_embeddings else 2 * embed

    def num_parameters(self) -> int:
        """All parameters: embeddings, L x (attention + MLP + 2 norms), final norm, untied head."""
        per_layer = (
            self._attention_parameters() + self._mlp_parameters(self.num_experts) + 2 * self.hidden_size
        )
        return self._embedding_parameters() + self.num_layers * per_layer + self.hidden_size

    def num_active_parameters(self) -> int:
        """Parameters one token passes through (= num_parameters for a dense model)."""
        if not self.is_moe:
            return self.num_parameters()
        per_layer = (
            self._attention_parameters()
            + self._mlp_parameters(self.num_experts_per_token)
            + 2 * self.hidden_size
        )
        return self._embedding_parameters() + self.num_layers * per_layer + self.hidden_size

    def kv_cache_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token: 2 x L x kv_heads x head_dim x bytes."""
        return 2 * self.num_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_config(cls, name: str, config: dict[str, Any]) -> Architecture:
        """Read the fields above from a Hugging Face ``config.json`` dict."""
        model_type = str(config.get("model_type", "unknown"))
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        experts = int(config.get("num_experts", config.get("num_local_experts", 0)) or 0)
        width = (
            int(config.get("moe_intermediate_size") or config["intermediate_size"])
            if experts
            else int(config["intermediate_size"])
        )
        return cls(
            name=name,
            model_type=model_type,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=width,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(config.get("max_position_embeddings", 0)),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type.startswith("qwen3"),
            num_experts=experts,
            num_experts_per_token=int(config.get("num_experts_per_tok", 0) or 0),
        )


# Copied from each model's config.json on the Hugging Face hub.
ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        Architecture(
            "HuggingFaceTB/SmolLM2-135M-Instruct", "llama", 30, 576, 1536, 9, 3, 64, 49152, True, 8192
        ),
        Architecture(
            "Qwen/Qwen2.5-Math-1.5B",
            "qwen2",
            28,
            1536,
            8960,
            12,
            2,
            128,
            151936,
            True,
            4096,
            attention_bias=True,
        ),
        Architecture(
            "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
            "qwen2",
            28,
            1536,
            8960,
            12,
            2,
            128,
            151936,
            False,
            131072,
            attention_bias=True,
        ),
        Architecture(
            "Qwen/Qwen2.5-7B-Instruct",
            "qwen2",
            28,
            3584,
            18944,
            28,
            4,
            128,
            152064,
            False,
            32768,
            attention_bias=True,
        ),
        Architecture(
            "Qwen/Qwen3-30B-A3B",
            "qwen3_moe",
            48,
            2048,
            768,
            32,
            4,
            128,
            151936,
            False,
            40960,
            qk_norm=True,
            num_experts=128,
            num_experts_per_token=8,
        ),
    )
}
ALIASES: dict[str, str] = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
"""flashrl's built-in model names -> the hub model they are."""


def read_architecture(folder: str | os.PathLike[str]) -> Architecture | None:
    """The architecture in ``folder/config.json``, or None when there is no readable config."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        return Architecture.from_hf_config(str(folder), config)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def architecture_for(model: str, local_folder: str | None = None) -> Architecture | None:
    """The architecture of ``model``: its local config.json when present, else the table above."""
    if local_folder is not None:
        arch = read_architecture(local_folder)
        if arch is not None:
            return arch
    key = ALIASES.get(model.lower(), model)
    return ARCHITECTURES.get(key)
