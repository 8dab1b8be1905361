"""Synthetic but realistic records (one context window each: no compaction), for tests and benchmarks.

Token ids are log-uniform over a GLM-sized vocabulary (small ids are common, as in real text),
action log-probs are negative float32 values with most tokens near 0 and a long tail (as sampled
LLM tokens are), teacher log-probs scatter multiplicatively around them, observations carry NaN
log-probs and policy version -1. Records of one GRPO group (``GROUP_SIZE`` consecutive indices)
share their prompt, as rollouts do; responses are independent random tokens (real ones repeat
more), so compression numbers measured on these records are if anything pessimistic.
"""

from __future__ import annotations

from typing import Any

import numpy as np

VOCAB_SIZE = 151_552
GROUP_SIZE = 8


def synthetic_record(
    rng: np.random.Generator | int,
    *,
    index: int = 0,
    prompt_len: int = 200,
    response_len: int = 2000,
    turns: int = 3,
    topk: int = 0,
    judged: bool = True,
    teacher: bool = True,
    tokenizer_revision: str = "synthetic-tokenizer",
    policy_version: int = 7,
) -> dict[str, Any]:
    """One valid record: ``turns`` action segments separated by observation segments.

    ``topk > 0`` adds ``teacher_topk_ids`` / ``teacher_topk_log_probs`` of width ``topk``;
    ``judged`` adds rewards; ``teacher`` adds teacher log-probs and the ``teacher`` map.
    """
    rng = np.random.default_rng(rng)
    group = index // GROUP_SIZE
    prompt_rng = np.random.default_rng([group, prompt_len])  # the same prompt for the whole group
    T = response_len
    segments = _segments(rng, T, turns)
    action = np.zeros(T, dtype=bool)
    versions = np.full(T, -1, dtype=np.int32)
    for seg in segments:
        if seg["kind"] == "action":
            action[seg["start"] : seg["end"]] = True
            versions[seg["start"] : seg["end"]] = policy_version - int(rng.integers(0, 2))
    log_probs = np.where(action, _log_probs(rng, T), np.nan).astype(np.float32)
    record: dict[str, Any] = {
        "id": f"traj-{index:08d}",
        "prompt_id": f"prompt-{group:08d}",
        "group_id": f"group-{group:08d}",
        "domain": "math",
        "task": {"answer": str(int(prompt_rng.integers(0, 1000))), "source": "synthetic"},
        "prompt_token_ids": _token_ids(prompt_rng, prompt_len),
        "response_token_ids": _token_ids(rng, T),
        "action_mask": action,
        "observation_mask": ~action,
        "rollout_log_probs": log_probs,
        "policy_versions": versions,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": index, "engine": "synthetic"},
        "tokenizer_revision": tokenizer_revision,
        "segments": segments,
        "status": "completed" if rng.random() < 0.9 else "truncated",
    }
    if judged:
        correct = float(rng.random() < 0.5)
        record["rewards"] = {"correct": correct, "format": 1.0}
        record["reward"] = correct
        record["reward_info"] = {"judge": "synthetic"}
    if teacher:
        scatter = np.exp(rng.normal(0.0, 0.5, T))
        record["teacher_log_probs"] = np.where(action, log_probs * scatter, np.nan).astype(np.float32)
        record["teacher"] = {"id": "synthetic-teacher", "revision": "r1", "payload": "topk" if topk else "sampled"}
    if topk:
        record["teacher_topk_ids"] = _token_ids(rng, T * topk).reshape(T, topk)
        descending = np.sort(_log_probs(rng, T * topk).reshape(T, topk), axis=1)[:, ::-1]
        record["teacher_topk_log_probs"] = np.ascontiguousarray(descending)
    return record


def _token_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.exp(rng.uniform(0.0, np.log(VOCAB_SIZE), n)).astype(np.int32)


def _log_probs(rng: np.random.Generator, n: int) -> np.ndarray:
    return (-np.exp(rng.normal(-3.0, 2.5, n))).clip(-30.0, 0.0).astype(np.float32)


def _segments(rng: np.random.Generator, T: int, turns: int) -> list[dict[str, Any]]:
    """``turns`` action segments with observations between them, covering ``[0, T)``."""
    pieces = 2 * turns - 1
    if T < pieces:
        return [{"start": 0, "end": T, "kind": "action", "turn": 0}]
    cuts = np.sort(rng.choice(np.arange(1, T), size=pieces - 1, replace=False)).tolist()
    bounds = [0, *cuts, T]
    return [
        {"start": bounds[i], "end": bounds[i + 1], "kind": "action" if i % 2 == 0 else "observation", "turn": i // 2}
        for i in range(pieces)
    ]
