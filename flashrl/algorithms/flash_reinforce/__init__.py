"""FlashREINFORCE: the loss, its components, the learner's loss hook, the config builder and the algorithm.

The config and the algorithm are imported lazily (they pull in Ray); the loss does not need them.
``learner.FlashReinforceLossSpec`` is what the generic ``flashrl.learners.Learner`` calls per micro-batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashrl.algorithms.flash_reinforce.algorithm import FlashReinforce
    from flashrl.algorithms.flash_reinforce.config import FlashReinforceConfig
    from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec

__all__ = ["FlashReinforce", "FlashReinforceConfig", "FlashReinforceLossSpec"]


def __getattr__(name: str) -> Any:
    if name == "FlashReinforceConfig":
        from flashrl.algorithms.flash_reinforce.config import FlashReinforceConfig

        return FlashReinforceConfig
    if name == "FlashReinforceLossSpec":
        from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec

        return FlashReinforceLossSpec
    if name == "FlashReinforce":
        from flashrl.algorithms.flash_reinforce.algorithm import FlashReinforce

        return FlashReinforce
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
