"""Refilling groups with failed samples (brief, "Agentic RL：异步之后先处理策略滞后", GLM-5's rule).

A sample is *failed* when no update can learn from it: the engine aborted it, or its trajectory
ended ``env_error`` / ``aborted``. GLM-5 resamples the failed samples of a group whose valid
samples are more than half of it, so the group reaches its full size again, and drops a group with
half or fewer valid (the trainer: :func:`glmpost.rl.batches.whole_groups`). ``glmpost rollout
--refill-rounds N`` runs up to N such rounds: each draws one new sample per failed slot, with the next
free sample index of its prompt (so its seed, a function of its id, is as reproducible as any
other's), recorded with ``extra.refill = {"replaces": ID, "round": R}``. The failed samples stay in
the shard, for the trainer's failure accounting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

FAILED_STATUSES = ("env_error", "aborted")


@dataclass
class Sample:
    """One sample of a prompt: its index in the group, what the engine delivered (an outcome
    ``(completion or None, version, reason)``), and for a refill the index it replaces."""

    prompt: Any
    index: int
    outcome: Any = None
    replaces: int | None = None
    round: int = 0

    @property
    def key(self) -> str:
        return f"{self.prompt.prompt_id}/{self.index}"

    def status(self) -> str | None:
        """``aborted`` when the engine delivered nothing or stopped the sequence early, a
        trajectory's status, else None."""
        completion = self.outcome[0]
        if completion is None or completion.finish_reason == "abort":
            return "aborted"
        trajectory = getattr(completion, "trajectory", None)
        return trajectory.status if trajectory is not None else None

    def failed(self) -> bool:
        return self.status() in FAILED_STATUSES


def refill_slots(failed: Sequence[Sequence[bool]]) -> list[tuple[int, int]]:
    """``(group, slot)`` of every failed slot in the groups worth refilling: those whose valid slots
    are more than half (``2 * valid > size``) yet not all. A group with half or fewer valid gets
    none: the trainer drops it whatever is added.

    >>> refill_slots([[False, True, False], [True, True, False], [False, False]])
    [(0, 1)]
    """
    todo = []
    for group, slots in enumerate(failed):
        valid = sum(not f for f in slots)
        if valid < len(slots) and 2 * valid > len(slots):
            todo += [(group, slot) for slot, f in enumerate(slots) if f]
    return todo


def next_round(groups: list[list[Sample]], occupants: list[list[Sample]], round_number: int) -> list[Sample]:
    """The refills of one round: a new sample for each failed slot of a group worth refilling,
    indexed after every sample its prompt already has; ``occupants`` (per group, the sample now
    holding each slot) points at them."""
    new = []
    for group, slot in refill_slots([[s.failed() for s in slots] for slots in occupants]):
        old = occupants[group][slot]
        sample = Sample(old.prompt, len(groups[group]), replaces=old.index, round=round_number)
        groups[group].append(sample)
        occupants[group][slot] = sample
        new.append(sample)
    return new


def refill_metrics(samples: Sequence[Sample]) -> dict[str, Any]:
    """``rollout/refilled`` (refills drawn) and ``rollout/refill_valid`` (of them, not failed)."""
    refills = [s for s in samples if s.replaces is not None]
    if not refills:
        return {}
    return {"rollout/refilled": len(refills), "rollout/refill_valid": sum(not s.failed() for s in refills)}
