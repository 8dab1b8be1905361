"""Reading one trajectory shard: :class:`ShardReader`, :func:`read_shard` (``formats/SPEC.md``).

A reader streams the zstd frame and the msgpack objects in it, checks the header (SPEC.md §3),
validates every record (§6) and, once the iteration completes, the footer's record count and
checksum and the end of the frame; every refusal (§7) is a one-line :class:`ShardError` naming
the file and the record. It reads schema versions 1 and 2 (§9): a version-1 record is a version-2
record without context windows, so it is read as it is. The constants, the ExtType 1 decoder and
the writer are in :mod:`glmpost.formats.shards`.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import zstandard

from glmpost.formats.schema import ROUTING_FIELD, SCHEMA_VERSION, RecordError
from glmpost.formats.shards import (
    FORMAT_NAME,
    HEADER_KEYS,
    ZSTD_MAGIC,
    BadExtension,
    ShardError,
    checksum_text,
    record_unpacker,
)
from glmpost.formats.validation import validate_record
from glmpost.formats.windows import CONTEXT_KEY

_READ_CHUNK = 1 << 18
_MAX_HEADER = 64 << 20


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
        self.record_unpacker = record_unpacker()
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
            for obj in self.record_unpacker:
                self._last_start, self._end = self._end, self.record_unpacker.tell()
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
                    raise BadExtension(f"no msgpack object in the first {_MAX_HEADER >> 20} MiB")
                self.record_unpacker.feed(data)
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
            if self.header["schema_version"] == 1:
                _check_version_1(obj)
            if self.header["schema_version"] < 3 and ROUTING_FIELD in obj:
                raise RecordError(f"field '{ROUTING_FIELD}' needs schema version 3, the header says "
                                  f"{self.header['schema_version']}")
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
        if footer["checksum"] != checksum_text(crc):
            raise ShardError(
                self.path, f"checksum mismatch: footer has {footer['checksum']}, records hash to {checksum_text(crc)}"
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


def _check_version_1(record: dict[str, Any]) -> None:
    """A version-1 record has one context window: a segment ``context`` there would be misread."""
    for i, seg in enumerate(record.get("segments") or ()):
        if CONTEXT_KEY in seg:
            raise RecordError(f"segments[{i}].{CONTEXT_KEY}: context windows need schema version 2, the header says 1")


_DECODE_ERRORS = (msgpack.UnpackException, ValueError, zstandard.ZstdError, RecursionError)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, zstandard.ZstdError):
        return f"corrupt zstd data: {exc}"
    if isinstance(exc, BadExtension):
        return str(exc)
    return f"corrupt msgpack data: {exc or type(exc).__name__}"


def read_shard(path: str | Path) -> Shard:
    """The whole shard in memory: ``Shard(header, records)`` (verified like :class:`ShardReader`)."""
    reader = ShardReader(path)
    return Shard(reader.header, list(reader))
