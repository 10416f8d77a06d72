"""Learning-rate schedules over the run's known number of updates (one optimizer step per batch).

The schedules and their step convention are those of the method's GPU runtime, NVIDIA Molt
(``molt/trainer/fsdp/strategy.py``: ``transformers.get_scheduler(name, num_warmup_steps=
ceil(total * lr_warmup_ratio), num_training_steps=total, min_lr_rate=min_lr_ratio)``, stepped once
after every optimizer step), which the reference's settings select (``examples/settings/common.json``
in ``yifanzhang-pro/FlashREINFORCE``: ``cosine_with_min_lr``, warmup ratio 0.03, min-lr ratio 0.1;
the ALFWorld setting: ``constant``). Update ``k`` (0-based) uses ``lr * factor(k)``:

* ``constant``: ``factor(k) = 1`` (as transformers' ``constant`` schedule, which has no warmup).
* ``cosine_with_min_lr``: with ``W = ceil(N * lr_warmup_ratio)`` warmup updates of ``N = total_updates``,
  ``factor(k) = k / max(1, W)`` for ``k < W``, then with ``progress = (k - W) / max(1, N - W)``,
  ``factor(k) = m + (1 - m) * (1 + cos(pi * progress)) / 2`` (``m = min_lr_ratio``). With a warmup the
  first update has lr 0. Past ``N`` updates the factor stays at ``m`` (transformers' cosine
  would rise again; flashrl holds the minimum).

The scheduler is a ``torch.optim.lr_scheduler.LambdaLR`` whose ``state_dict`` is part of the learner
state, so a restored run continues the schedule where it stopped.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Protocol

import torch


class ScheduleSettings(Protocol):
    """What a schedule reads (a ``LearnerSpec`` has these fields; this module does not import it)."""

    lr_schedule: str
    lr_warmup_ratio: float
    min_lr_ratio: float
    total_updates: int | None

__all__ = ["LR_SCHEDULES", "ScheduleSettings", "constant_factor", "cosine_with_min_lr_factor", "make_lr_scheduler", "warmup_updates"]

ScheduleFactory = Callable[[ScheduleSettings], Callable[[int], float]]

LR_SCHEDULES: dict[str, ScheduleFactory] = {}
"""Schedule name -> factory(spec) -> factor(update index). Add one by inserting a factory."""


def warmup_updates(total_updates: int, lr_warmup_ratio: float) -> int:
    """The warmup length, ``ceil(total * ratio)`` (the runtime's, as the module docstring says)."""
    return math.ceil(total_updates * lr_warmup_ratio)


def constant_factor(step: int) -> float:
    return 1.0


def cosine_with_min_lr_factor(step: int, *, warmup: int, total: int, min_lr_ratio: float) -> float:
    """The lr multiplier of update ``step`` (0-based): linear warmup, then a half cosine to ``min_lr_ratio``."""
    if step < warmup:
        return step / max(1, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _constant(spec: ScheduleSettings) -> Callable[[int], float]:
    return constant_factor


def _cosine_with_min_lr(spec: ScheduleSettings) -> Callable[[int], float]:
    assert spec.total_updates is not None  # LearnerSpec checks it
    return functools.partial(
        cosine_with_min_lr_factor,
        warmup=warmup_updates(spec.total_updates, spec.lr_warmup_ratio),
        total=spec.total_updates,
        min_lr_ratio=spec.min_lr_ratio,
    )


LR_SCHEDULES["constant"] = _constant
LR_SCHEDULES["cosine_with_min_lr"] = _cosine_with_min_lr


def make_lr_scheduler(optimizer: torch.optim.Optimizer, spec: ScheduleSettings) -> torch.optim.lr_scheduler.LambdaLR:
    """The spec's schedule on ``optimizer``; call ``.step()`` once after every optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, LR_SCHEDULES[spec.lr_schedule](spec))
