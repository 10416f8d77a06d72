"""FlashREINFORCE: the loss, its components, the config builder and the algorithm.

The config and the algorithm are imported lazily (they pull in Ray); the loss does not need them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashrl.algorithms.flash_reinforce.algorithm import FlashReinforce
    from flashrl.algorithms.flash_reinforce.config import FlashReinforceConfig

__all__ = ["FlashReinforce", "FlashReinforceConfig"]


def __getattr__(name: str) -> Any:
    if name == "FlashReinforceConfig":
        from flashrl.algorithms.flash_reinforce.config import FlashReinforceConfig

        return FlashReinforceConfig
    if name == "FlashReinforce":
        from flashrl.algorithms.flash_reinforce.algorithm import FlashReinforce

        return FlashReinforce
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
