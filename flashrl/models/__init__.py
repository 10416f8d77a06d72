"""Models: obtaining them (offline built-ins, local folders, hub ids) and learner-side log-probs."""

from flashrl.models.logprobs import compute_token_logprobs
from flashrl.models.packed_attention import PACK_ATTENTION, packed_attention_implementation
from flashrl.models.packed_logprobs import (
    compute_packed_token_logprobs,
    packing_tolerance,
    verify_packed_attention,
)
from flashrl.models.resolve import (
    BUILTIN_MODELS,
    BUILTIN_TOKENIZERS,
    cache_dir,
    dequantize_gguf,
    resolve_model,
    resolve_tokenizer,
)
from flashrl.models.tiny import build_tiny_llama, build_tiny_qwen3_moe

__all__ = [
    "BUILTIN_MODELS",
    "BUILTIN_TOKENIZERS",
    "PACK_ATTENTION",
    "build_tiny_llama",
    "build_tiny_qwen3_moe",
    "cache_dir",
    "compute_packed_token_logprobs",
    "compute_token_logprobs",
    "dequantize_gguf",
    "packed_attention_implementation",
    "packing_tolerance",
    "resolve_model",
    "resolve_tokenizer",
    "verify_packed_attention",
]
