"""``diff-logprobs --by-version ROOT``: split the rollout mismatch into the engine's part and the
version lag's (brief: the two ratios it keeps apart, "IcePop 为什么有两层 ratio"; DIS: "允许系统异步前进，
同时只让仍然可信的 token 产生梯度").

For an action token sampled at policy version ``v`` (its ``policy_versions`` entry) and scored by
path A (the trainer's ``--checkpoint``, version ``c``):

- **engine** ``log pi_v^train - log pi_v^rollout``: the token re-scored by the trainer's forward with
  checkpoint ``v`` itself (the version's directory in ``ROOT``, or, for the root's first parent,
  the checkpoint its manifest names) against the recorded rollout log-prob: two engines, one set
  of weights (IcePop's ratio);
- **lag** ``log pi_c - log pi_v^train``: what the ``c - v`` updates since changed (no engine in it);
- **DIS** keeps the token iff ``1 - eps_low < pi_c / pi_rollout < 1 + eps_high``: its kept fraction.

Reported per lag bucket ``c - v``: tokens, mean / max |engine|, mean / max |lag|, DIS and IcePop
kept fractions; and the engine mismatch of the tokens sampled on a stale KV cache (a rollout that kept
a trajectory's cache across a weight switch, :mod:`glmpost.diff.kv_cache`) apart from the rest.
No peer keeps the trainer's log-probs at the rollout version; the root does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from glmpost.checkpoints import CheckpointError, CheckpointRoot, read_manifest
from glmpost.config import ConfigError
from glmpost.diff.kv_cache import stale_cache_tokens
from glmpost.diff.mismatch import PathScores, action_positions
from glmpost.formats.schema import UNKNOWN_VERSION


def version_directories(root: Path) -> dict[int, Path]:
    """``{policy version: directory}`` of every version under ``root`` and the parents their
    manifests name (the initial checkpoint a root's first version was trained from)."""
    found: dict[int, Path] = {}
    checkpoints = CheckpointRoot(root)
    for version in checkpoints.versions():
        directory = checkpoints.version_dir(version)
        found[version] = directory
        try:
            parent = read_manifest(directory).parent
        except CheckpointError:
            continue
        if parent and Path(parent).is_dir():
            try:
                found.setdefault(read_manifest(Path(parent)).policy_version, Path(parent))
            except CheckpointError:
                pass
    return found


def version_split(records: Sequence[dict[str, Any]], path_a: PathScores, *, current_version: int, root: Path,
                  score_with: Callable[[Path, list[dict[str, Any]]], PathScores], beta: float, eps_low: float,
                  eps_high: float) -> dict[str, Any]:
    """The report section (module doc). ``score_with(directory, records)`` scores records through
    the trainer's forward with another checkpoint (path A's settings)."""
    directories = version_directories(root)
    rows: dict[int, list[int]] = {}
    unknown = 0  # tokens no version was confirmed for (policy version -1): nothing to re-score them with
    for index, record in enumerate(records):
        actions = action_positions(record)
        stamped = np.asarray(record["policy_versions"])[actions]
        unknown += int((stamped == UNKNOWN_VERSION).sum())
        for version in np.unique(stamped[stamped != UNKNOWN_VERSION]):
            rows.setdefault(int(version), []).append(index)
    missing = sorted(v for v in rows if v not in directories)
    if missing:
        raise ConfigError("{by_version} {root}: no checkpoint of policy version(s) {missing} (kept: {kept})", root=root,
                          missing=missing, kept=sorted(directories), exit_code=CheckpointError.exit_code)
    engine, lag, dis, icepop, lags, stale = [], [], [], [], [], []
    for version, indices in sorted(rows.items()):
        subset = [records[i] for i in indices]
        at_version = score_with(directories[version], subset)
        for row, i in enumerate(indices):
            record = subset[row]
            mask = action_positions(record) & (np.asarray(record["policy_versions"]) == version)
            rollout = np.asarray(record["rollout_log_probs"], dtype=np.float64)[mask]
            trained_v, current = at_version.log_probs[row][mask], path_a.log_probs[i][mask]
            engine.append(trained_v - rollout)
            lag.append(current - trained_v)
            ratio = np.exp(current - rollout)
            dis.append((ratio > 1 - eps_low) & (ratio < 1 + eps_high))
            engine_ratio = np.exp(trained_v - rollout)
            icepop.append((engine_ratio >= 1 / beta) & (engine_ratio <= beta))
            lags.append(np.full(int(mask.sum()), current_version - version))
            stale.append(stale_cache_tokens(record)[mask])
    engine_all, lag_all, dis_all, icepop_all, lag_of, stale_all = map(np.concatenate, (engine, lag, dis, icepop, lags, stale))
    buckets = {}
    for value in sorted(set(lag_of.tolist())):
        pick = lag_of == value
        buckets[str(value)] = {
            "tokens": int(pick.sum()),
            "engine_mean_abs": float(np.abs(engine_all[pick]).mean()), "engine_max_abs": float(np.abs(engine_all[pick]).max()),
            "lag_mean_abs": float(np.abs(lag_all[pick]).mean()), "lag_max_abs": float(np.abs(lag_all[pick]).max()),
            "dis_kept": float(dis_all[pick].mean()), "icepop_kept": float(icepop_all[pick].mean()),
        }
    # The KV owner contract: a turn sampled at v on keys and values an older version computed is an
    # engine mismatch the trainer's whole-trajectory forward at v does not share.
    by_cache = {label: {"tokens": int(pick.sum()), "engine_mean_abs": float(np.abs(engine_all[pick]).mean()),
                        "engine_max_abs": float(np.abs(engine_all[pick]).max())}
                for label, pick in (("fresh", ~stale_all), ("stale", stale_all)) if pick.any()}
    return {"root": str(root), "current_version": current_version, "versions_scored": sorted(rows), "unknown_version_tokens": unknown,
            "by_lag": buckets, "engine_by_kv_cache": by_cache,
            "engine_max_abs": float(np.abs(engine_all).max()), "lag_max_abs": float(np.abs(lag_all).max())}
