"""The JSON form of records (``formats/SPEC.md`` §10; ``glmpost shards cat``, ``glmpost shards import``).

Schema arrays become (nested) lists and schema floats plain numbers, NaN as null; so does a
segment's ``context`` (int32 ids, schema version 2), which comes back as int32. Inside free-form
maps (task, sampling, extra, and segments' other keys), values JSON cannot hold exactly are tagged:
{"$array": {"dtype", "shape", "data"}} (flat data, NaN as null), {"$float": "nan"|"inf"|"-inf"},
{"$bytes": base64}. Single-key maps with these keys are therefore reserved.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from glmpost.formats.schema import FIELDS, RecordError, normalize_record
from glmpost.formats.validation import validate_record
from glmpost.formats.windows import CONTEXT_KEY


def record_to_json(record: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-safe form of a record (``json.dumps(..., allow_nan=False)`` accepts it)."""
    out: dict[str, Any] = {}
    for name, value in record.items():
        spec = FIELDS.get(name)
        if spec is not None and spec.kind == "array" and value.dtype in spec.also:
            out[name] = _tag(value)  # a tagged $array keeps the narrower dtype (routed_experts in uint8)
        elif spec is not None and spec.kind == "array":
            out[name] = _nan_to_none(value.tolist()) if value.dtype.kind == "f" else value.tolist()
        elif name == "reward":
            out[name] = None if math.isnan(value) else value
        elif name == "rewards":
            out[name] = {k: None if math.isnan(v) else v for k, v in value.items()}
        elif name == "segments":
            out[name] = [_segment_to_json(seg) for seg in value]
        else:
            out[name] = _tag(value)
    return out


def _segment_to_json(segment: Any) -> Any:
    """A segment's ``context`` is a list of ids like a schema array (``record_from_json`` makes it
    int32 again, as it does a tagged ``$array``); its other keys are tagged like free-form values."""
    if not isinstance(segment, dict):
        return _tag(segment)
    return {k: v.tolist() if k == CONTEXT_KEY and isinstance(v, np.ndarray) else _tag(v) for k, v in segment.items()}


def record_from_json(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`record_to_json`: a normalised, validated record (raises :class:`RecordError`)."""
    if not isinstance(obj, Mapping):
        raise RecordError(f"a record must be a JSON object, got {type(obj).__name__}")
    out: dict[str, Any] = {}
    for name, value in obj.items():
        spec = FIELDS.get(name)
        if spec is not None and spec.kind == "array" and isinstance(value, list):
            out[name] = _json_array(name, value, spec.dtype, len(spec.shape))
        elif name == "reward" and value is None:
            out[name] = math.nan
        elif name == "rewards" and isinstance(value, Mapping):
            out[name] = {k: math.nan if v is None else v for k, v in value.items()}
        else:
            try:
                out[name] = _untag(value)
            except (KeyError, TypeError, ValueError) as exc:
                raise RecordError(f"field '{name}': malformed tagged value ({exc})") from None
    record = normalize_record(out)
    validate_record(record)
    return record


def _json_array(name: str, value: list, dtype: np.dtype, ndim: int) -> np.ndarray:
    if dtype.kind != "f" and _contains_none(value):
        raise RecordError(f"field '{name}': null in a {dtype} array")
    try:
        arr = np.array(value, dtype=np.float64 if dtype.kind == "f" else None)
    except (TypeError, ValueError) as exc:
        raise RecordError(f"field '{name}': not a numeric array ({exc})") from None
    if arr.size == 0:
        arr = arr.reshape((0,) * ndim)  # [] carries no top-k width
    return arr


def _contains_none(value: Any) -> bool:
    return value is None or (isinstance(value, list) and any(_contains_none(v) for v in value))


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    return None if value != value else value


def _tag(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _tag(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_tag(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, np.ndarray):
        data = value.ravel().tolist()
        return {
            "$array": {
                "dtype": value.dtype.name,
                "shape": list(value.shape),
                "data": _nan_to_none(data) if value.dtype.kind == "f" else data,
            }
        }
    return value


def _untag(value: Any) -> Any:
    if isinstance(value, list):
        return [_untag(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (key, inner), = value.items()
        if key == "$float":
            return float(inner)
        if key == "$bytes":
            return base64.b64decode(inner)
        if key == "$array":
            dtype = np.dtype(inner["dtype"])
            data = [math.nan if v is None else v for v in inner["data"]]
            return np.array(data, dtype=dtype).reshape(inner["shape"])
    return {k: _untag(v) for k, v in value.items()}
