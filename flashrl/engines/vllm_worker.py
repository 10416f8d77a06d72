"""vLLM worker extension: loads new weights in place, bucket by bucket, from shared-memory files.

vLLM mixes this class into its workers (engine argument ``worker_extension_cls``); the engine
calls its methods with ``collective_rpc``. Tensors sent through ``collective_rpc`` would be
serialised element by element, so the engine writes each bucket into one flat file (in
``/dev/shm``: RAM) and sends only its layout; the worker maps the file and hands zero-copy views to
the model's own ``load_weights``.

One update is one **layerwise reload session**, the lifecycle vLLM's own weight-transfer engines
use (``NCCLWeightTransferEngine``: ``initialize_layerwise_reload`` in ``start_weight_update``,
``model.load_weights`` per received chunk, ``finalize_layerwise_reload`` in
``finish_weight_update``): ``flashrl_start_weight_update`` swaps every layer's kernel tensors for
loading wrappers, each ``flashrl_load_bucket`` feeds one bucket through the checkpoint loader (name
mapping, fused q/k/v and gate/up projections), and a layer is processed (on CPU: its linear weights
repacked) and copied back into its original storage as soon as all of its tensors have arrived;
``flashrl_finish_weight_update`` processes what is left and restores the layers that got nothing.
Calling vLLM's ``reload_weights`` once per bucket instead would be wrong: each call finalizes, and a
layer whose parts straddle two buckets would be processed half-loaded. Plain ``model.load_weights``
outside a session fails on CPU (the repacked linear weights have parameters of size 0).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any

import torch

from flashrl.weight_sync.wire import WeightEntry

__all__ = ["FlashRLWorkerExtension", "install_reload_log_filter"]

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""The logger of vLLM's layerwise reload (``finalize_layerwise_reload``)."""


class _NoWeightsOfTheirOwn(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" for layers no update carries weights for.

    At the end of every reload session vLLM warns for each layer that received nothing and puts its
    old tensors back. Two kinds always receive nothing, by design: rotary embeddings (a cos/sin
    cache computed from the config, in no checkpoint) and a tied output head (the stream leaves
    ``lm_head.weight`` out; ``_retie_output_embedding`` points it at the new embedding right after).
    An untied head missing from an update cannot get this far: the engine checks every update's
    manifest against the checkpoint's tensors first. Every other layer's warning still shows.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        layer = str(record.args[0] if isinstance(record.args, tuple) else record.args)
        return not (layer.endswith("RotaryEmbedding") or layer == "ParallelLMHead")


def install_reload_log_filter() -> None:
    """Install the filter on vLLM's reload logger (idempotent); runs when a worker imports this module."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, _NoWeightsOfTheirOwn) for f in logger.filters):
        logger.addFilter(_NoWeightsOfTheirOwn())


install_reload_log_filter()

class FlashRLWorkerExtension:
    """Methods added to each vLLM worker (``self`` is the worker)."""

    def flashrl_start_weight_update(self) -> None:
        """Open a layerwise reload session (the model serves nothing until it is finished)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with self._flashrl_config():
            initialize_layerwise_reload(self.model_runner.get_model())  # type: ignore[attr-defined]
        self._flashrl_loaded = 0

    def flashrl_load_bucket(self, path: str, total_bytes: int, entries: list[WeightEntry]) -> int:
        """Load the tensors of one bucket file into the open session; return how many."""
        # MAP_PRIVATE: the engine side owns the file and unlinks it after this call returns
        buffer = torch.from_file(path, shared=False, size=total_bytes, dtype=torch.uint8)  # [total_bytes]

        def tensors():
            for name, dtype, shape, offset, nbytes in entries:
                flat = buffer[offset : offset + nbytes].view(getattr(torch, dtype))
                yield name, flat.view(shape)

        with self._flashrl_config(), _no_mtp_check():
            self.model_runner.get_model().load_weights(tensors())  # type: ignore[attr-defined]
        self._flashrl_loaded = getattr(self, "_flashrl_loaded", 0) + len(entries)
        return len(entries)

    def flashrl_finish_weight_update(self) -> int:
        """Close the session: process the remaining layers, re-tie the head; return tensors loaded."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        runner = self.model_runner  # type: ignore[attr-defined]
        with self._flashrl_config():
            finalize_layerwise_reload(runner.get_model(), runner.model_config)
            _prepack_cpu_moe_experts(runner.get_model())
        _retie_output_embedding(runner.get_model(), runner.model_config.hf_config)
        # what GPUModelRunner.reload_weights resets after a reload: state derived from the old weights
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()
        loaded, self._flashrl_loaded = getattr(self, "_flashrl_loaded", 0), 0
        return loaded

    def flashrl_retie_output_embedding(self) -> None:
        """After vLLM's own weight-transfer session (the push routes): re-tie a tied output head."""
        runner = self.model_runner  # type: ignore[attr-defined]
        _retie_output_embedding(runner.get_model(), runner.model_config.hf_config)

    def flashrl_kv_cache_bytes(self) -> int:
        """Bytes of the KV-cache tensors this worker allocated (tests check them against the budget)."""
        caches = self.model_runner.kv_caches  # type: ignore[attr-defined]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(caches)}
        return sum(storages.values())

    def _flashrl_config(self) -> Any:
        """vLLM's current-config context, as its worker sets it around weight-transfer calls."""
        from vllm.config import set_current_vllm_config

        config = getattr(self, "vllm_config", None)
        return set_current_vllm_config(config) if config is not None else nullcontext()


def _prepack_cpu_moe_experts(model: torch.nn.Module) -> int:
    """Redo the CPU MoE experts' prepacking that vLLM 0.32 skips on a weight update; return the layers.

    ``UnquantizedFusedMoEMethod._setup_kernel`` runs ``moe_kernel.fused_experts.process_weights_after_loading``
    only on the first load (``is_weight_update = self.moe_kernel is not None``): on CPU that call pads the
    intermediate dimension and prepacks ``w13_weight``/``w2_weight`` into the grouped-gemm layout
    (``cpu_prepack_moe_weight``, same shape, another element order). On a layerwise reload the new
    checkpoint-layout experts are copied into the old storage unpacked, and the kernel reads them as
    packed: the engine then samples from scrambled experts (docs/engines.md, "Known defect (MoE)", now
    worked around here). Re-running the experts' own step after the session packs them as a fresh start
    does. GPU experts keep their layout (the first load's shuffle is copied back), so this touches CPU
    experts only.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU experts: nothing of theirs to repack
        return 0
    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def _no_mtp_check() -> Any:
    """vLLM's guard against multi-token-prediction completeness checks on a partial load."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:  # older vLLM: no such check
        return nullcontext()
    return disable_mtp_completeness_check()


def _tensors(obj: object):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _retie_output_embedding(model: torch.nn.Module, hf_config: object) -> None:
    """Point a tied ``lm_head`` at the reloaded input embedding again and re-run its processing.

    Checkpoint loaders skip ``lm_head.weight`` when embeddings are tied, so the layer-wise reload
    sees no weights for the head and puts its old kernel tensors back; on CPU those include a
    pre-packed copy of the old matrix.
    """
    if not getattr(hf_config, "tie_word_embeddings", False):
        return
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None) if inner is not None else None
    if head is None or embed is None or not hasattr(head, "tie_weights"):
        return
    head.tie_weights(embed)
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
