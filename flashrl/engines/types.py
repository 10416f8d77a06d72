"""The engine contract: sampling settings, completions, errors and the ``Engine`` base class."""

from __future__ import annotations

import abc
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from flashrl.weight_sync.buckets import Weights

__all__ = ["Completion", "Engine", "FinishReason", "RequestError", "SamplingConfig"]

logger = logging.getLogger("flashrl.engines")

FinishReason = Literal["stop", "length", "abort"]


class RequestError(ValueError):
    """One request was invalid (bad sampling values, prompt too long); the engine keeps serving."""


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample one completion. Log-probs are always those of the distribution sampled from."""

    temperature: float = 1.0
    """Divides the logits; 0 means greedy (the recorded log-probs are then those at temperature 1)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; below 1 truncates the support (see ``validate``)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1) keeps all."""
    max_tokens: int = 256
    """Most tokens to generate (fewer if the context ends first)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end the completion (kept in it); the model's EOS always ends it."""
    stop: tuple[str, ...] = ()
    """Stop strings, as vLLM's ``SamplingParams.stop``: the completion ends with the token whose text
    completes the first one (that token kept, nothing after it sampled); finish reason ``stop``."""
    seed: int | None = None
    """Per-request seed for reproducible sampling; None draws from the engine's generator."""
    routed_experts_start: int = 0
    """With an engine that records MoE routing: the first position whose routing the completion returns
    (the earlier ones came with an earlier turn of the conversation; vLLM's ``routed_experts_prompt_start``)."""

    def validate(self) -> None:
        """Raise ``RequestError`` on invalid values; warn when the support is truncated."""
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise RequestError(f"temperature must be a finite number >= 0; got {self.temperature!r}.")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0 (0 = greedy); got {self.temperature}.")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must lie in (0, 1]; got {self.top_p}. Use 1.0 for no truncation.")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise RequestError(f"top_k must be an int >= 0 (0 or -1 = all tokens); got {self.top_k!r}.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an int >= 1; got {self.max_tokens!r}.")
        if not isinstance(self.routed_experts_start, int) or self.routed_experts_start < 0:
            raise RequestError(f"routed_experts_start must be an int >= 0; got {self.routed_experts_start!r}.")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be non-negative ints; got {self.stop_token_ids!r}.")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError(f"stop must hold non-empty strings; got {self.stop!r}.")
        if self.truncates_support:
            _warn_truncation(self.top_p, self.top_k)

    @property
    def truncates_support(self) -> bool:
        """True when top-p or top-k removes tokens from the sampling distribution."""
        return self.top_p < 1.0 or self.top_k > 0


_warned: set[tuple[float, int]] = set()


def _warn_truncation(top_p: float, top_k: int) -> None:
    key = (top_p, top_k)
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(
        "sampling with top_p=%s, top_k=%s truncates the behavior policy's support. The recorded "
        "log-probs are those of the truncated distribution, and FlashREINFORCE's importance correction "
        "assumes the learner's policy puts no mass outside it; it does not hold exactly. Use top_p=1.0 "
        "and top_k=0 for on-support training.",
        top_p,
        top_k,
    )


@dataclass(frozen=True)
class Completion:
    """What the engine sampled for one prompt."""

    token_ids: list[int]
    """Generated token ids (a final stop/EOS token included)."""
    logprobs: list[float]
    """Log-prob of each generated token under the distribution it was sampled from (one per token)."""
    finish_reason: FinishReason
    """``stop`` (EOS or a stop token), ``length`` (max_tokens or the context end) or ``abort``."""
    version: int
    """Policy version that sampled the first token (in-flight updates may serve later tokens)."""
    metrics: dict[str, Any] = field(default_factory=dict, compare=False)
    """Optional engine-specific details (e.g. per-token version spans)."""
    routed_experts: np.ndarray | None = field(default=None, compare=False)
    """Engines that record MoE routing (``record_routed_experts``): int16 ``[n, num_hidden_layers, top_k]``,
    the experts of positions ``sampling.routed_experts_start`` to ``len(prompt) + len(token_ids) - 2`` of
    prompt + completion (every token the model was fed; the last sampled one never is), -1 in dense
    layers (``flashrl.models.routing_replay``). None otherwise."""


class Engine(abc.ABC):
    """An inference engine many coroutines can drive at once; concurrent requests are batched."""

    @abc.abstractmethod
    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Completion:
        """Sample one completion of ``prompt_token_ids``."""

    @abc.abstractmethod
    async def update_weights(self, weights: Weights, version: int) -> None:
        """Load new weights (HF ``state_dict()`` names, all of them) in place; stamp them ``version``.

        ``weights`` is a full ``{name: tensor}`` mapping or a ``WeightBuckets`` stream: the plan of
        every tensor up front, then bounded buckets (dicts, or awaitables of dicts such as Ray object
        refs) that the engine resolves and loads one at a time, so it never holds more than one
        bucket beyond the model. The plan is checked (``check_full_state_dict``) before anything loads.
        """

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Policy version of the weights now served."""

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer of the served model."""

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """Context length: prompt plus completion tokens."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine (processes, memory). Idempotent."""

    def __enter__(self) -> Engine:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_prompt(self, prompt_token_ids: list[int], *, routed_experts_start: int = 0) -> None:
        """Raise ``RequestError`` unless the prompt is non-empty and leaves room for one new token.

        ``routed_experts_start`` (``SamplingConfig``) must lie within the prompt.
        """
        if routed_experts_start > len(prompt_token_ids):
            raise RequestError(
                f"routed_experts_start={routed_experts_start} lies beyond the prompt's {len(prompt_token_ids)} "
                "tokens; it is the first prompt position whose routing is returned."
            )
        if not prompt_token_ids:
            raise RequestError("prompt_token_ids is empty; a prompt needs at least one token.")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise RequestError(
                f"prompt has {n} tokens but the context holds {self.max_model_len} (prompt + completion); "
                "shorten the prompt or start the engine with a larger max_model_len."
            )
        vocab = len(self.tokenizer)
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise RequestError(f"prompt token ids must be ints in [0, {vocab}); got {bad[:5]}.")


def check_full_state_dict(
    weights: Mapping[str, torch.Tensor | torch.Size], expected: Mapping[str, torch.Size]
) -> None:
    """Raise ``ValueError`` unless ``weights`` (tensors, or their shapes) has exactly the expected names and shapes.

    Tied parameters that HF lists twice (``lm_head.weight`` next to the embedding) may be absent.
    """
    missing = [n for n in expected if n not in weights]
    unknown = [n for n in weights if n not in expected]
    wrong = [
        f"{n}: expected {tuple(expected[n])}, got {tuple(_shape(t))}"
        for n, t in weights.items()
        if n in expected and tuple(_shape(t)) != tuple(expected[n])
    ]
    if missing or unknown or wrong:
        raise ValueError(
            "update_weights needs the model's full state_dict() (HF names and shapes). "
            f"Missing {missing[:5]}{'...' if len(missing) > 5 else ''}; unknown {unknown[:5]}; "
            f"wrong shapes {wrong[:5]}."
        )


def _shape(value: torch.Tensor | torch.Size) -> torch.Size:
    return value.shape if isinstance(value, torch.Tensor) else torch.Size(value)
