"""This task's parts of a rollout's prompts and what its written shards add up to: the prompts cut
into parts of ``prompts_per_shard`` (one shard each), the task's share of them (``shard_index`` of
``num_shards``), those still to write, and each shard's ``metrics.jsonl`` line. Shared by the
once-through run (:mod:`glmpost.rollout.runner`) and ``rollout --follow`` (:mod:`glmpost.rollout.follow`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from glmpost.formats import SHARD_SUFFIX, select_shards
from glmpost.formats.shards import remove_partial_shards
from glmpost.kernel.engine import Completion
from glmpost.rollout.records import RolloutPrompt
from glmpost.rollout.settings import RolloutConfig
from glmpost.stage import complete_shard, log

STAGE = "rollout"


@dataclass
class ShardPlan:
    """The prompts cut into parts (one shard each) and this task's parts still to write."""

    parts: list[list[RolloutPrompt]]
    mine: int  # how many parts belong to this task
    todo: list[tuple[int, Path]]  # (part index, shard path) of those to write

    @property
    def skipped(self) -> int:
        return self.mine - len(self.todo)


def task_parts(prompts: list[RolloutPrompt], config: RolloutConfig) -> tuple[list[list[RolloutPrompt]], list[int]]:
    """``prompts`` cut into parts of ``prompts_per_shard``, and the indices of this task's
    (``shard_index`` of ``num_shards``, the shards' round robin)."""
    size = config.prompts_per_shard
    parts = [prompts[i : i + size] for i in range(0, len(prompts), size)]
    names = [f"rollout-{i:05d}{SHARD_SUFFIX}" for i in range(len(parts))]
    mine = select_shards([Path(n) for n in names], config.shard_index, config.num_shards)
    return parts, [names.index(str(p)) for p in mine]


def plan_shards(prompts: list[RolloutPrompt], config: RolloutConfig) -> ShardPlan:
    """Parts of ``prompts_per_shard`` prompts; this task's (:func:`task_parts`) that ``out`` does not
    hold complete (all of them with ``overwrite``): a part already there is read through (footer,
    checksum, records) and redone when it is damaged; what a dead writer of this task's parts left
    (``.NAME.tmp-PID``) is removed. Called with this task's lock held."""
    parts, mine = task_parts(prompts, config)
    paths = [config.out / f"rollout-{i:05d}{SHARD_SUFFIX}" for i in mine]
    remove_partial_shards(paths)
    todo = [(i, path) for i, path in zip(mine, paths)
            if config.overwrite or not complete_shard(path, STAGE, redo="sampling this part again")]
    if len(todo) < len(mine):
        log(f"{len(mine) - len(todo)} of this task's {len(mine)} shard(s) already exist in {config.out}; writing the rest")
    return ShardPlan(parts, len(mine), todo)


@dataclass
class RolloutTotals:
    """What the shards written so far add up to: ``counts`` of shards, records, response_tokens,
    truncated and aborted responses, and the seconds spent generating."""

    counts: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    def add(self, outcomes: int, completions: list[Completion], seconds: float, *, aborted: int) -> None:
        """Count one written shard of ``outcomes`` records, ``completions`` of them delivered and
        ``aborted`` of them aborted."""
        self.counts.update(shards=1, records=outcomes, aborted=aborted,
                           response_tokens=int(_lengths(completions).sum()), truncated=_truncated(completions))
        self.seconds += seconds


def _lengths(completions: list[Completion]) -> np.ndarray:
    """The response lengths (``[0]`` when there is none)."""
    return np.array([len(c.token_ids) for c in completions] or [0])


def _truncated(completions: list[Completion]) -> int:
    """How many responses ``max_new_tokens`` ended."""
    return sum(c.finish_reason == "length" for c in completions)


def shard_metrics(name: str, completions: list[Completion], *, aborted: int, seconds: float,
                  policy_version: int) -> dict[str, Any]:
    """The ``metrics.jsonl`` line of one written shard."""
    lengths = _lengths(completions)
    return {
        "shard": name,
        "rollout/records": len(completions),
        "rollout/tokens_per_s": round(float(lengths.sum()) / max(seconds, 1e-9), 2),
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/response_length_min": int(lengths.min()),
        "rollout/response_length_max": int(lengths.max()),
        "rollout/truncation_rate": _truncated(completions) / max(len(completions), 1),
        "rollout/aborted": aborted,
        "rollout/policy_version": policy_version,
    }
