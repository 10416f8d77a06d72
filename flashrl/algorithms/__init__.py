"""Algorithms: configs, losses and baselines (installed as flashrl.algorithms).

`FlashReinforceConfig` and `FlashReinforce` are imported lazily, so that the pure loss
(`flashrl.algorithms.flash_reinforce.loss`) stays importable without Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashrl.algorithms.flash_reinforce import FlashReinforce, FlashReinforceConfig

__all__ = ["FlashReinforce", "FlashReinforceConfig"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from flashrl.algorithms import flash_reinforce

        return getattr(flash_reinforce, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
