"""Exact checks of a trajectory record (:func:`validate_record`), shared by the shard writer and the
reader: fields, dtypes, shapes, masks, log-prob ranges, segments, status, reward (``formats/SPEC.md``
§6; the fields are :data:`glmpost.formats.schema.FIELDS`)."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from glmpost.formats.schema import (
    ARRAY_FIELDS,
    CONTEXT_FIELD,
    FIELDS,
    LOG_PROB_FIELDS,
    LOG_PROB_TOLERANCE,
    REQUIRED_FIELDS,
    REWARD_FAILURE_KEY,
    ROLE_KEY,
    ROUTING_FIELD,
    SEGMENT_KEYS,
    SEGMENT_KINDS,
    STATUSES,
    Field,
    RecordError,
)
from glmpost.formats.windows import CONTEXT_KEY

# --------------------------------------------------------------------------------------------
# validate_record: exact checks, shared by writer and reader


def validate_record(record: Mapping[str, Any]) -> None:
    """Raise :class:`RecordError` unless ``record`` is an exact schema-v3 record (see SPEC.md §6); a
    version-1 or version-2 record (no ``context`` segments, no ``routed_experts``) is one too."""
    if not isinstance(record, Mapping):
        raise RecordError(f"a record must be a map, got {type(record).__name__}")
    _check_keys(record)
    for name, value in record.items():
        _check_type(name, value, FIELDS[name])
    T = len(record["response_token_ids"])
    _check_shapes(record, T)
    _check_token_ids(record)
    action = record["action_mask"]
    if (action & record["observation_mask"]).any():
        first = int(np.flatnonzero(action & record["observation_mask"])[0])
        raise RecordError(f"action_mask and observation_mask are both set on token {first}")
    for name in LOG_PROB_FIELDS:
        if name in record:
            _check_log_probs(name, record[name], action)
    if "teacher_topk_log_probs" in record:
        _check_topk_log_probs(record["teacher_topk_log_probs"])
    if ROUTING_FIELD in record:
        _check_routing(record[ROUTING_FIELD])
    if "segments" in record:
        _check_segments(record["segments"], T, action)
    if record["status"] not in STATUSES:
        raise RecordError(f"status {record['status']!r} is not one of {', '.join(STATUSES)}")
    _check_reward(record)


def _check_keys(record: Mapping[str, Any]) -> None:
    for name in record:
        if name not in FIELDS:
            close = difflib.get_close_matches(str(name), FIELDS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise RecordError(f"unknown field {name!r}{hint}; free-form additions go under 'extra'")
    for name in REQUIRED_FIELDS:
        if name not in record:
            raise RecordError(f"missing required field '{name}'")


_PY_TYPES = {"str": str, "map": dict, "segments": list, "float": float}


def _check_type(name: str, value: Any, spec: Field) -> None:
    if spec.kind == "array":
        if not isinstance(value, np.ndarray):
            raise RecordError(f"field '{name}': expected a {spec.dtype} array, got {type(value).__name__}")
        if value.dtype != spec.dtype and value.dtype not in spec.also:
            expected = " or ".join(str(d) for d in (spec.dtype, *spec.also))
            raise RecordError(f"field '{name}': dtype {value.dtype}, expected {expected}")
        if value.ndim != len(spec.shape):
            raise RecordError(f"field '{name}': {value.ndim}-D, expected shape [{','.join(spec.shape)}]")
        return
    want = _PY_TYPES[spec.kind]
    if not isinstance(value, want) or isinstance(value, bool):
        raise RecordError(f"field '{name}': expected {want.__name__}, got {type(value).__name__}")
    if spec.kind == "str" and spec.required and not value:
        raise RecordError(f"field '{name}': must not be empty")


def _check_shapes(record: Mapping[str, Any], T: int) -> None:
    k = None
    for name in ARRAY_FIELDS:
        value = record.get(name)
        if value is None or FIELDS[name].shape[0] != "T":
            continue
        if value.shape[0] != T:
            raise RecordError(f"field '{name}': length {value.shape[0]}, expected T={T} (len of response_token_ids)")
        if value.ndim == 2:
            if k is not None and value.shape[1] != k:
                raise RecordError(f"field '{name}': top-k width {value.shape[1]}, expected k={k}")
            k = value.shape[1]
    if ("teacher_topk_ids" in record) != ("teacher_topk_log_probs" in record):
        raise RecordError("teacher_topk_ids and teacher_topk_log_probs must be present together")


def _check_token_ids(record: Mapping[str, Any]) -> None:
    for name in ("prompt_token_ids", "response_token_ids", "teacher_topk_ids"):
        value = record.get(name)
        if value is not None and value.size and value.min() < 0:
            raise RecordError(f"field '{name}': negative token id {int(value.min())}")


def _check_log_probs(name: str, values: np.ndarray, action: np.ndarray) -> None:
    """NaN is allowed only off actions; everything else is a finite log-prob (<= 0, with tolerance)."""
    nan_on_action = np.isnan(values) & action
    if nan_on_action.any():
        raise RecordError(f"field '{name}': NaN on action token {int(np.flatnonzero(nan_on_action)[0])}")
    if values.size == 0:
        return
    # fmax/fmin skip NaN: the extremes of the non-NaN values (NaN when every value is NaN).
    high, low = np.fmax.reduce(values), np.fmin.reduce(values)
    if np.isnan(high) or (high <= LOG_PROB_TOLERANCE and np.isfinite(low)):
        return
    invalid = ~np.isnan(values) & ~(np.isfinite(values) & (values <= LOG_PROB_TOLERANCE))
    index = int(np.flatnonzero(invalid)[0])
    raise RecordError(f"field '{name}': token {index} has {float(values[index])}, not a log-prob (<= 0)")


def _check_topk_log_probs(values: np.ndarray) -> None:
    ok = np.isnan(values) | (np.isfinite(values) & (values <= LOG_PROB_TOLERANCE))
    if not ok.all():
        t, j = np.argwhere(~ok)[0]
        raise RecordError(
            f"field 'teacher_topk_log_probs': [{t},{j}] has {float(values[t, j])}, not a log-prob (<= 0)"
        )


def _check_routing(routed: np.ndarray) -> None:
    """A row (token) of ``routed_experts`` whose every entry is the dtype's largest value was not
    recorded; every other row lists ``k`` distinct ids per layer (SPEC.md §6 rule 11)."""
    recorded = ~(routed == np.iinfo(routed.dtype).max).all(axis=(1, 2))
    repeats = np.zeros(len(routed), dtype=bool)
    repeats[recorded] = (np.diff(np.sort(routed[recorded], axis=-1), axis=-1) == 0).any(axis=(1, 2))
    if repeats.any():
        raise RecordError(f"field '{ROUTING_FIELD}': token {int(np.flatnonzero(repeats)[0])} lists one expert twice in a layer")


def _check_segments(segments: list, T: int, action: np.ndarray) -> None:
    previous_end = 0
    for i, seg in enumerate(segments):
        if not isinstance(seg, dict):
            raise RecordError(f"segments[{i}]: expected a map, got {type(seg).__name__}")
        for key in SEGMENT_KEYS:
            if key not in seg:
                raise RecordError(f"segments[{i}]: missing '{key}'")
        start, end, turn = seg["start"], seg["end"], seg["turn"]
        if not (type(start) is int and type(end) is int and type(turn) is int):  # bool is not allowed
            raise RecordError(f"segments[{i}]: start, end and turn must be integers")
        if seg["kind"] not in SEGMENT_KINDS:
            raise RecordError(f"segments[{i}]: kind {seg['kind']!r} is not one of {', '.join(SEGMENT_KINDS)}")
        if not 0 <= start <= end <= T:
            raise RecordError(f"segments[{i}]: [{start}, {end}) is not within [0, T={T}]")
        if start < previous_end:
            raise RecordError(f"segments[{i}]: starts at {start}, before the previous segment ends ({previous_end})")
        previous_end = end
        if CONTEXT_KEY in seg:
            _check_context(i, seg[CONTEXT_KEY])
        if ROLE_KEY in seg and not isinstance(seg[ROLE_KEY], str):
            raise RecordError(f"segments[{i}].{ROLE_KEY}: expected str, got {type(seg[ROLE_KEY]).__name__}")
        if seg["kind"] == "summary" and not action[start:end].all():
            token = start + int(np.flatnonzero(~action[start:end])[0])
            raise RecordError(f"segments[{i}]: kind 'summary' but token {token} has action_mask 0 (a summary is the policy's)")


def _check_context(index: int, context: Any) -> None:
    """A window's rebuilt context: a non-empty int32 [C] array of token ids, never on segment 0."""
    where = f"segments[{index}].{CONTEXT_KEY}"
    if index == 0:
        raise RecordError(f"{where}: the first segment cannot open a window (window 0's context is prompt_token_ids)")
    if not isinstance(context, np.ndarray):
        raise RecordError(f"{where}: expected a int32 array, got {type(context).__name__}")
    if context.dtype != CONTEXT_FIELD.dtype:
        raise RecordError(f"{where}: dtype {context.dtype}, expected int32")
    if context.ndim != 1:
        raise RecordError(f"{where}: {context.ndim}-D, expected shape [C]")
    if context.size == 0:
        raise RecordError(f"{where}: empty (a window's context holds at least one token)")
    if context.min() < 0:
        raise RecordError(f"{where}: negative token id {int(context.min())}")


def _check_reward(record: Mapping[str, Any]) -> None:
    for key, value in record.get("rewards", {}).items():
        if not isinstance(key, str) or not isinstance(value, float):
            raise RecordError(f"field 'rewards': {key!r} -> {value!r} is not str -> float")
        if math.isinf(value):
            raise RecordError(f"field 'rewards': {key!r} is infinite")
    if "reward" not in record:
        return
    reward = record["reward"]
    if math.isinf(reward):
        raise RecordError("field 'reward': infinite (use NaN with reward_info['failure'] for a failed judgement)")
    if math.isnan(reward) and not record.get("reward_info", {}).get(REWARD_FAILURE_KEY):
        raise RecordError(f"field 'reward': NaN without reward_info['{REWARD_FAILURE_KEY}'] saying why")
