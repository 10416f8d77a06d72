"""A vLLM engine's LoRA adapters: each policy version is a new ``LoRARequest`` read from a PEFT folder.

A LoRA run (``flashrl.weight_sync.lora``) starts vLLM with ``enable_lora`` and the adapter's rank, and
every weight update is the adapter's tensors. vLLM 0.32 loads adapters from files only, so each
version is written as a PEFT folder (``adapter_config.json`` and ``adapter_model.safetensors``,
what ``--lora-modules`` loads) and served as ``LoRARequest(f"v{version}", id, path)``: every request
sampled after the update uses it, and its completions record that version.

A new name *and* path per version matters: vLLM's prefix cache keys on ``(lora_name, lora_path)``,
so reusing them would let a cached prompt of the old adapter serve the new one. An adapter that
vLLM evicted loads again from its folder when a request names it, so the folders of the versions
still in flight stay on disk; older ones are removed (``KEEP_FOLDERS``).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from flashrl.models.lora import LoRASettings, is_adapter_name, write_adapter_folder

__all__ = ["KEEP_FOLDERS", "AdapterSlot", "lora_engine_args"]

KEEP_FOLDERS = 4
"""Adapter folders kept on disk (the newest versions'): requests of an older version still in flight
may need vLLM to load theirs again after an eviction."""


def lora_engine_args(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The ``vllm.AsyncEngineArgs`` fields of an engine serving ``settings``' adapters.

    ``max_loras=2``: the newest version and the one requests still in flight use.
    """
    lora = LoRASettings.from_dict(settings)
    return {"enable_lora": True, "max_lora_rank": int(lora.rank), "max_loras": 2}


class AdapterSlot:
    """The adapter versions one vLLM engine serves: where they are written and the current request."""

    def __init__(self, settings: Mapping[str, Any], base_model: str) -> None:
        self.settings = LoRASettings.from_dict(settings)
        self.base_model = base_model
        self.root = Path(tempfile.mkdtemp(prefix="flashrl-lora-"))
        self.request: Any = None
        """The ``LoRARequest`` of the newest version; None at version 0 (the base: peft's B starts at 0)."""
        self._folders: list[Path] = []

    def write(self, tensors: Mapping[str, torch.Tensor], version: int) -> Any:
        """Write version ``version``'s adapter as a PEFT folder; returns its ``LoRARequest`` (not loaded yet)."""
        from vllm.lora.request import LoRARequest

        foreign = sorted(n for n in tensors if not is_adapter_name(n))
        if foreign:
            raise ValueError(
                f"a LoRA engine's update: expected adapter tensors only (lora_A / lora_B), got {foreign[:3]}. Fix: "
                "send the learner's adapter (weight_sync='lora'), or start the engine without the option lora."
            )
        folder = self.root / f"v{int(version)}"
        folder.mkdir()
        write_adapter_folder(folder, tensors, self.settings, self.base_model)
        self._folders.append(folder)
        # ids start at 1 (vLLM reserves 0); a version's id is unique for the engine's life
        return LoRARequest(f"v{int(version)}", int(version) + 1, str(folder))

    def served(self, request: Any) -> None:
        """``request`` is now the newest version's; folders beyond the newest ``KEEP_FOLDERS`` are removed."""
        self.request = request
        while len(self._folders) > KEEP_FOLDERS:
            shutil.rmtree(self._folders.pop(0), ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
