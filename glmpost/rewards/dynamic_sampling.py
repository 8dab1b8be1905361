"""DAPO's dynamic sampling, the judge's half (Yu et al. 2025, "DAPO", §3.2, eq. 11: keep a group only
when ``0 < |{o_i : is_equivalent(a, o_i)}| < G``): ``judge --dynamic-sampling`` drops every group
whose rewards are all equal, because its GRPO advantages ``(R - mean) / (std + eps)`` are all zero:
it adds no gradient, only tokens to the loss's denominator, diluting the informative groups.

A group is the records of one ``group_id`` in one shard (rollout writes a prompt's samples, refills
included, into one part). It is *informative* when at least two of its rewards are finite and they
are not all equal (:func:`informative`): for a 0/1 verifier exactly DAPO's rule, for any reward
mixture its generalisation (the group's reward std is above 0). Failed records (a NaN reward) stay
with a kept group, for the trainer's failure accounting, and go with a dropped one.

Over-sampling is the pipeline's: following spools (``rollout --follow`` -> ``judge --follow
--dynamic-sampling`` -> ``train-grpo --follow``) the trainer takes ``--follow-records`` records per
update, so the rollout keeps sampling until that many informative records have come through; run
once, the rollout's prompts are the over-sampled batch. Every judged shard's metrics line counts
what was dropped (``judge/dynamic_sampling/*``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from glmpost.errors import GlmpostError


def informative(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards can teach anything: two or more finite values, not all equal.

    >>> informative([1.0, 0.0, 1.0]), informative([1.0, 1.0]), informative([0.5, float("nan")]), informative([])
    (True, False, False, False)
    """
    finite = [r for r in rewards if r is not None and math.isfinite(r)]
    return len(finite) >= 2 and max(finite) > min(finite)


@dataclass
class GroupFilter:
    """Counts across shards: groups kept and dropped, records dropped."""

    groups_kept: int = 0
    groups_dropped: int = 0
    records_dropped: int = 0

    def keep_informative(self, records: list[dict[str, Any]], *, where: str) -> list[dict[str, Any]]:
        """The records of ``records``' informative groups, in their order; counted. A record without
        a ``group_id`` is refused naming ``where`` (its shard)."""
        groups: dict[Any, list[float]] = {}
        for record in records:
            if record.get("group_id") is None:
                raise GlmpostError(f"{where}: record {record.get('id')!r} has no group_id; --dynamic-sampling keeps "
                                   "or drops whole groups (rollout writes group_id)")
            reward = record.get("reward")
            groups.setdefault(record["group_id"], []).append(math.nan if reward is None else float(reward))
        kept = {group for group, rewards in groups.items() if informative(rewards)}
        self.groups_kept += len(kept)
        self.groups_dropped += len(groups) - len(kept)
        survivors = [record for record in records if record["group_id"] in kept]
        self.records_dropped += len(records) - len(survivors)
        return survivors

    def metrics(self, prefix: str = "judge/dynamic_sampling/") -> dict[str, int]:
        return {f"{prefix}groups_kept": self.groups_kept, f"{prefix}groups_dropped": self.groups_dropped,
                f"{prefix}records_dropped": self.records_dropped}

    def merge(self, other: GroupFilter) -> None:
        self.groups_kept += other.groups_kept
        self.groups_dropped += other.groups_dropped
        self.records_dropped += other.records_dropped
