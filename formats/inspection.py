"""What ``glmpost shards inspect`` reports of a dataset of shards: counts of records, fields, tokens,
statuses, stages and tokenizer revisions, the reward's distribution, the policy versions of the
action tokens and, for CompactionRL records, their context windows and summaries."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from glmpost.formats.schema import FIELDS
from glmpost.formats.shard_reader import ShardReader
from glmpost.formats.windows import compactions


@dataclass
class DatasetStats:
    """What ``glmpost shards inspect`` reports for one PATH argument."""

    input: str
    shards: int = 0
    records: int = 0
    fields: Counter = field(default_factory=Counter)
    tokens: Counter = field(default_factory=Counter)
    status: Counter = field(default_factory=Counter)
    stages: Counter = field(default_factory=Counter)
    tokenizer_revisions: set = field(default_factory=set)
    rewards: list = field(default_factory=list)
    policy_version_min: Optional[int] = None
    policy_version_max: Optional[int] = None
    compactions: Counter = field(default_factory=Counter)  # compactions per trajectory -> records
    summary_tokens: int = 0
    peak_contexts: list = field(default_factory=list)

    def add_shard(self, reader: ShardReader) -> None:
        self.shards += 1
        self.stages[reader.header["stage"]] += 1
        self.tokenizer_revisions.add(reader.header["tokenizer_revision"])
        for record in reader:
            self.add_record(record)

    def add_record(self, record: dict[str, Any]) -> None:
        self.records += 1
        self.fields.update(record.keys())
        action = record["action_mask"]
        self.tokens.update(
            prompt=len(record["prompt_token_ids"]),
            response=len(record["response_token_ids"]),
            action=int(action.sum()),
            observation=int(record["observation_mask"].sum()),
        )
        self.status[record["status"]] += 1
        env = (record.get("extra") or {}).get("env")
        if isinstance(env, dict):  # a multi-turn record: the drift ledger (rollout --env)
            self.tokens.update(multi_turn=1, retokenize_drift=int(env.get("retokenize_drift") or 0))
        if "reward" in record:
            self.rewards.append(record["reward"])
        if "policy_versions" in record and action.any():
            versions = record["policy_versions"][action]
            low, high = int(versions.min()), int(versions.max())
            self.policy_version_min = low if self.policy_version_min is None else min(low, self.policy_version_min)
            self.policy_version_max = high if self.policy_version_max is None else max(high, self.policy_version_max)
        self.add_compaction(record)

    def add_compaction(self, record: dict[str, Any]) -> None:
        """Context windows and summaries, from the record's segments (CompactionRL, schema version 2);
        ``extra.compaction.peak_context`` where the rollout recorded it."""
        self.compactions[compactions(record)] += 1
        self.summary_tokens += sum(seg["end"] - seg["start"] for seg in record.get("segments") or () if seg["kind"] == "summary")
        compaction = (record.get("extra") or {}).get("compaction")
        peak = compaction.get("peak_context") if isinstance(compaction, dict) else None
        if isinstance(peak, (int, float)) and not isinstance(peak, bool):
            self.peak_contexts.append(peak)

    def compaction_summary(self) -> dict[str, Any]:
        histogram = dict(sorted(self.compactions.items()))
        peak = None
        if self.peak_contexts:
            peak = {"n": len(self.peak_contexts), "mean": float(np.mean(self.peak_contexts)), "max": max(self.peak_contexts)}
        return {
            "compacted": sum(n for count, n in histogram.items() if count),
            "compactions": sum(count * n for count, n in histogram.items()),
            "per_trajectory": {str(count): n for count, n in histogram.items()},
            "summary_tokens": self.summary_tokens,
            "peak_context": peak,
        }

    def reward_summary(self) -> Optional[dict[str, Any]]:
        if not self.rewards:
            return None
        values = np.asarray(self.rewards, dtype=np.float64)
        ok = values[~np.isnan(values)]
        summary: dict[str, Any] = {"n": len(values), "failed": int(len(values) - len(ok))}
        if len(ok):
            summary.update(mean=float(ok.mean()), std=float(ok.std()), min=float(ok.min()), max=float(ok.max()))
        return summary

    def to_json(self) -> dict[str, Any]:
        versions = None
        if self.policy_version_min is not None:
            versions = {"min": self.policy_version_min, "max": self.policy_version_max}
        return {
            "input": self.input,
            "shards": self.shards,
            "records": self.records,
            "fields": {name: self.fields[name] for name in FIELDS if name in self.fields},
            "tokens": {k: self.tokens[k] for k in ("prompt", "response", "action", "observation")
                       + (("retokenize_drift",) if self.tokens["multi_turn"] else ())},
            "status": dict(sorted(self.status.items())),
            "reward": self.reward_summary(),
            "policy_versions": versions,
            "tokenizer_revisions": sorted(self.tokenizer_revisions),
            "stages": dict(sorted(self.stages.items())),
            "compaction": self.compaction_summary(),
        }
