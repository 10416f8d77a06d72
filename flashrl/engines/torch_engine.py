"""A PyTorch/transformers inference engine: batched sampling with a KV cache and exact log-probs.

It starts in seconds and computes in float32 by default, which makes it the engine of unit tests and
the reference for engine/learner agreement. Requests that wait while a batch runs form the next
batch (static batching); weight updates wait for the running batch, so every completion comes from
one weight version.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flashrl.engines.base import ModelEngine
from flashrl.engines.sampling import processed_logprobs, sample_tokens
from flashrl.engines.types import Completion, SamplingConfig, check_full_state_dict
from flashrl.models.routing_replay import RoutingRecorder, record_routing
from flashrl.weight_sync.buckets import Weights, aiter_buckets, as_buckets

__all__ = ["TorchEngine", "TorchEngineOptions"]


@dataclass(frozen=True)
class TorchEngineOptions:
    """Options of ``make_engine("torch", ...)``."""

    dtype: str = "float32"
    """Parameter and activation dtype (``float32``, ``bfloat16``, ``float16``)."""
    device: str = "cpu"
    """Torch device (``cpu``, ``cuda``, ``cuda:1``)."""
    max_batch_size: int = 64
    """Most requests sampled together in one batch."""
    max_model_len: int | None = None
    """Context length (prompt + completion); default: the model's ``max_position_embeddings``."""
    num_threads: int | None = None
    """``torch.set_num_threads`` for this process; None leaves it unchanged."""
    record_routed_experts: bool = False
    """MoE models: return the experts every token was routed to (``Completion.routed_experts``), for
    routing replay in the learner; a dense model is refused (``flashrl.models.routing_replay``)."""
    lora: dict[str, Any] | None = None
    """A LoRA run's adapter settings (``flashrl.models.lora.LoRASettings`` as a dict; the run plan sets
    it): the engine injects the same adapter with peft, and every weight update is that adapter's tensors."""


@dataclass
class _Request:
    prompt: list[int]
    sampling: SamplingConfig
    future: asyncio.Future[Completion]


class _Batcher:
    """Per-event-loop queue: collects waiting requests and runs them as one batch in a thread."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.pending: list[_Request] = []
        self.task: asyncio.Task[None] | None = None

    def submit(self, request: _Request) -> None:
        self.pending.append(request)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # let callers started in the same tick join this batch
        while self.pending:
            size = self.engine.options.max_batch_size
            batch, self.pending = self.pending[:size], self.pending[size:]
            batch = [r for r in batch if not r.future.cancelled()]
            if not batch:
                continue
            try:
                results = await asyncio.to_thread(self.engine._run_batch, batch)
            except Exception as err:  # noqa: BLE001 -- a failed batch fails its requests, never the engine
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(err)
                continue
            for r, c in zip(batch, results):
                if not r.future.done():
                    r.future.set_result(c)


class TorchEngine(ModelEngine):
    """Transformers model + KV cache; see the module docstring."""

    def __init__(self, model: str, *, seed: int, options: TorchEngineOptions | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from flashrl.models.resolve import resolve_model

        self.options = options or TorchEngineOptions()
        if self.options.num_threads is not None:
            torch.set_num_threads(self.options.num_threads)
        path = resolve_model(model)
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        dtype = getattr(torch, self.options.dtype)
        self._model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.options.device).eval()
        if self.options.lora is not None:  # the learner's computation exactly: peft's layers on the same base
            from flashrl.models.lora import LoRASettings, apply_lora

            apply_lora(self._model, LoRASettings.from_dict(self.options.lora))
            self._model.eval()
        config = self._model.config
        self._max_model_len = int(self.options.max_model_len or config.max_position_embeddings)
        self._eos_ids = _eos_ids(self._model, self._tokenizer)
        self._pad_id = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else 0
        self._shapes = {n: t.shape for n, t in self._model.state_dict().items()}
        if self.options.lora is not None:  # an update is the adapter: the base stays the engine's own
            from flashrl.models.lora import is_adapter_name

            self._shapes = {n: shape for n, shape in self._shapes.items() if is_adapter_name(n)}
        self._hooks = contextlib.ExitStack()
        self._recorder: RoutingRecorder | None = None
        """The routers' hooks (``record_routed_experts``; a dense model fails here); they stay for the engine's life."""
        if self.options.record_routed_experts:
            self._recorder = self._hooks.enter_context(record_routing(self._model))
        self._seed_gen = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()  # held by a running batch and by a weight update
        self._version = 0
        self._batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Batcher] = (
            weakref.WeakKeyDictionary()
        )
        self._closed = False
        self.largest_batch = 0
        """Most requests sampled together so far (shows that concurrent calls were batched)."""

    # -- Engine API -------------------------------------------------------------------------------

    @property
    def weight_sync(self) -> str:
        """The transport new weights take (``flashrl.weight_sync``): ``lora`` with an adapter, else ``shm``."""
        return "shm" if self.options.lora is None else "lora"

    @property
    def model(self) -> torch.nn.Module:
        """The served transformers model (read-only use: tests, agreement checks)."""
        return self._model

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Completion:
        if self._closed:
            raise RuntimeError("the engine is closed")
        sampling.validate()
        self.check_prompt(prompt_token_ids, routed_experts_start=sampling.routed_experts_start)
        loop = asyncio.get_running_loop()
        batcher = self._batchers.get(loop)
        if batcher is None:
            batcher = self._batchers[loop] = _Batcher(self)
        future: asyncio.Future[Completion] = loop.create_future()
        batcher.submit(_Request(list(prompt_token_ids), sampling, future))
        return await future

    async def update_weights(self, weights: Weights, version: int) -> None:
        """Copy new weights into the model bucket by bucket; no batch runs until the last one is in.

        A full mapping is one bucket (it is already in memory); a ``WeightBuckets`` stream is
        resolved one bucket at a time, so this process holds at most one bucket beyond the model.
        """
        stream = as_buckets(weights, bucket_bytes=2**62)
        names = {m.name: torch.Size(m.shape) for m in stream.metas}
        tied = {n for n in self._shapes if n not in names and _is_tied_copy(self._model, n)}
        check_full_state_dict(names, {n: s for n, s in self._shapes.items() if n not in tied})
        # The batch lock is held across the whole stream (acquired off the event loop: a running
        # batch holds it), so a completion never mixes two versions.
        await asyncio.to_thread(self._lock.acquire)
        try:
            params = self._model.state_dict()
            async for _, bucket in aiter_buckets(stream):
                await asyncio.to_thread(_copy_into, params, bucket)
                del bucket
            self._version = int(version)
        finally:
            self._lock.release()

    def close(self) -> None:
        self._closed = True
        self._batchers.clear()
        self._hooks.close()

    # -- internals --------------------------------------------------------------------------------

    def _run_batch(self, batch: list[_Request]) -> list[Completion]:
        with self._lock, torch.inference_mode():
            self.largest_batch = max(self.largest_batch, len(batch))
            return self._sample(batch, self._version)

    def _sample(self, batch: list[_Request], version: int) -> list[Completion]:
        device = self.options.device
        n = len(batch)
        lengths = [len(r.prompt) for r in batch]
        width = max(lengths)
        budgets = [min(r.sampling.max_tokens, self._max_model_len - len(r.prompt)) for r in batch]
        input_ids = torch.full((n, width), self._pad_id, dtype=torch.long)  # [B, L] left-padded
        attn = torch.zeros((n, width), dtype=torch.long)  # [B, L]
        for i, r in enumerate(batch):
            input_ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
            attn[i, width - len(r.prompt) :] = 1
        input_ids, attn = input_ids.to(device), attn.to(device)
        positions = (attn.cumsum(-1) - 1).clamp_min(0)  # [B, L]
        temperature = torch.tensor(
            [r.sampling.temperature for r in batch], dtype=torch.float32, device=device
        )
        top_k = torch.tensor([r.sampling.top_k for r in batch], dtype=torch.long, device=device)
        top_p = torch.tensor([r.sampling.top_p for r in batch], dtype=torch.float32, device=device)
        greedy = temperature < 1e-5  # [B]
        generators = [self._request_generator(r.sampling) for r in batch]
        stops = [self._eos_ids | set(r.sampling.stop_token_ids) for r in batch]

        from transformers import DynamicCache

        cache = DynamicCache()
        out = self._model(
            input_ids=input_ids, attention_mask=attn, position_ids=positions,
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        )  # fmt: skip
        recorder = self._recorder
        # [B, L, layers, k]: the experts of every prompt position of the prefill (padding included)
        prompt_routing = None if recorder is None else recorder.take().unflatten(0, (n, width))
        step_routing: list[torch.Tensor] = []  # per decode step, [B, layers, k]: the tokens it fed
        logits = out.logits[:, -1]  # [B, V]
        last_pos = positions[:, -1]  # [B]
        tokens_out: list[list[int]] = [[] for _ in batch]
        logprobs_out: list[list[float]] = [[] for _ in batch]
        reasons: list[str | None] = [None] * n
        for _step in range(max(budgets)):
            logp = processed_logprobs(logits, temperature, top_k, top_p)  # [B, V]
            logp_cpu = logp.cpu()  # [B, V] the per-request generators live on the CPU
            tokens = sample_tokens(logp_cpu, greedy.cpu(), generators)  # [B]
            chosen = logp_cpu.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()  # [B]
            for i, tok in enumerate(tokens.tolist()):
                if reasons[i] is not None:
                    continue
                tokens_out[i].append(tok)
                logprobs_out[i].append(chosen[i])
                stop = batch[i].sampling.stop
                if tok in stops[i] or (stop and self._stop_string_hit(tokens_out[i], stop)):
                    reasons[i] = "stop"
                elif len(tokens_out[i]) >= budgets[i]:
                    reasons[i] = "length"
            if all(r is not None for r in reasons):
                break
            attn = torch.cat([attn, torch.ones((n, 1), dtype=attn.dtype, device=device)], dim=1)  # [B, L+t]
            last_pos = last_pos + 1  # [B]
            out = self._model(
                input_ids=tokens.to(device).unsqueeze(-1), attention_mask=attn,
                position_ids=last_pos.unsqueeze(-1), past_key_values=cache, use_cache=True,
            )  # fmt: skip
            if recorder is not None:
                step_routing.append(recorder.take())
            logits = out.logits[:, -1]  # [B, V]
        return [
            Completion(
                tokens_out[i], logprobs_out[i], reasons[i] or "length", version,  # type: ignore[arg-type]
                routed_experts=None if prompt_routing is None else _routing_of(
                    prompt_routing[i, width - lengths[i]:], step_routing, i, len(tokens_out[i]),
                    batch[i].sampling.routed_experts_start,
                ),
            )
            for i in range(n)
        ]

    def _stop_string_hit(self, tokens: list[int], stop: tuple[str, ...]) -> bool:
        """Whether the last token's text completes one of ``stop``, as vLLM's detokenizer checks it
        (``vllm/v1/engine/detokenizer.py`` ``check_stop_strings``: special tokens skipped, a character
        still incomplete held back, only a match that ends in the new characters). Only the last tokens
        are decoded: enough for the longest stop string (a byte-level token holds a quarter of a
        character at least), so a step costs the same however long the completion is."""
        window = tokens[-(4 * max(len(s) for s in stop) + 4):]
        text = self._tokenizer.decode(window, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # the token ends inside a character: no new text yet
            return False
        before = len(self._tokenizer.decode(window[:-1], skip_special_tokens=True).rstrip("\ufffd"))
        return any(text.find(s, max(0, before + 1 - len(s))) != -1 for s in stop)

    def _request_generator(self, sampling: SamplingConfig) -> torch.Generator:
        if sampling.seed is not None:
            seed = sampling.seed
        else:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
        return torch.Generator().manual_seed(seed)


def _routing_of(
    prompt: torch.Tensor, steps: list[torch.Tensor], row: int, num_tokens: int, start: int
) -> np.ndarray:
    """Request ``row``'s routing from position ``start`` on: its prompt's, then each fed generated token's."""
    fed = [steps[j][row] for j in range(num_tokens - 1)]  # the last sampled token is never fed
    rows = torch.cat([prompt, torch.stack(fed)]) if fed else prompt  # [P + n - 1, layers, k]
    return rows[start:].numpy()


def _copy_into(params: Mapping[str, torch.Tensor], bucket: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, tensor in bucket.items():
            params[name].copy_(tensor)


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _is_tied_copy(model: torch.nn.Module, name: str) -> bool:
    """True for ``lm_head.weight`` when it shares storage with the input embedding."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    return (
        out is not None
        and inp is not None
        and name.endswith("lm_head.weight")
        and out.weight.data_ptr() == inp.weight.data_ptr()
    )
