"""The trajectory record, schema version 2 (DESIGN.md §3; ``formats/SPEC.md`` is normative).

A record is a plain ``dict``; numeric arrays are numpy arrays of the exact dtype in :data:`FIELDS`.
``T`` = ``len(response_token_ids)``, ``P`` = ``len(prompt_token_ids)``, ``k`` = teacher top-k width.
Version 2 adds context windows (CompactionRL, :mod:`glmpost.formats.windows`): a segment after the
first may carry ``context``, the int32 ids its window was rebuilt from; version-1 records have none
and read as they are.

- :func:`normalize_record` converts what a stage hands over (Python lists, other int/float widths,
  numpy scalars) into the exact dtypes; it runs on the write path only.
- :func:`validate_record` checks an exact record: fields, dtypes, shapes, masks, log-prob ranges,
  segments, status, reward. The reader runs it on every record without normalising first, so a
  wrong dtype inside a file is refused rather than silently converted.
- :func:`require_fields` is how a stage asks for fields a previous stage produces; its error names
  that stage.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from glmpost.errors import GlmpostError
from glmpost.formats.windows import CONTEXT_KEY

SCHEMA_VERSION = 2
STATUSES = ("completed", "truncated", "aborted", "env_error")
SEGMENT_KINDS = ("action", "observation", "summary")
SEGMENT_KEYS = ("start", "end", "kind", "turn")
# Optional segment keys (schema version 2): ``context`` (windows.CONTEXT_KEY) opens a rebuilt
# context window (int32 ids); ``role`` (str) says what a segment is for, e.g. "summary_request" on
# the observation that asks for a summary.
ROLE_KEY = "role"
# When ``reward`` is NaN (the judge failed), ``reward_info[REWARD_FAILURE_KEY]`` says why.
REWARD_FAILURE_KEY = "failure"
# Log-probs may exceed 0 by this much (float32 rounding of log-softmax near probability 1).
LOG_PROB_TOLERANCE = 1e-4
EXTRA = "extra"


class RecordError(GlmpostError):
    """A record breaks the schema; the message is one line naming the field."""


@dataclass(frozen=True)
class Field:
    """One top-level record field.

    ``kind`` is ``str``, ``map``, ``float``, ``segments`` or ``array``; arrays have a ``dtype`` and a
    ``shape`` of symbolic dims (``P``, ``T``, ``k``). ``producer`` is the stage that adds the field.
    """

    name: str
    kind: str
    producer: str
    required: bool = False
    dtype: np.dtype | None = None
    shape: tuple[str, ...] = ()
    doc: str = ""


def _array(name: str, dtype: str, shape: tuple[str, ...], producer: str, required: bool, doc: str) -> Field:
    return Field(name, "array", producer, required, np.dtype(dtype), shape, doc)


ROLLOUT, JUDGE, TEACHER, PROMPT_DATA = "rollout", "judge", "score-teacher", "prompt data"

FIELDS: dict[str, Field] = {
    f.name: f
    for f in [
        Field("id", "str", ROLLOUT, True, doc="unique trajectory id"),
        Field("prompt_id", "str", ROLLOUT, True, doc="the prompt this trajectory answers"),
        Field("group_id", "str", ROLLOUT, True, doc="sampling group; GRPO's G siblings share it"),
        Field("domain", "str", PROMPT_DATA, doc="routes to a teacher (MOPD) and a verifier"),
        Field("task", "map", PROMPT_DATA, doc="what the verifier needs: reference answer, tests, rubric"),
        _array("prompt_token_ids", "int32", ("P",), ROLLOUT, True, "exactly what the engine was fed"),
        _array("response_token_ids", "int32", ("T",), ROLLOUT, True, "exact ids after the prompt"),
        _array("action_mask", "bool", ("T",), ROLLOUT, True, "1 = sampled by the policy"),
        _array("observation_mask", "bool", ("T",), ROLLOUT, True, "1 = tool / environment / copied context"),
        _array("rollout_log_probs", "float32", ("T",), ROLLOUT, False, "sampling log-prob; NaN off actions"),
        _array("policy_versions", "int32", ("T",), ROLLOUT, False, "policy version per token"),
        Field("sampling", "map", ROLLOUT, doc="temperature, top_p, top_k, seed, max_new_tokens, engine, log_prob_kind"),
        Field("tokenizer_revision", "str", ROLLOUT, True, doc="digest of tokenizer files and chat template"),
        Field("segments", "segments", ROLLOUT, doc="[{start, end, kind, turn[, context, role]}], in order, non-overlapping"),
        Field("status", "str", ROLLOUT, True, doc="one of " + ", ".join(STATUSES)),
        Field("rewards", "map", JUDGE, doc="reward components, str -> float"),
        Field("reward", "float", JUDGE, doc="scalarised reward; NaN = judge failed"),
        Field("reward_info", "map", JUDGE, doc="failure reasons and judge details"),
        _array("teacher_log_probs", "float32", ("T",), TEACHER, False, "teacher log-prob of each sampled token"),
        _array("teacher_topk_ids", "int32", ("T", "k"), TEACHER, False, "teacher top-k token ids"),
        _array("teacher_topk_log_probs", "float32", ("T", "k"), TEACHER, False, "teacher top-k log-probs"),
        Field("teacher", "map", TEACHER, doc="teacher id, checkpoint revision, payload kind"),
        Field(EXTRA, "map", "any stage", doc="free-form additions; unknown top-level keys are refused"),
    ]
}
REQUIRED_FIELDS = tuple(name for name, f in FIELDS.items() if f.required)
ARRAY_FIELDS = tuple(name for name, f in FIELDS.items() if f.kind == "array")
LOG_PROB_FIELDS = ("rollout_log_probs", "teacher_log_probs")


# --------------------------------------------------------------------------------------------
# require_fields: a stage asks for what an earlier stage produces


def _how_to_get(field: str) -> str:
    producer = FIELDS[field].producer
    if producer == PROMPT_DATA:
        return "it comes from the prompt data given to `glmpost rollout`"
    if producer == "any stage":
        return "no stage added it"
    return f"run `glmpost {producer}` first"


def require_fields(record: Mapping[str, Any], fields: Iterable[str], *, where: str) -> None:
    """Raise :class:`RecordError` naming the producing stage when ``record`` lacks one of ``fields``.

    ``where`` names the caller (a stage and/or a file), e.g. ``"train-grpo: data/shard-0.msgpack.zst"``;
    the message reads ``"<where>: record 'r1' has no rewards: run `glmpost judge` first"``.
    """
    for field in fields:
        if field not in FIELDS:
            raise ValueError(f"require_fields: {field!r} is not a schema field")
        if field not in record:
            raise RecordError(f"{where}: record {record.get('id')!r} has no {field}: {_how_to_get(field)}")


# --------------------------------------------------------------------------------------------
# normalize_record: the write path's conversion to exact dtypes


def normalize_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """A new record with schema fields converted to their exact types.

    Lists/tuples and numpy arrays of other integer or float widths become the schema dtype (integer
    values must fit int32; bool fields accept 0/1 integers); numpy scalars and strings become Python
    ones; ``reward`` and ``rewards`` values become ``float``; segment bounds become ``int`` and a
    segment's ``context`` an int32 array. Anything that cannot be converted without changing its
    meaning raises :class:`RecordError`. The input is not modified. Call :func:`validate_record` on
    the result.
    """
    if not isinstance(record, Mapping):
        raise RecordError(f"a record must be a map, got {type(record).__name__}")
    out: dict[str, Any] = {}
    for name, value in record.items():
        spec = FIELDS.get(name)
        if spec is None:
            out[name] = value  # validate_record names the unknown key
        elif spec.kind == "array":
            out[name] = _to_array(name, value, spec)
        elif spec.kind == "str" and isinstance(value, np.str_):
            out[name] = str(value)
        elif spec.kind == "float":
            out[name] = _to_float(name, value)
        elif name == "rewards" and isinstance(value, Mapping):
            out[name] = {k: _to_float(f"rewards[{k!r}]", v) for k, v in value.items()}
        elif spec.kind == "segments" and isinstance(value, (list, tuple)):
            out[name] = [_to_segment(i, s) for i, s in enumerate(value)]
        elif spec.kind == "map" and isinstance(value, Mapping):
            out[name] = to_free_form(value, name)
        else:
            out[name] = value
    return out


def _to_array(name: str, value: Any, spec: Field) -> np.ndarray:
    """``value`` as an array of ``spec.dtype``, converted only where no value changes."""
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise RecordError(f"field '{name}': cannot convert to an array ({exc})") from None
    want = spec.dtype
    if arr.dtype == want:
        return arr
    if arr.size == 0 and arr.dtype.kind in "fiub":
        return arr.astype(want)
    kind = arr.dtype.kind
    if want.kind == "b":
        if kind in "iu" and np.isin(arr, (0, 1)).all():
            return arr.astype(want)
    elif want.kind == "i":
        if kind in "iu":
            info = np.iinfo(want)
            if arr.min() >= info.min and arr.max() <= info.max:
                return arr.astype(want)
            raise RecordError(f"field '{name}': values outside the {want} range")
    elif want.kind == "f":
        if kind in "fiu":
            return arr.astype(want)
    raise RecordError(f"field '{name}': dtype {arr.dtype} cannot be converted to {want}")


def _to_float(name: str, value: Any) -> Any:
    if isinstance(value, (bool, np.bool_)):
        raise RecordError(f"field '{name}': must be a number, got a bool")
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    return value


# A segment's ``context``: converted like a schema array field on the write path.
_CONTEXT = Field(CONTEXT_KEY, "array", ROLLOUT, dtype=np.dtype("int32"), shape=("C",))


def _to_segment(index: int, segment: Any) -> Any:
    if not isinstance(segment, Mapping):
        return segment
    out = to_free_form(segment, f"segments[{index}]")
    for key in ("start", "end", "turn"):
        if isinstance(out.get(key), np.integer):
            out[key] = int(out[key])
    if CONTEXT_KEY in out:
        out[CONTEXT_KEY] = _to_array(f"segments[{index}].{CONTEXT_KEY}", segment[CONTEXT_KEY], _CONTEXT)
    return out


_SCALARS = (type(None), bool, int, float, str, bytes)


def to_free_form(value: Any, where: str) -> Any:
    """Free-form maps (task, sampling, extra, ...) hold msgpack-able values with ``str`` keys."""
    if isinstance(value, _SCALARS):
        if isinstance(value, int) and not -(2**63) <= value < 2**64:
            raise RecordError(f"{where}: integer {value} does not fit 64 bits")
        return value
    if isinstance(value, np.generic):
        return to_free_form(value.item(), where)
    if isinstance(value, np.ndarray):
        if value.dtype.str.lstrip("<>|=") not in _FREE_FORM_DTYPES:
            raise RecordError(f"{where}: arrays of dtype {value.dtype} cannot be stored")
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise RecordError(f"{where}: map key {key!r} is not a string")
            out[key] = to_free_form(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [to_free_form(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise RecordError(f"{where}: values of type {type(value).__name__} cannot be stored")


# Kept in sync with the dtype table in shards.py (checked by a test); listed here so that the schema
# does not import the codec.
_FREE_FORM_DTYPES = ("b1", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8")


# --------------------------------------------------------------------------------------------
# validate_record: exact checks, shared by writer and reader


def validate_record(record: Mapping[str, Any]) -> None:
    """Raise :class:`RecordError` unless ``record`` is an exact schema-v2 record (see SPEC.md §6); a
    version-1 record (no ``context`` segments) is one too."""
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
        if value.dtype != spec.dtype:
            raise RecordError(f"field '{name}': dtype {value.dtype}, expected {spec.dtype}")
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
    if context.dtype != _CONTEXT.dtype:
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
