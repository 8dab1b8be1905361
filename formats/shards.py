"""Trajectory shards: ``*.msgpack.zst`` files (the bytes are fixed by ``formats/SPEC.md``).

One zstd frame holding a stream of msgpack objects::

    header  {"format": "glmpost-trajectories", "schema_version": 3, "stage", "options",
             "tokenizer_revision", "created", "glmpost_version"}
    record  (one msgpack map per trajectory, numeric arrays as ExtType 1)
    ...
    footer  {"footer": true, "records": N, "checksum": "crc32:%08x"}

The checksum is ``zlib.crc32`` over the concatenated uncompressed bytes of the record objects.
Writers always write the newest schema version (:data:`~glmpost.formats.schema.SCHEMA_VERSION`);
the reader also reads version 1.
Writers stream (memory does not grow with the shard) and publish atomically (temporary name, fsync,
rename, fsync of the directory); readers stream and refuse anything short of a complete, valid
shard with a one-line :class:`ShardError` naming the file and the record.

This module holds the format's constants, :class:`ShardError`, the ExtType 1 array codec (SPEC.md
§4), the msgpack packing shared by writer and reader, and the writer (:class:`ShardWriter`,
:func:`write_shard`). The reader is :mod:`glmpost.formats.shard_reader`; resolving files,
directories and globs to shards is :mod:`glmpost.formats.datasets`; the JSON form of records is
:mod:`glmpost.formats.json_form`.
"""

from __future__ import annotations

import os
import struct
import sys
import zlib
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zstandard

from glmpost import __version__
from glmpost.errors import GlmpostError
from glmpost.formats.schema import (
    SCHEMA_VERSION,
    RecordError,
    normalize_record,
    to_free_form,
)
from glmpost.formats.validation import validate_record
from glmpost.fsutil import fsync_dir

FORMAT_NAME = "glmpost-trajectories"
SHARD_SUFFIX = ".msgpack.zst"
HEADER_KEYS = {"stage": str, "options": dict, "tokenizer_revision": str, "created": str, "glmpost_version": str}
ARRAY_EXT_CODE = 1
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

# ExtType 1 dtype codes (SPEC.md §4). Data is always little-endian, C order.
DTYPE_CODES: dict[int, np.dtype] = {
    code: np.dtype(name).newbyteorder("<")
    for code, name in {
        0: "bool",
        1: "int8",
        2: "uint8",
        3: "int16",
        4: "uint16",
        5: "int32",
        6: "uint32",
        7: "int64",
        8: "uint64",
        9: "float16",
        10: "float32",
        11: "float64",
    }.items()
}
_NATIVE: dict[int, np.dtype] = {code: dtype.newbyteorder("=") for code, dtype in DTYPE_CODES.items()}
_CODE_OF: dict[str, int] = {dtype.str.lstrip("<>|="): code for code, dtype in DTYPE_CODES.items()}


class ShardError(GlmpostError):
    """A shard cannot be read or written; the message is one line: ``FILE[: record I]: REASON``."""

    def __init__(self, path: Path | str, reason: str, index: int | None = None, record_id: Any = None):
        self.path, self.reason, self.index = Path(path), " ".join(str(reason).split()), index
        where = str(path)
        if index is not None:
            where += f": record {index}" + (f" (id {record_id!r})" if isinstance(record_id, str) else "")
        super().__init__(f"{where}: {self.reason}")


# --------------------------------------------------------------------------------------------
# ExtType 1: numeric arrays


def encode_array(arr: np.ndarray) -> msgpack.ExtType:
    """``code(u8) ndim(u8) dims(ndim x u32 LE) data(LE, C order)`` as ExtType 1."""
    code = _CODE_OF.get(arr.dtype.str.lstrip("<>|="))
    if code is None:
        raise RecordError(f"arrays of dtype {arr.dtype} cannot be stored")
    if arr.ndim > 255 or any(d >= 2**32 for d in arr.shape):
        raise RecordError(f"array of shape {arr.shape} is too large to store")
    head = struct.pack(f"<BB{arr.ndim}I", code, arr.ndim, *arr.shape)
    return msgpack.ExtType(ARRAY_EXT_CODE, head + arr.astype(DTYPE_CODES[code], copy=False).tobytes())


class BadExtension(ValueError):
    pass


def decode_ext(code: int, payload: bytes) -> np.ndarray:
    """Inverse of :func:`encode_array`: a writable, aligned numpy array (a copy of the payload)."""
    if code != ARRAY_EXT_CODE:
        raise BadExtension(f"unknown msgpack ExtType code {code}")
    if len(payload) < 2 or payload[0] not in DTYPE_CODES:
        raise BadExtension("array with an unknown dtype code")
    dtype, ndim = DTYPE_CODES[payload[0]], payload[1]
    try:
        shape = struct.unpack_from(f"<{ndim}I", payload, 2)
        arr = np.frombuffer(payload, dtype, offset=2 + 4 * ndim).reshape(shape)
    except (struct.error, ValueError):
        raise BadExtension("array payload size does not match its shape") from None
    return arr.astype(_NATIVE[payload[0]])  # a native-order, aligned, writable copy


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return encode_array(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot store a value of type {type(obj).__name__}")


def _packer() -> msgpack.Packer:
    return msgpack.Packer(default=_pack_default, use_bin_type=True, autoreset=True)


def record_unpacker() -> msgpack.Unpacker:
    # max_buffer_size=0 means the 4 GiB maximum; one record is one object, so this bounds a record.
    return msgpack.Unpacker(ext_hook=decode_ext, raw=False, max_buffer_size=0, strict_map_key=True)


def checksum_text(crc: int) -> str:
    return f"crc32:{crc:08x}"


# --------------------------------------------------------------------------------------------
# Writer


class ShardWriter:
    """Write one shard: ``with ShardWriter(path, stage=..., tokenizer_revision=...) as w: w.write(rec)``.

    Each record is normalised and validated (:func:`normalize_record`, :func:`validate_record`) and
    must carry the shard's ``tokenizer_revision``. Records stream through zstd (``level``, default 3),
    so memory does not depend on the shard size. The file is built at ``.NAME.tmp-PID`` beside
    ``path``; :meth:`close` writes the footer, fsyncs, renames it to ``path`` and fsyncs the
    directory. If the ``with`` block raises, the temporary file is removed and ``path`` is untouched.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        stage: str,
        options: Mapping[str, Any] | None = None,
        tokenizer_revision: str,
        level: int = 3,
    ):
        self.path = Path(path)
        self.tokenizer_revision = tokenizer_revision
        self.records = 0
        self._crc = 0
        self._closed = False
        self._tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.header = self._make_header(stage, options or {}, tokenizer_revision)
        self._packer = _packer()
        try:
            self._file = open(self._tmp, "wb")
        except OSError as exc:
            raise ShardError(self.path, f"cannot write: {exc.strerror}") from None
        try:
            compressor = zstandard.ZstdCompressor(level=level, write_checksum=True)
            self._zstd = compressor.stream_writer(self._file, closefd=False)
            self._zstd.write(self._packer.pack(self.header))
        except BaseException:
            self.abort()
            raise

    def _make_header(self, stage: str, options: Mapping[str, Any], tokenizer_revision: str) -> dict[str, Any]:
        if not isinstance(stage, str) or not stage:
            raise ShardError(self.path, "stage must be a non-empty string")
        if not isinstance(tokenizer_revision, str) or not tokenizer_revision:
            raise ShardError(self.path, "tokenizer_revision must be a non-empty string")
        try:
            options = to_free_form(dict(options), "options")
        except RecordError as exc:
            raise ShardError(self.path, f"header {exc}") from None
        return {
            "format": FORMAT_NAME,
            "schema_version": SCHEMA_VERSION,
            "stage": stage,
            "options": options,
            "tokenizer_revision": tokenizer_revision,
            "created": _created(),
            "glmpost_version": __version__,
        }

    def write(self, record: Mapping[str, Any]) -> None:
        """Normalise, validate and append one record (raises :class:`RecordError` naming file and record)."""
        if self._closed:
            raise ValueError(f"{self.path}: write after close")
        try:
            record = normalize_record(record)
            validate_record(record)
            if record["tokenizer_revision"] != self.tokenizer_revision:
                raise RecordError(
                    f"tokenizer_revision {record['tokenizer_revision']!r} differs from the shard's "
                    f"{self.tokenizer_revision!r}"
                )
            data = self._packer.pack(record)
        except (TypeError, ValueError, OverflowError) as exc:  # what normalize_record let through
            raise RecordError(f"{self.path}: record {self.records}{_id_note(record)}: cannot store: {exc}") from None
        except RecordError as exc:
            raise RecordError(f"{self.path}: record {self.records}{_id_note(record)}: {exc}") from None
        self._write_record_bytes(data)

    def _write_record_bytes(self, data: bytes) -> None:
        self._crc = zlib.crc32(data, self._crc)
        self._zstd.write(data)
        self.records += 1

    def _footer(self) -> dict[str, Any]:
        return {"footer": True, "records": self.records, "checksum": checksum_text(self._crc)}

    def close(self) -> Path:
        """Write the footer and publish the shard at ``path`` (atomically); returns ``path``."""
        if self._closed:
            return self.path
        try:
            self._zstd.write(self._packer.pack(self._footer()))
            self._zstd.close()  # ends the zstd frame; closefd=False keeps our file open
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self.path)
            fsync_dir(self.path.parent)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return self.path

    def abort(self) -> None:
        """Drop the temporary file; ``path`` is left as it was."""
        self._closed = True
        try:
            self._file.close()
        except Exception:
            pass
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def remove_partial_shards(paths: Iterable[Path]) -> list[Path]:
    """Remove what writers of the shards ``paths`` left when they died (``.NAME.tmp-PID``, see
    :class:`ShardWriter`); returns what was removed. The caller holds the output's lock, so no
    live writer of these names is left."""
    removed = []
    for path in paths:
        path = Path(path)
        for partial in path.parent.glob(f".{path.name}.tmp-*"):
            partial.unlink(missing_ok=True)
            removed.append(partial)
    if removed:
        sys.stderr.write(f"glmpost: removed {len(removed)} partial shard(s) a stopped writer left: "
                         f"{', '.join(p.name for p in removed[:3])}{' ...' if len(removed) > 3 else ''}\n")
    return removed


def _created() -> str:
    """Now, or ``SOURCE_DATE_EPOCH`` when set (reproducible builds), so equal runs give equal bytes."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    moment = datetime.fromtimestamp(int(epoch), timezone.utc) if epoch and epoch.isdigit() else datetime.now(timezone.utc)
    return moment.isoformat(timespec="seconds")


def _id_note(record: Any) -> str:
    rid = record.get("id") if isinstance(record, Mapping) else None
    return f" (id {rid!r})" if isinstance(rid, str) else ""


def write_shard(
    path: str | Path,
    records: Iterable[Mapping[str, Any]],
    *,
    stage: str,
    options: Mapping[str, Any] | None = None,
    tokenizer_revision: str,
    level: int = 3,
) -> Path:
    """Write ``records`` to one shard at ``path`` (see :class:`ShardWriter`)."""
    with ShardWriter(path, stage=stage, options=options, tokenizer_revision=tokenizer_revision, level=level) as w:
        for record in records:
            w.write(record)
    return Path(path)
