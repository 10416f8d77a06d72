"""Data passes: the training stream walks a finite task set in seeded, shuffled passes (epochs).

An env whose tasks form a finite, indexable list (`finite_task_count`: `MathEnv` and `PythonToolEnv`
over a file or a list, `ALFWorldEnv`'s games) is not reset by seed alone (that draws tasks *with*
replacement): episode ``k`` of the training stream (its global episode index) plays task::

    pass, position = divmod(k, N)            # N = min(len(tasks), max_samples)
    task = permutation(pass)[position]       # a fresh seeded permutation of range(N) per pass

so every pass uses each of the N tasks exactly once, in a new order, as a dataloader with
``shuffle=True`` does over epochs (Molt 0.2.1: `DistributedSampler.set_epoch(epoch)` each
``train.num_episodes`` round). The permutation of pass ``p`` is a function of the run's ``seed`` and
``p`` only, so every runner (and a restarted or resumed one) computes the same order.

How runners share a pass: runner ``i`` of ``n`` plays the global indices ``i, i + n, i + 2n, ...``
(its data cursor ``c`` counts its started episodes, index ``c * n + i``), in `sync_group` mode the
driver's cursor hands out consecutive indices. The cursors are already in every checkpoint and are
restored on resume and on a runner restart, so a pass continues where it stood; no coordination is
needed while sampling. The cost: runners that sample at different speeds drift apart, and the
faster one works ahead into its share of later passes (each pass still uses every task exactly once,
but passes overlap by the runners' lead). Episodes in flight when a runner dies or the run stops
are counted as lost (`env_runners/num_lost_episodes_lifetime`) and their tasks are not replayed in
that pass. Evaluation envs are not affected (they walk their list in order, `evaluation_reset_options`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DATA_STREAM", "DataPasses", "DataPassesError"]

DATA_STREAM = 2
"""Seed stream of the pass permutations (TRAIN_STREAM = 0 and EVAL_STREAM = 1 seed the episodes)."""


class DataPassesError(ValueError):
    """A checkpoint's data passes do not fit the training set of the run that resumes it."""


@functools.lru_cache(maxsize=8)
def _permutation(seed: int, size: int, pass_index: int) -> np.ndarray:
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), DATA_STREAM, int(pass_index)]))
    return rng.permutation(size)


@dataclass(frozen=True)
class DataPasses:
    """Global training episode index -> task index, in seeded shuffled passes over ``size`` tasks."""

    size: int
    """Tasks in one pass: the env's finite task count, cut to ``max_samples``."""
    seed: int = 0
    """The run's seed (the permutation of pass p depends on it and p only)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1):
            raise ValueError(f"DataPasses: expected size >= 1 tasks, got {self.size!r}.")

    @classmethod
    def for_env(cls, task_count: int | None, *, max_samples: int | None, seed: int) -> DataPasses | None:
        """The passes over an env with ``task_count`` tasks (None: an infinite source, no passes)."""
        if task_count is None:
            return None
        return cls(min(int(task_count), int(max_samples)) if max_samples is not None else int(task_count), seed)

    def position(self, index: int) -> tuple[int, int]:
        """(pass, position in the pass) of global episode index ``index``."""
        if index < 0:
            raise ValueError(f"DataPasses: expected an episode index >= 0, got {index}.")
        return divmod(int(index), self.size)

    def task_index(self, index: int) -> int:
        """The task played by global training episode ``index``."""
        pass_index, position = self.position(index)
        return int(_permutation(self.seed, self.size, pass_index)[position])

    def progress(self, runner_cursors: Sequence[int]) -> dict[str, Any]:
        """Where the passes stand, from the runners' data cursors (JSON-ready, for the checkpoint).

        ``passes_completed``: passes every one of whose episodes has started (the lowest global index
        not yet started, divided by N); ``started``: training episodes started; ``pass_position``: that
        lowest unstarted index's position in its pass.
        """
        n = len(runner_cursors)
        lowest = min((int(c) * n + i for i, c in enumerate(runner_cursors)), default=0)
        completed, position = divmod(lowest, self.size)
        return {
            "size": self.size,
            "seed": self.seed,
            "started": int(sum(int(c) for c in runner_cursors)),
            "passes_completed": completed,
            "pass_position": position,
        }

    def check_resume(self, saved: Mapping[str, Any] | None) -> None:
        """Raise `DataPassesError` when a checkpoint's passes were over another set (size or seed)."""
        if not saved:
            return
        if int(saved["size"]) != self.size or int(saved["seed"]) != self.seed:
            raise DataPassesError(
                f"resume: the checkpoint's data passes are over {saved['size']} tasks with seed {saved['seed']}, "
                f"this run's over {self.size} tasks with seed {self.seed}; expected the same training set. "
                "Fix: resume with the checkpoint's training data, max_samples and seed (or start a new run)."
            )
