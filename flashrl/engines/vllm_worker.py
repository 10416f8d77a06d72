"""vLLM worker extension: loads a whole new set of weights in place from one shared-memory file.

vLLM mixes this class into its workers (engine argument ``worker_extension_cls``); the engine calls
``collective_rpc("flashrl_reload_weights", ...)``. Tensors sent through ``collective_rpc`` would be
serialised element by element, so the trainer side writes every tensor into one flat file (in
``/dev/shm``: RAM) and sends only its layout. The worker maps the file and hands zero-copy views to
``reload_weights``, which runs vLLM's own checkpoint loader (name mapping, fused projections, and on
CPU the repacking of linear weights) in one pass.
"""

from __future__ import annotations

import torch

__all__ = ["FlashRLWorkerExtension", "WeightEntry"]

WeightEntry = tuple[str, str, list[int], int, int]
"""``(name, dtype name, shape, byte offset, byte count)`` of one tensor in the flat file."""


class FlashRLWorkerExtension:
    """Methods added to each vLLM worker (``self`` is the worker)."""

    def flashrl_reload_weights(self, path: str, total_bytes: int, entries: list[WeightEntry]) -> int:
        """Load every tensor described by ``entries`` from ``path``; return how many were loaded."""
        buffer = torch.from_file(path, shared=False, size=total_bytes, dtype=torch.uint8)  # [total_bytes]

        def tensors():
            for name, dtype, shape, offset, nbytes in entries:
                flat = buffer[offset : offset + nbytes].view(getattr(torch, dtype))
                yield name, flat.view(shape)

        runner = self.model_runner  # type: ignore[attr-defined]
        runner.reload_weights(weights_iterator=tensors())
        _retie_output_embedding(runner.get_model(), runner.model_config.hf_config)
        return len(entries)

    def flashrl_kv_cache_bytes(self) -> int:
        """Bytes of the KV-cache tensors this worker allocated (tests check them against the budget)."""
        caches = self.model_runner.kv_caches  # type: ignore[attr-defined]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(caches)}
        return sum(storages.values())


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
