"""The transports by name: what the engine option ``weight_sync`` may name (besides ``auto``).

A new transport is one new file in this package (a ``flashrl.weight_sync.transport.Transport``
subclass with its sender, receiver and route) plus one line in ``TRANSPORTS``. Entries are
``"module:Class"`` strings (Gymnasium's ``entry_point``), loaded on first use, so that reading an
engine option (``flashrl.weight_sync.resolve``) imports neither torch nor a transport.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flashrl.weight_sync.transport import Transport

__all__ = ["TRANSPORTS", "Registration", "transport", "transports"]


@dataclass(frozen=True)
class Registration:
    """Where a transport's class lives, and what must be known of it without importing it."""

    entry_point: str
    """``"module:Class"``."""
    vllm_backend: bool = False
    """Its data plane is one of vLLM's weight-transfer engines (``weight_transfer_config.backend``):
    the learner pushes, and only GPUs on both sides carry it (``flashrl.weight_sync.layout``)."""


TRANSPORTS: dict[str, Registration] = {
    "shm": Registration("flashrl.weight_sync.shm:ShmTransport"),
    "nccl": Registration("flashrl.weight_sync.nccl:NcclTransport", vllm_backend=True),
    "ipc": Registration("flashrl.weight_sync.ipc:IpcTransport", vllm_backend=True),
    "lora": Registration("flashrl.weight_sync.lora:LoraTransport"),
}
"""One line per transport; the order is the order of ``weight_sync``'s documented options."""


@cache
def transport(name: str) -> Transport:
    """The transport registered as ``name`` (its class, loaded now, instantiated once)."""
    if name not in TRANSPORTS:
        raise ValueError(
            f"weight sync: expected a transport in {tuple(TRANSPORTS)}, got {name!r}. Fix: one of those, or "
            "register a new one in flashrl.weight_sync.registry.TRANSPORTS."
        )
    module, _, cls = TRANSPORTS[name].entry_point.partition(":")
    return getattr(importlib.import_module(module), cls)()


def transports() -> list[Transport]:
    """Every registered transport, in ``TRANSPORTS``' order."""
    return [transport(name) for name in TRANSPORTS]
