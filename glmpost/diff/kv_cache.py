"""Which action tokens were sampled on a stale KV cache (brief: "多轮会话的 DP routing 与 KV Cache owner
同步迁移或显式失效"), so ``diff-logprobs`` can show the mismatch a kept cache causes apart from the rest.

A rollout that switches weights between the turns of a trajectory either recomputes the
trajectory's cache under the new weights (``rollout --kv-on-switch recompute``) or keeps it
(``keep``): the turns after the switch then attend to keys and values the old weights computed,
and the record lists them in ``extra.kv_cache.stale_turns`` (``{"turn", "version",
"cache_version"}``). The trainer re-scores the whole trajectory with one set of weights, so those
turns' tokens differ from their rollout log-probs even when the versions match.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def stale_cache_tokens(record: dict[str, Any]) -> np.ndarray:
    """Per response token: True when its turn was sampled on a cache an older version built."""
    stale = np.zeros(len(record["response_token_ids"]), dtype=bool)
    turns = {entry["turn"] for entry in ((record.get("extra") or {}).get("kv_cache") or {}).get("stale_turns", [])}
    for segment in record.get("segments") or []:
        if segment.get("turn") in turns and segment.get("kind") == "action":
            stale[segment["start"] : segment["end"]] = True
    return stale


def kv_cache_labels(records: Sequence[dict[str, Any]], record_index: np.ndarray, position: np.ndarray) -> np.ndarray:
    """``"stale"`` or ``"fresh"`` per token (its record's index and response position)."""
    marks = [stale_cache_tokens(record) for record in records]
    return np.array(["stale" if marks[i][p] else "fresh" for i, p in zip(record_index.tolist(), position.tolist())], dtype=object)


def any_stale(records: Sequence[dict[str, Any]]) -> bool:
    return any(((r.get("extra") or {}).get("kv_cache") or {}).get("stale_turns") for r in records)
