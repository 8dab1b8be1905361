"""The trajectory record, schema version 3 (DESIGN.md §3; ``formats/SPEC.md`` is normative).

A record is a plain ``dict``; numeric arrays are numpy arrays of the exact dtype in :data:`FIELDS`.
``T`` = ``len(response_token_ids)``, ``P`` = ``len(prompt_token_ids)``, ``k`` = teacher top-k width.
Version 2 adds context windows (CompactionRL, :mod:`glmpost.formats.windows`): a segment after the
first may carry ``context``, the int32 ids its window was rebuilt from; version-1 records have none
and read as they are. Version 3 adds ``routed_experts`` (uint8 or uint16 ``[T, L, k]``): the MoE
experts that chose each token (issue 33; :mod:`glmpost.kernel.routing`).

- :func:`normalize_record` converts what a stage hands over (Python lists, other int/float widths,
  numpy scalars) into the exact dtypes; it runs on the write path only.
- :func:`~glmpost.formats.validation.validate_record` checks an exact record: fields, dtypes, shapes, masks, log-prob ranges,
  segments, status, reward. The reader runs it on every record without normalising first, so a
  wrong dtype inside a file is refused rather than silently converted.
- :func:`require_fields` is how a stage asks for fields a previous stage produces; its error names
  that stage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from glmpost.errors import GlmpostError
from glmpost.formats.windows import CONTEXT_KEY

SCHEMA_VERSION = 3
# The field each schema version after 1 added (a reader refuses it in an older version's shard).
ROUTING_FIELD = "routed_experts"
STATUSES = ("completed", "truncated", "aborted", "env_error")
SEGMENT_KINDS = ("action", "observation", "summary")
SEGMENT_KEYS = ("start", "end", "kind", "turn")
# Optional segment keys (schema version 2): ``context`` (windows.CONTEXT_KEY) opens a rebuilt
# context window (int32 ids); ``role`` (str) says what a segment is for, e.g. "summary_request" on
# the observation that asks for a summary.
ROLE_KEY = "role"
# When ``reward`` is NaN (the judge failed), ``reward_info[REWARD_FAILURE_KEY]`` says why.
REWARD_FAILURE_KEY = "failure"
# policy_versions of an action token whose weights' version nobody confirmed (SPEC.md §5).
UNKNOWN_VERSION = -1
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
    also: tuple[np.dtype, ...] = ()  # further dtypes an array may have (``routed_experts``: uint8 besides uint16)


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
        Field(ROUTING_FIELD, "array", ROLLOUT, False, np.dtype("uint16"), ("T", "L", "k"),
              "MoE experts that chose each token, per MoE layer; a row of the dtype's largest value = not recorded",
              also=(np.dtype("uint8"),)),
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
    if arr.dtype == want or arr.dtype in spec.also:
        return arr
    if arr.size == 0 and arr.dtype.kind in "fiub":
        return arr.astype(want)
    kind = arr.dtype.kind
    if want.kind == "b":
        if kind in "iu" and np.isin(arr, (0, 1)).all():
            return arr.astype(want)
    elif want.kind in "iu":
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
CONTEXT_FIELD = Field(CONTEXT_KEY, "array", ROLLOUT, dtype=np.dtype("int32"), shape=("C",))


def _to_segment(index: int, segment: Any) -> Any:
    if not isinstance(segment, Mapping):
        return segment
    out = to_free_form(segment, f"segments[{index}]")
    for key in ("start", "end", "turn"):
        if isinstance(out.get(key), np.integer):
            out[key] = int(out[key])
    if CONTEXT_KEY in out:
        out[CONTEXT_KEY] = _to_array(f"segments[{index}].{CONTEXT_KEY}", segment[CONTEXT_KEY], CONTEXT_FIELD)
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
