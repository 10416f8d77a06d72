"""`LearnerRestarts`: the driver's books and rules for restarting a failed learner group.

A learner actor that dies (killed, out of memory, node lost) or does not answer within the group's
timeout breaks the whole group: the ranks of one process group cannot go on without it, so
`LearnerGroup` stops every actor and raises `LearnerGroupError` (``LearnerGroup.failure`` says why).
The driver then, as Ray Train does with ``FailureConfig(max_failures=...)``, either stops the run
with that cause (``restart_failed_learners=False``, or after ``max_num_learner_restarts``) or starts a
new learner group and resumes from the newest checkpoint of this run (one it wrote or restored), or,
before the first one, from the state at the start: the initial weights, a fresh optimizer, iteration 0.
The updates made after that point are lost (redone from the restored data cursors) and counted.

An exception raised by the learners' own code (a bad batch, a CUDA out-of-memory error) is not a
fault: it repeats on a restart, so it stops the run as it is. This module keeps the books and
writes the messages; `FlashReinforce` does the restart.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flashrl.learners import LearnerGroupError

__all__ = ["LearnerRestarts"]


@dataclass
class LearnerRestarts:
    """What a run knows about its learner restarts; `FlashReinforce` holds one.

    Args:
        restart: restart the learner group after a fault (``restart_failed_learners``).
        max_restarts: the most restarts in one run (``max_num_learner_restarts``).
    """

    restart: bool
    max_restarts: int
    num_restarts: int = 0
    """Learner-group restarts so far (attempts: a restart whose own setup failed counts too)."""
    num_lost_updates: int = 0
    """Updates made after the restored checkpoint (or the start) and lost with the failed group."""
    checkpoint: str | None = None
    """The newest checkpoint this run wrote or restored: where a restart resumes."""
    start_state: dict[str, Any] = field(default_factory=dict)
    """The algorithm state at the start (iteration 0, the stream's books): a restart before any
    checkpoint resumes from it."""

    def begin(self, cause: str, error: LearnerGroupError) -> None:
        """Count a restart of the group that failed with ``cause``; raise if the run must stop instead."""
        cause = cause.rstrip(". ")
        if not self.restart:
            raise LearnerGroupError(
                f"The learner group failed: {cause}. restart_failed_learners=False, so the run stops here. "
                "Fix: resume from the newest checkpoint (FlashReinforce.from_checkpoint), or set "
                "restart_failed_learners=True to restart the learners automatically."
            ) from error
        if self.num_restarts >= self.max_restarts:
            raise LearnerGroupError(
                f"The learner group failed: {cause}. It was restarted {self.num_restarts} time(s) already "
                f"(max_num_learner_restarts={self.max_restarts}), so the run stops here. Fix: find why the "
                "learner actors die (their logs, memory, the node), or raise max_num_learner_restarts."
            ) from error
        self.num_restarts += 1

    def resume_point(self) -> str | None:
        """The checkpoint a restart resumes from; None = the state at the start."""
        if self.checkpoint is not None and not os.path.isdir(self.checkpoint):
            raise LearnerGroupError(
                f"The learner group failed and would resume from this run's newest checkpoint {self.checkpoint}, "
                "but that folder no longer exists. Fix: keep the newest checkpoint (num_checkpoints_to_keep >= 1), "
                "or resume by hand from another one (FlashReinforce.from_checkpoint)."
            )
        return self.checkpoint

    def metrics(self) -> dict[str, float]:
        """``learners/num_restarts_lifetime`` and ``learners/num_lost_updates_lifetime``."""
        return {
            "learners/num_restarts_lifetime": float(self.num_restarts),
            "learners/num_lost_updates_lifetime": float(self.num_lost_updates),
        }

    def state(self) -> dict[str, int]:
        """The books' part of a checkpoint's algorithm state."""
        return {"num_learner_restarts": self.num_restarts, "num_lost_updates": self.num_lost_updates}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Take a checkpoint's books (0 for a checkpoint written before they existed)."""
        self.num_restarts = int(state.get("num_learner_restarts", 0))
        self.num_lost_updates = int(state.get("num_lost_updates", 0))
