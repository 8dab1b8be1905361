"""Learning-rate schedules: warmup, then constant, linear or cosine decay, per optimizer step.

The step is the optimizer's own count (AdamW's ``step``, DeepSpeed's ``global_steps``): it is carried
from one policy version to the next with the optimizer state and lives in the resume state, so a
schedule spans a whole run of many ``train-*`` invocations and a resumed run takes the learning rate
the uninterrupted one took. Registered by name (:data:`LR_SCHEDULES`) like the trainer's other parts.
"""

from __future__ import annotations

import math
from typing import Callable

LRSchedule = Callable[[float], float]  # decay progress in [0, 1] -> the factor over the minimum


def constant_decay(progress: float) -> float:
    """No decay: ``1``."""
    return 1.0


def linear_decay(progress: float) -> float:
    """``1 - p``: from the peak to the minimum in a straight line."""
    return 1.0 - progress


def cosine_decay(progress: float) -> float:
    """``(1 + cos(pi p)) / 2``: half a cosine from the peak to the minimum."""
    return 0.5 * (1.0 + math.cos(math.pi * progress))


LR_SCHEDULES: dict[str, LRSchedule] = {"constant": constant_decay, "linear": linear_decay, "cosine": cosine_decay}


def scheduled_lr(step: int, *, lr: float, schedule: str = "constant", warmup_steps: int = 0, decay_steps: int = 0,
                 min_lr_ratio: float = 0.0) -> float:
    """The learning rate of optimizer step ``step`` (0-based: the steps taken before this one).

    With ``W = warmup_steps``, ``D = decay_steps`` (the step the decay ends at, counted from 0 like
    ``step``, warmup included) and ``m = min_lr_ratio``::

        step <  W:  lr * (step + 1) / W                        (linear warmup; the first step is not 0)
        step >= W:  lr * (m + (1 - m) * f(p)),  p = min(1, (step - W) / (D - W))

    ``f`` the schedule's decay (:data:`LR_SCHEDULES`: constant ``1``, linear ``1 - p``, cosine
    ``(1 + cos(pi p)) / 2``); after ``D`` the rate stays at ``lr * m``. ``constant`` ignores ``D``
    and ``m``.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    progress = min(1.0, (step - warmup_steps) / max(decay_steps - warmup_steps, 1))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * LR_SCHEDULES[schedule](progress))
