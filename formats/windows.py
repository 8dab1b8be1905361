"""Context windows of a record (schema version 2, CompactionRL; formats/SPEC.md §5 "Compaction").

Brief, "CompactionRL：摘要也要为任务结果负责": when the context budget runs low the policy writes a
summary and the rollout continues in a rebuilt context ``(s) + u_resume(S_t) + (z_{t-k+1}, ..., z_t)``.
A record keeps every token the engine sampled or appended once, in ``response_token_ids``, and the
segment that opens each later window carries that window's rebuilt context as exact ids
(``context``, int32). Window 0's context is ``prompt_token_ids``.

Token ``t`` of window ``w`` (``start_w <= t < end_w``) was conditioned on exactly
``context_w + response_token_ids[start_w:t]``: that is what the trainer scores it on
(:func:`window_inputs`), so the copied tail (the last k action-observation pairs inside
``context_w``) is context there, never a trained token a second time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

CONTEXT_KEY = "context"


@dataclass(frozen=True)
class ContextWindow:
    """One context window: the ids fed before its first token and its response range ``[start, end)``."""

    index: int
    context: np.ndarray  # int32 [C_w]
    start: int
    end: int


def window_starts(segments: list[Mapping[str, Any]] | None) -> list[int]:
    """The response positions where a window after the first begins (its segment's ``start``)."""
    return [int(seg["start"]) for seg in segments or () if CONTEXT_KEY in seg]


def context_windows(record: Mapping[str, Any]) -> list[ContextWindow]:
    """The record's windows in order; a record without compaction (any schema-1 record) is one
    window: its prompt and the whole response."""
    length = len(record["response_token_ids"])
    contexts = [np.asarray(record["prompt_token_ids"], dtype=np.int32)]
    starts = [0]
    for seg in record.get("segments") or ():
        if CONTEXT_KEY in seg:
            contexts.append(np.asarray(seg[CONTEXT_KEY], dtype=np.int32))
            starts.append(int(seg["start"]))
    ends = starts[1:] + [length]
    return [ContextWindow(i, c, s, e) for i, (c, s, e) in enumerate(zip(contexts, starts, ends))]


def compactions(record: Mapping[str, Any]) -> int:
    """How many times the record's context was rebuilt (its windows less one)."""
    return len(window_starts(record.get("segments")))


def window_inputs(record: Mapping[str, Any], window: ContextWindow) -> tuple[list[int], int]:
    """``(input ids, prompt length)`` that score window ``window``'s tokens: its context, then its
    response tokens."""
    response = np.asarray(record["response_token_ids"])[window.start : window.end]
    return window.context.tolist() + response.tolist(), len(window.context)


def window_views(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The record as one single-window record per context window, for readers that score a record
    as ``prompt + response`` (diff-logprobs, score-teacher): ``prompt_token_ids`` = the window's
    context, every per-token field and the segments cut to the window (segment bounds shifted,
    ``context`` dropped); ids and the rest unchanged; ``window`` (a key outside the schema: views are
    never written) is the window's index. A record without compaction is returned as the one view."""
    windows = context_windows(record)
    if len(windows) == 1:
        return [dict(record)]
    length = len(record["response_token_ids"])
    per_token = [name for name, value in record.items()
                 if isinstance(value, np.ndarray) and value.ndim >= 1 and value.shape[0] == length
                 and name != "prompt_token_ids"]
    views = []
    for window in windows:
        view = dict(record)
        view["prompt_token_ids"] = window.context
        for name in per_token:
            view[name] = record[name][window.start : window.end]
        view["segments"] = [{**{k: v for k, v in seg.items() if k != CONTEXT_KEY}, "start": int(seg["start"]) - window.start,
                             "end": int(seg["end"]) - window.start}
                            for seg in record.get("segments") or () if window.start <= int(seg["start"]) < window.end]
        view["window"] = window.index
        views.append(view)
    return views
