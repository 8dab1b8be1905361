"""Inputs that are pipes: a named pipe (``mkfifo``) or a process substitution (``<(...)``, a
``/dev/fd/N`` path). A pipe can be read once, so its bytes are read whole the first time they are
needed and kept for the rest of the process (:func:`pipe_bytes`); whether they are prompts or a
shard is told by their content (a shard starts with the zstd magic number), not by the path's type.
A pipe that nothing was written to yet (a named pipe with no writer) is said in one line on stderr before the read waits
for a writer.
"""

from __future__ import annotations

import errno
import os
import select
import stat
import sys
from pathlib import Path

from glmpost.formats.shards import ZSTD_MAGIC

WAIT_BEFORE_SAYING_S = 1.0  # how long a read waits for a writer before it says so
_READ: dict[str, bytes] = {}


def is_pipe(path: str | Path) -> bool:
    """Whether ``path`` is a pipe or a socket (a named pipe, a process substitution's ``/dev/fd/N``)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def pipe_holds_shard(path: str | Path) -> bool:
    """Whether the pipe ``path`` carries a shard (zstd) rather than text."""
    return pipe_bytes(path).startswith(ZSTD_MAGIC)


def pipe_bytes(path: str | Path) -> bytes:
    """Everything written to the pipe ``path``, read once per process (module doc)."""
    key = str(path)
    if key not in _READ:
        _READ[key] = _read_all(key)
    return _READ[key]


def _read_all(path: str) -> bytes:
    """Read the pipe to its end: opened without blocking, so a named pipe with no writer yet is said
    (after :data:`WAIT_BEFORE_SAYING_S`) instead of blocking without a word in ``open``."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    chunks: list[bytes] = []
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        if not poller.poll(WAIT_BEFORE_SAYING_S * 1000):
            sys.stderr.write(f"glmpost: {path}: nothing written to this pipe yet: waiting for a process to write to it\n")
            sys.stderr.flush()
        while True:
            poller.poll()  # data, or the last writer gone (no writer yet: Linux waits for the first)
            try:
                chunk = os.read(fd, 1 << 20)
            except OSError as exc:
                if exc.errno == errno.EAGAIN:
                    continue
                raise
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)
