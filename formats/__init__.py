"""Trajectory records and shards (schema version 3; ``formats/SPEC.md`` is the normative byte-level spec).

Records are plain dicts of Python values and numpy arrays (:mod:`glmpost.formats.schema`); a
record's context windows (CompactionRL's rebuilt contexts, new in version 2) are
:mod:`glmpost.formats.windows`. Shards are ``*.msgpack.zst`` files of records with a header and a
checksummed footer, written by :mod:`glmpost.formats.shards` and read by
:mod:`glmpost.formats.shard_reader` (writers write version 3, which adds ``routed_experts``; the reader also reads versions 1 and 2).
Datasets of shards (files, directories, globs) are :mod:`glmpost.formats.datasets`; the JSON form
of records is :mod:`glmpost.formats.json_form`. Prompt sources (JSONL, parquet, CSV / JSON, ``datasets``
directories) read row by row, their columns mapped, are :mod:`glmpost.formats.sources`.
"""

from glmpost.formats.datasets import iter_records, resolve_shard_paths, select_shards
from glmpost.formats.json_form import record_from_json, record_to_json
from glmpost.formats.reading import iter_checked_records, read_checked_records
from glmpost.formats.schema import (
    ARRAY_FIELDS,
    FIELDS,
    REQUIRED_FIELDS,
    REWARD_FAILURE_KEY,
    SCHEMA_VERSION,
    SEGMENT_KINDS,
    STATUSES,
    Field,
    RecordError,
    normalize_record,
    require_fields,
)
from glmpost.formats.shard_reader import Shard, ShardReader, read_shard
from glmpost.formats.shards import (
    DTYPE_CODES,
    FORMAT_NAME,
    SHARD_SUFFIX,
    ShardError,
    ShardWriter,
    write_shard,
)
from glmpost.formats.synthetic import synthetic_record
from glmpost.formats.validation import validate_record
from glmpost.formats.windows import ContextWindow, compactions, context_windows, window_inputs, window_views

__all__ = [
    "ARRAY_FIELDS",
    "DTYPE_CODES",
    "FIELDS",
    "FORMAT_NAME",
    "REQUIRED_FIELDS",
    "REWARD_FAILURE_KEY",
    "SCHEMA_VERSION",
    "SEGMENT_KINDS",
    "SHARD_SUFFIX",
    "STATUSES",
    "ContextWindow",
    "Field",
    "RecordError",
    "Shard",
    "ShardError",
    "ShardReader",
    "ShardWriter",
    "compactions",
    "context_windows",
    "window_views",
    "iter_checked_records",
    "iter_records",
    "normalize_record",
    "read_checked_records",
    "read_shard",
    "record_from_json",
    "record_to_json",
    "require_fields",
    "resolve_shard_paths",
    "select_shards",
    "synthetic_record",
    "validate_record",
    "window_inputs",
    "write_shard",
]
