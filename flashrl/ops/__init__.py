"""Numerical kernels shared by the learner and the benchmarks."""

from flashrl.ops.logprobs import TokenLogprobs, chunked_token_logprobs, token_logprobs_from_logits

__all__ = ["TokenLogprobs", "chunked_token_logprobs", "token_logprobs_from_logits"]
