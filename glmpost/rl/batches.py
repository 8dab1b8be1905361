"""Records as training examples.

A record becomes a :class:`TrainExample` per context window (prompt + response ids, the action
tokens it optimises, its rollout log-probs and its advantage; a record that CompactionRL compacted
has several windows, each scored on exactly the rebuilt context the engine saw, formats/windows.py);
failed rollouts, NaN rewards (when the update uses
rewards) and records without an action token are excluded and counted. Examples become
micro-batches in :mod:`glmpost.rl.micro_batches`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from glmpost.config import ConfigError
from glmpost.formats.windows import context_windows, window_inputs
from glmpost.rl.advantages import cross_segment_factor, group_advantages, later_trainable_tokens
from glmpost.stage import log

TRAINABLE_STATUSES = ("completed", "truncated")



@dataclass
class TrainExample:
    """One trajectory as the trainer needs it."""

    input_ids: list[int]
    prompt_length: int
    action_mask: np.ndarray  # bool [T]
    rollout_log_probs: np.ndarray  # float32 [T]
    advantage: float
    group_id: str
    domain: str = ""
    teacher: str = ""
    reward: float = math.nan  # the trajectory's reward where the update reads it per token (SAO's GAE)
    trajectory: str = ""  # the record's id (a compacted record's windows share it)
    window: int = 0  # its context window (CompactionRL's segment s)
    later_tokens: int = 0  # N_{>s}: the trajectory's trainable tokens in later windows
    # Further per-response-token arrays ([T] or [T, k]) that collate lays out like rollout_log_probs,
    # e.g. the teacher's log-probs for on-policy distillation.
    token_fields: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class PreparedBatch:
    """Records turned into examples, with what was left out and why."""

    examples: list[TrainExample]
    rewards: np.ndarray
    excluded: dict[str, int] = field(default_factory=dict)
    zero_advantage_groups: int = 0
    groups: int = 0
    group_sizes: dict[int, int] = field(default_factory=dict)  # trained groups by their number of valid samples
    failed: dict[str, int] = field(default_factory=dict)  # records not trained, by status or reason


def usable_records(records: Sequence[dict[str, Any]], *, need_reward: bool) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The records an update trains on, and how many of the rest were excluded and why: a failed
    rollout (status), a NaN reward (only when the update uses rewards), no action token."""
    excluded = {"nan_reward": 0, "status": 0, "no_actions": 0}
    usable = []
    for record in records:
        if record["status"] not in TRAINABLE_STATUSES:
            excluded["status"] += 1
        elif need_reward and not math.isfinite(record["reward"]):
            excluded["nan_reward"] += 1
        elif not (record["action_mask"] & ~record["observation_mask"]).any():
            excluded["no_actions"] += 1
        else:
            usable.append(record)
    return usable, excluded


def version_lag(record: dict[str, Any], version: int) -> int | None:
    """How many policy versions before ``version`` the record's oldest action token was sampled
    (``version - min(policy_versions[actions])``; negative: sampled by a newer policy); None for a
    record without ``policy_versions`` or without an action token (imported data), or with an
    action token of unknown version (-1: a server that reported no policy version)."""
    versions = record.get("policy_versions")
    if versions is None:
        return None
    actions = np.asarray(record["action_mask"], dtype=bool) & ~np.asarray(record["observation_mask"], dtype=bool)
    if not actions.any():
        return None
    oldest = int(np.asarray(versions)[actions].min())
    return None if oldest < 0 else version - oldest


def check_version_lags(records: Sequence[dict[str, Any]], version: int, *, max_lag: int, stage: str,
                       dis: bool = False) -> dict[str, int]:
    """Refuse a record sampled by a policy newer than ``version`` (the checkpoint old log-probs are
    recomputed on) or more than ``max_lag`` versions older (IcePop's ratio assumes the same weights,
    brief "IcePop 为什么有两层 ratio"; ``dis``: the update masks with DIS already); returns how many records have each lag (``"unknown"``:
    records without versions)."""
    counts: dict[str, int] = {}
    for record in records:
        lag = version_lag(record, version)
        if lag is not None and lag < 0:
            raise ConfigError("{stage}: record {id!r} was sampled by policy version {sampled}, newer than {checkpoint}'s "
                              "{version}", stage=stage, id=record["id"], sampled=version - lag, version=version)
        if lag is not None and lag > max_lag:
            why = ("DIS masks the tokens a lag moved too far, within the lag accepted: pass {max_version_lag} {lag} "
                   "to accept it" if dis else "IcePop assumes the same weights: resample it, or pass {max_version_lag} {lag} "
                   "(lagged records are then masked with DIS)")
            raise ConfigError("{stage}: record {id!r} was sampled by policy version {sampled}, {lag} behind {checkpoint}'s "
                              "{version}; " + why, stage=stage, id=record["id"], sampled=version - lag, lag=lag,
                              version=version)
        key = "unknown" if lag is None else str(lag)
        counts[key] = counts.get(key, 0) + 1
    if counts.get("unknown"):
        log(f"{stage}: {counts['unknown']} of {len(records)} records carry no policy version for their action tokens "
            "(imported data, or a server that reported none): their staleness cannot be checked, nor IcePop's same-weights "
            "assumption")
    return counts


def train_example(record: dict[str, Any], advantage: float, **extra: Any) -> TrainExample:
    """A record of one context window as the trainer sees it: prompt + response ids, the action
    tokens it optimises."""
    return TrainExample(
        input_ids=record["prompt_token_ids"].tolist() + record["response_token_ids"].tolist(),
        prompt_length=len(record["prompt_token_ids"]),
        action_mask=record["action_mask"] & ~record["observation_mask"],
        rollout_log_probs=record["rollout_log_probs"],
        advantage=float(advantage),
        group_id=record["group_id"],
        trajectory=record.get("id", ""),
        **extra,
    )


def train_examples(record: dict[str, Any], advantage: float, **extra: Any) -> list[TrainExample]:
    """A record as the trainer sees it, one example per context window (brief, CompactionRL: a
    compacted trajectory is ``K`` segments): window ``s`` scores its tokens on exactly its context
    (the rebuilt one the engine was fed, formats/windows.py), so the pairs a rebuilt context copied
    are prompt there and train nowhere a second time; every window shares the trajectory's
    ``advantage`` and records ``N_{>s}``, the trainable tokens in later windows
    (:func:`~glmpost.rl.advantages.later_trainable_tokens`). Per-token ``token_fields`` are cut
    per window; a window without an action token gives no example."""
    windows = context_windows(record)
    if len(windows) == 1:
        return [train_example(record, advantage, **extra)]
    actions = record["action_mask"] & ~record["observation_mask"]
    counts = [int(actions[w.start : w.end].sum()) for w in windows]
    fields = extra.pop("token_fields", {})
    examples = []
    for window, count, later in zip(windows, counts, later_trainable_tokens(counts)):
        if not count:
            continue
        ids, prompt_length = window_inputs(record, window)
        cut = slice(window.start, window.end)
        examples.append(TrainExample(
            input_ids=ids, prompt_length=prompt_length, action_mask=actions[cut],
            rollout_log_probs=record["rollout_log_probs"][cut], advantage=float(advantage), group_id=record["group_id"],
            trajectory=record.get("id", ""), window=window.index, later_tokens=later,
            token_fields={name: values[cut] for name, values in fields.items()}, **extra))
    return examples


def segment_accounting(examples: Sequence[TrainExample], gamma_lambda: float) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """CompactionRL's segment accounting of an update: step metrics (trajectories compacted,
    compactions, segments, their trainable tokens, the cross-segment factor's range) and one line
    per segment of every compacted trajectory (its window, trainable tokens, ``N_{>s}`` and factor
    ``(gamma * lambda)^{N_{>s}}``). Nothing when no trajectory was compacted."""
    windows: dict[str, list[TrainExample]] = {}
    for example in examples:
        windows.setdefault(example.trajectory, []).append(example)
    compacted = {trajectory: parts for trajectory, parts in windows.items() if len(parts) > 1 or parts[0].window > 0}
    if not compacted:
        return {}, []
    segments = [e for parts in compacted.values() for e in parts]
    tokens = np.array([int(e.action_mask.sum()) for e in segments])
    factors = cross_segment_factor(torch.tensor([float(e.later_tokens) for e in segments]), gamma_lambda).numpy()
    lines = [{"compaction/trajectory": e.trajectory, "compaction/window": e.window, "compaction/trainable_tokens": int(n),
              "compaction/later_tokens": e.later_tokens, "compaction/factor": float(f)}
             for e, n, f in zip(segments, tokens, factors)]
    return {
        "compaction/trajectories": len(compacted),
        "compaction/compactions": sum(max(e.window for e in parts) for parts in compacted.values()),
        "compaction/segments": len(segments),
        "compaction/segment_tokens_mean": float(tokens.mean()),
        "compaction/segment_tokens_max": int(tokens.max()),
        "compaction/factor_min": float(factors.min()),
        "compaction/factor_mean": float(factors.mean()),
    }, lines


def trained_records(examples: Sequence[TrainExample]) -> int:
    """How many records ``examples`` come from (a compacted record gives one example per window)."""
    return len({e.trajectory for e in examples})


def drop_stale(records: Sequence[dict[str, Any]], version: int, max_staleness: int | None) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """GLM-5's version filter (brief, "Direct Double-Sided Importance Sampling": drop samples with
    ``v_train - v_rollout > tau``): the records whose oldest action token lags ``version`` by more
    than ``max_staleness`` are dropped whole, before any token check. Returns the rest and metrics:
    how many were dropped, and the response lengths and rewards of the dropped and the kept (dropping
    biases against long, hard trajectories: the metrics show by how much)."""
    if max_staleness is None:
        return list(records), {}
    kept, dropped = [], []
    for record in records:
        lag = version_lag(record, version)
        (dropped if lag is not None and lag > max_staleness else kept).append(record)

    def means(part: list[dict[str, Any]], name: str) -> dict[str, float]:
        lengths = [len(r["response_token_ids"]) for r in part]
        rewards = [r["reward"] for r in part if math.isfinite(r.get("reward", float("nan")))]
        return {f"train/{name}_response_length_mean": float(np.mean(lengths)) if lengths else 0.0,
                f"train/{name}_reward_mean": float(np.mean(rewards)) if rewards else 0.0}

    return kept, {"train/stale_dropped": len(dropped), **means(dropped, "stale_dropped"), **means(kept, "kept")}


def whole_groups(records: Sequence[dict[str, Any]], usable: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int, dict[int, int]]:
    """GLM-5's rule for failed samples (brief, same section): a group with more than half of its
    samples valid (trainable status, finite reward) keeps them, and its baseline is theirs alone;
    a group with half or fewer is dropped whole. A group's size is ``sampling.group_size`` or the
    number of its slots, whichever is larger: every record is a slot but a refill (``extra.refill``,
    :mod:`glmpost.rollout.refill`), which takes the slot of the failed sample it replaces. Returns the
    kept records, how many valid records were dropped with their group, and the kept groups by their
    number of valid samples."""
    size: dict[str, int] = {}
    for record in records:
        group = record["group_id"]
        size[group] = size.get(group, 0) + (0 if "refill" in (record.get("extra") or {}) else 1)
    for record in records:
        declared = (record.get("sampling") or {}).get("group_size")
        if isinstance(declared, int):
            size[record["group_id"]] = max(size[record["group_id"]], declared)
    valid: dict[str, int] = {}
    for record in usable:
        valid[record["group_id"]] = valid.get(record["group_id"], 0) + 1
    kept = [r for r in usable if 2 * valid[r["group_id"]] > size[r["group_id"]]]
    histogram: dict[int, int] = {}
    for group, count in valid.items():
        if 2 * count > size[group]:
            histogram[count] = histogram.get(count, 0) + 1
    return kept, len(usable) - len(kept), dict(sorted(histogram.items()))


def failure_counts(records: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Records no update can train, by status (``aborted``, ``env_error``, ...) or ``nan_reward``."""
    counts: dict[str, int] = {}
    for record in records:
        if record["status"] not in TRAINABLE_STATUSES:
            key = record["status"]
        elif "reward" in record and not math.isfinite(record["reward"]):
            key = "nan_reward"
        else:
            continue
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def prepare_batch(records: Sequence[dict[str, Any]], *, advantage_eps: float = 1e-6,
                  advantage_scaling: str = "group") -> PreparedBatch:
    """Group advantages over usable records (scaled by ``advantage_scaling``,
    :data:`~glmpost.rl.advantages.REWARD_SCALINGS`); NaN rewards and failed rollouts are excluded and counted,
    and groups with half or fewer valid samples dropped whole (:func:`whole_groups`)."""
    usable, excluded = usable_records(records, need_reward=True)
    usable, excluded["small_group"], sizes = whole_groups(records, usable)
    rewards = np.array([r["reward"] for r in usable], dtype=np.float64)
    groups = [r["group_id"] for r in usable]
    if usable:
        advantages, zero_signal = group_advantages(torch.from_numpy(rewards), groups, eps=advantage_eps,
                                                   scaling=advantage_scaling)
    else:
        advantages, zero_signal = torch.zeros(0), torch.zeros(0, dtype=torch.bool)
    examples = [e for r, a in zip(usable, advantages.tolist()) for e in train_examples(r, a)]
    zero_groups = {g for g, z in zip(groups, zero_signal.tolist()) if z}
    return PreparedBatch(examples, rewards, excluded, len(zero_groups), len(set(groups)), sizes, failure_counts(records))


def prepare_opd_batch(
    records: Sequence[dict[str, Any]], *, loss: str = "sampled", task_advantage_weight: float = 0.0, advantage_eps: float = 1e-6
) -> PreparedBatch:
    """Scored records as OPD examples: the teacher payload rides along in ``token_fields``.

    Failed rollouts and records without action tokens are excluded and counted; with a task
    advantage weight, records with a NaN reward are too, and the task advantage is GRPO's group
    advantage over ``group_id`` (0 for a group of one).
    """
    usable, excluded = usable_records(records, need_reward=task_advantage_weight > 0)
    groups = [r["group_id"] for r in usable]
    rewards = np.array([r["reward"] for r in usable if "reward" in r], dtype=np.float64)
    advantages = [0.0] * len(usable)
    zero_groups: set[str] = set()
    if task_advantage_weight > 0 and usable:
        values, zero_signal = group_advantages(torch.from_numpy(rewards), groups, eps=advantage_eps)
        advantages = values.tolist()
        zero_groups = {g for g, z in zip(groups, zero_signal.tolist()) if z}
    fields = ("teacher_log_probs",) + (("teacher_topk_ids", "teacher_topk_log_probs") if loss == "topk" else ())
    examples = [
        e for r, a in zip(usable, advantages)
        for e in train_examples(r, a, domain=r.get("domain", ""), teacher=str(r["teacher"].get("id", "")),
                                token_fields={name: r[name] for name in fields})
    ]
    return PreparedBatch(examples, rewards, excluded, len(zero_groups), len(set(groups)))
