"""Trajectory shards: ``*.msgpack.zst`` files (the bytes are fixed by ``formats/SPEC.md``).

One zstd frame holding a stream of msgpack objects::

    header  {"format": "glmpost-trajectories", "schema_version": 1, "stage", "options",
             "tokenizer_revision", "created", "glmpost_version"}
    record  (one msgpack map per trajectory, numeric arrays as ExtType 1)
    ...
    footer  {"footer": true, "records": N, "checksum": "crc32:%08x"}

The checksum is ``zlib.crc32`` over the concatenated uncompressed bytes of the record objects.
Writers stream (memory does not grow with the shard) and publish atomically (temporary name, fsync,
rename, fsync of the directory); readers stream and refuse anything short of a complete, valid
shard with a one-line :class:`ShardError` naming the file and the record.
"""

from __future__ import annotations

import base64
import glob
import math
import os
import struct
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import numpy as np
import zstandard

from glmpost import __version__
from glmpost.errors import GlmpostError, UsageError
from glmpost.formats.schema import (
    FIELDS,
    SCHEMA_VERSION,
    RecordError,
    _to_free_form,
    normalize_record,
    validate_record,
)
from glmpost.fsutil import fsync_dir

FORMAT_NAME = "glmpost-trajectories"
SHARD_SUFFIX = ".msgpack.zst"
HEADER_KEYS = {"stage": str, "options": dict, "tokenizer_revision": str, "created": str, "glmpost_version": str}
ARRAY_EXT_CODE = 1
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_READ_CHUNK = 1 << 18
_MAX_HEADER = 64 << 20

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


class _BadExt(ValueError):
    pass


def decode_ext(code: int, payload: bytes) -> np.ndarray:
    """Inverse of :func:`encode_array`: a writable, aligned numpy array (a copy of the payload)."""
    if code != ARRAY_EXT_CODE:
        raise _BadExt(f"unknown msgpack ExtType code {code}")
    if len(payload) < 2 or payload[0] not in DTYPE_CODES:
        raise _BadExt("array with an unknown dtype code")
    dtype, ndim = DTYPE_CODES[payload[0]], payload[1]
    try:
        shape = struct.unpack_from(f"<{ndim}I", payload, 2)
        arr = np.frombuffer(payload, dtype, offset=2 + 4 * ndim).reshape(shape)
    except (struct.error, ValueError):
        raise _BadExt("array payload size does not match its shape") from None
    return arr.astype(_NATIVE[payload[0]])  # a native-order, aligned, writable copy


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return encode_array(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot store a value of type {type(obj).__name__}")


def _packer() -> msgpack.Packer:
    return msgpack.Packer(default=_pack_default, use_bin_type=True, autoreset=True)


def _unpacker() -> msgpack.Unpacker:
    # max_buffer_size=0 means the 4 GiB maximum; one record is one object, so this bounds a record.
    return msgpack.Unpacker(ext_hook=decode_ext, raw=False, max_buffer_size=0, strict_map_key=True)


def _checksum(crc: int) -> str:
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
            options = _to_free_form(dict(options), "options")
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
        return {"footer": True, "records": self.records, "checksum": _checksum(self._crc)}

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


# --------------------------------------------------------------------------------------------
# Reader


class _ObjectStream:
    """The msgpack objects of one zstd-framed file, streamed in chunks; also the records' checksum.

    The checksum covers the bytes of every object after the first (the header) up to the start of
    the object last yielded (the footer, when the reader stops there). It is computed in bulk once
    per decompressed chunk rather than once per object: when the consumer asks for the next object
    and the chunk is used up, every object yielded so far after the header is a record.
    """

    def __init__(self, path: Path):
        self.path = path
        self.frame_complete = False
        self.trailing_bytes = 0
        self._file = open(path, "rb")
        self._decompressor = zstandard.ZstdDecompressor().decompressobj()
        self._unpacker = _unpacker()
        self._buffer = bytearray()  # uncompressed bytes from offset _buffer_start, not yet checksummed
        self._buffer_start = 0
        self._crc = 0
        self._crc_from: int | None = None  # where checksummed bytes start: the end of the header
        self._last_start = 0  # offsets of the object last yielded
        self._end = 0

    def close(self) -> None:
        self._file.close()

    def __iter__(self) -> Iterator[Any]:
        while True:
            for obj in self._unpacker:
                self._last_start, self._end = self._end, self._unpacker.tell()
                if self._crc_from is None:
                    self._crc_from = self._end
                yield obj
            self._checksum_until(self._end)
            if not self._feed():
                return

    def records_checksum(self) -> int:
        """CRC-32 of the bytes between the end of the header and the start of the last object."""
        self._checksum_until(self._last_start)
        return self._crc

    @property
    def leftover(self) -> int:
        """Uncompressed bytes fed after the end of the last object yielded (a partial object)."""
        return self._buffer_start + len(self._buffer) - self._end

    def _checksum_until(self, offset: int) -> None:
        if self._crc_from is None or offset <= self._crc_from:
            return
        begin, end = self._crc_from - self._buffer_start, offset - self._buffer_start
        with memoryview(self._buffer) as view:
            self._crc = zlib.crc32(view[begin:end], self._crc)
        del self._buffer[:end]
        self._buffer_start = self._crc_from = offset

    def _feed(self) -> bool:
        """Decompress the next chunk into the unpacker; ``False`` at the end of the file."""
        while True:
            chunk = self._file.read(_READ_CHUNK)
            if not chunk:
                return False
            if self.frame_complete:
                self.trailing_bytes += len(chunk)
                continue
            data = self._decompressor.decompress(chunk)
            if self._decompressor.eof:
                self.frame_complete = True
                self.trailing_bytes += len(self._decompressor.unused_data)
            if data:
                if self._crc_from is None and len(self._buffer) > _MAX_HEADER:
                    raise _BadExt(f"no msgpack object in the first {_MAX_HEADER >> 20} MiB")
                self._unpacker.feed(data)
                self._buffer += data
                return True


class Shard(NamedTuple):
    header: dict[str, Any]
    records: list[dict[str, Any]]


class ShardReader:
    """Read one shard: ``ShardReader(path).header``; ``for record in ShardReader(path)``.

    The header is read (and checked) on construction. Each iteration streams the file anew and
    yields validated records; when the iteration completes, the footer's record count and checksum
    and the end of the zstd frame have been verified (an iteration stopped early verifies nothing
    beyond the records it yielded). Every refusal is a one-line :class:`ShardError`.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.footer: dict[str, Any] | None = None
        stream = self._open()
        try:
            self.header = self._read_header(stream, iter(stream))
        finally:
            stream.close()

    def _open(self) -> _ObjectStream:
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
            if magic != ZSTD_MAGIC:
                raise ShardError(self.path, "not a glmpost shard (not zstd-compressed)")
            return _ObjectStream(self.path)
        except IsADirectoryError:
            raise ShardError(self.path, "is a directory, not a shard") from None
        except OSError as exc:
            raise ShardError(self.path, f"cannot read: {exc.strerror}") from None

    def _read_header(self, stream: _ObjectStream, objects: Iterator[Any]) -> dict[str, Any]:
        try:
            header = next(objects)
        except StopIteration:
            if not stream.frame_complete:
                raise self._truncated(stream, 0) from None
            raise ShardError(self.path, "not a glmpost shard (no header)") from None
        except _DECODE_ERRORS as exc:
            raise ShardError(self.path, f"not a glmpost shard ({_describe(exc)})") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
            raise ShardError(self.path, f"not a glmpost shard (first object is not a {FORMAT_NAME} header)")
        version = header.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ShardError(self.path, f"header has an invalid schema_version {version!r}")
        if version > SCHEMA_VERSION:
            raise ShardError(
                self.path,
                f"written by a newer glmpost: schema version {version} > {SCHEMA_VERSION} (upgrade glmpost)",
            )
        for key, kind in HEADER_KEYS.items():
            if not isinstance(header.get(key), kind):
                raise ShardError(self.path, f"header has no valid '{key}' (expected {kind.__name__})")
        return header

    def __iter__(self) -> Iterator[dict[str, Any]]:
        stream = self._open()
        try:
            yield from self._records(stream)
        finally:
            stream.close()

    def _records(self, stream: _ObjectStream) -> Iterator[dict[str, Any]]:
        objects = iter(stream)
        self._read_header(stream, objects)
        index = 0
        while True:
            try:
                obj = next(objects)
            except StopIteration:
                raise self._truncated(stream, index) from None
            except _DECODE_ERRORS as exc:
                raise ShardError(self.path, f"corrupt data: {_describe(exc)}", index) from None
            if isinstance(obj, dict) and obj.get("footer") is True:
                break
            yield self._check_record(obj, index)
            index += 1
        self._check_footer(obj, index, stream.records_checksum())
        self._check_end(stream, objects)
        self.footer = obj

    def _truncated(self, stream: _ObjectStream, index: int) -> ShardError:
        where = "mid-frame" if not stream.frame_complete else "without a footer"
        return ShardError(
            self.path, f"truncated shard: the file ends {where} after {index} records (was its writer killed?)"
        )

    def _check_record(self, obj: Any, index: int) -> dict[str, Any]:
        try:
            validate_record(obj)
        except RecordError as exc:
            record_id = obj.get("id") if isinstance(obj, dict) else None
            raise ShardError(self.path, str(exc), index, record_id) from None
        if obj["tokenizer_revision"] != self.header["tokenizer_revision"]:
            raise ShardError(
                self.path,
                f"tokenizer_revision {obj['tokenizer_revision']!r} differs from the header's "
                f"{self.header['tokenizer_revision']!r}",
                index,
                obj["id"],
            )
        return obj

    def _check_footer(self, footer: dict[str, Any], count: int, crc: int) -> None:
        if not isinstance(footer.get("records"), int) or not isinstance(footer.get("checksum"), str):
            raise ShardError(self.path, "malformed footer (needs 'records' and 'checksum')")
        if footer["records"] != count:
            raise ShardError(self.path, f"footer count mismatch: footer says {footer['records']} records, found {count}")
        if footer["checksum"] != _checksum(crc):
            raise ShardError(
                self.path, f"checksum mismatch: footer has {footer['checksum']}, records hash to {_checksum(crc)}"
            )

    def _check_end(self, stream: _ObjectStream, objects: Iterator[Any]) -> None:
        try:
            extra = next(objects, None)
        except _DECODE_ERRORS:
            extra = True
        if extra is not None or stream.leftover:
            raise ShardError(self.path, "data after the footer")
        if not stream.frame_complete:
            raise ShardError(self.path, "truncated shard: the zstd frame is cut short after the footer")
        if stream.trailing_bytes:
            raise ShardError(self.path, f"{stream.trailing_bytes} bytes after the end of the zstd frame")


_DECODE_ERRORS = (msgpack.UnpackException, ValueError, zstandard.ZstdError, RecursionError)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, zstandard.ZstdError):
        return f"corrupt zstd data: {exc}"
    if isinstance(exc, _BadExt):
        return str(exc)
    return f"corrupt msgpack data: {exc or type(exc).__name__}"


def read_shard(path: str | Path) -> Shard:
    """The whole shard in memory: ``Shard(header, records)`` (verified like :class:`ShardReader`)."""
    reader = ShardReader(path)
    return Shard(reader.header, list(reader))


# --------------------------------------------------------------------------------------------
# Datasets: files, directories, globs


def resolve_shard_paths(inputs: Sequence[str | Path]) -> list[Path]:
    """Expand inputs to shard files, in input order, each input sorted, duplicates dropped.

    A file is taken as is; a directory contributes its ``*.msgpack.zst`` files (not recursive,
    hidden files skipped); anything else is a glob. An input matching no shard is a
    :class:`UsageError` naming it.
    """
    if not inputs:
        raise UsageError("no input shards given")
    seen: set[Path] = set()
    paths: list[Path] = []
    for item in inputs:
        for path in _expand(str(item)):
            key = path.resolve()
            if key not in seen:
                seen.add(key)
                paths.append(path)
    return paths


def _expand(item: str) -> list[Path]:
    path = Path(item)
    if path.is_dir():
        found = _shards_in(path)
        if not found:
            raise UsageError(f"{item}: directory holds no *{SHARD_SUFFIX} shards")
        return found
    if path.exists():
        return [path]
    if not any(c in item for c in "*?["):
        raise UsageError(f"{item}: no such file or directory")
    found = []
    for match in sorted(glob.glob(item, recursive=True)):
        found.extend(_shards_in(Path(match)) if os.path.isdir(match) else [Path(match)])
    if not found:
        raise UsageError(f"{item}: no shards match this pattern")
    return found


def _shards_in(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob(f"*{SHARD_SUFFIX}") if not p.name.startswith(".") and p.is_file())


def select_shards(paths: Sequence[Path], shard_index: int, num_shards: int) -> list[Path]:
    """The shards of Slurm array task ``shard_index`` of ``num_shards``: round-robin over sorted paths.

    Every shard goes to exactly one task; a task may get none when there are fewer shards than tasks.
    """
    if num_shards < 1:
        raise UsageError(f"--num-shards must be >= 1, got {num_shards}")
    if not 0 <= shard_index < num_shards:
        raise UsageError(f"--shard-index must be in [0, {num_shards}) for --num-shards {num_shards}, got {shard_index}")
    return sorted(paths, key=str)[shard_index::num_shards]


def iter_records(
    inputs: Sequence[str | Path], *, shard_index: int = 0, num_shards: int = 1
) -> Iterator[dict[str, Any]]:
    """Validated records of every shard selected from ``inputs`` (see :func:`resolve_shard_paths`)."""
    for path in select_shards(resolve_shard_paths(inputs), shard_index, num_shards):
        yield from ShardReader(path)


# --------------------------------------------------------------------------------------------
# JSON form (``glmpost shards cat``; ``glmpost shards import``)
#
# Schema arrays become (nested) lists and schema floats plain numbers, NaN as null. Inside
# free-form maps (task, sampling, extra, ...), values JSON cannot hold exactly are tagged:
# {"$array": {"dtype", "shape", "data"}} (flat data, NaN as null), {"$float": "nan"|"inf"|"-inf"},
# {"$bytes": base64}. Single-key maps with these keys are therefore reserved.


def record_to_json(record: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-safe form of a record (``json.dumps(..., allow_nan=False)`` accepts it)."""
    out: dict[str, Any] = {}
    for name, value in record.items():
        spec = FIELDS.get(name)
        if spec is not None and spec.kind == "array":
            out[name] = _nan_to_none(value.tolist()) if value.dtype.kind == "f" else value.tolist()
        elif name == "reward":
            out[name] = None if math.isnan(value) else value
        elif name == "rewards":
            out[name] = {k: None if math.isnan(v) else v for k, v in value.items()}
        else:
            out[name] = _tag(value)
    return out


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
