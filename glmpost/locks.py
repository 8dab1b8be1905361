"""One writer per output: a stage that writes an output (a shard directory, a task's share of one, a
checkpoint root, a whole output directory) holds its lock while it writes.

The lock is a file beside the output, ``.NAME.lock`` (``.NAME.task-I-of-N.lock`` for one task of a
split stage: tasks of one Slurm array write one directory side by side), held with ``flock`` and
holding its holder as JSON: pid, host, since when, which stage. A second writer exits in one line
naming the holder. The kernel releases a lock whose process died (``kill -9`` included); the next
writer takes it over and says whose it was. The file is removed when its holder lets go.

A file system without ``flock`` (some parallel file systems mount without it) falls back to the
holder file alone: a lock whose holder ran on this host and is gone is taken over; one held from
another host has to be removed by hand, as the message says.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator

from glmpost.errors import GlmpostError, UsageError
from glmpost.stage import log


class OutputLocked(GlmpostError):
    """Another process writes this output."""


def lock_path(out: Path, *, task: tuple[int, int] | None = None) -> Path:
    """The lock file of ``out`` (of task ``(index, count)`` of a split stage)."""
    out = Path(out)
    suffix = f".task-{task[0]}-of-{task[1]}" if task is not None and task[1] > 1 else ""
    return out.parent / f".{out.name}{suffix}.lock"


def _holder(stage: str) -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "stage": stage,
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        holder = json.loads(os.read(fd, 4096).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "another process"
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since {holder.get('since', '?')}"
            f" ({holder.get('stage', '?')})")


def _alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # another user's process, or a pid we cannot judge: assume it runs
    return True


@contextlib.contextmanager
def output_lock(out: Path, *, stage: str, task: tuple[int, int] | None = None) -> Iterator[Path]:
    """Hold the lock of ``out`` (module doc) while the block writes it; yields the lock file."""
    path = lock_path(out, task=task)
    if Path(out).exists() and not Path(out).is_dir():
        raise UsageError(f"{out} exists and is not a directory: name a directory for this output")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _acquire(path, out, stage)
    except OSError as exc:  # a read-only or missing parent: one line naming the path
        raise GlmpostError(f"{out}: cannot write beside it ({path}): {os.strerror(exc.errno) if exc.errno else exc}") from None
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # before the kernel lock goes: a waiting writer then finds no stale holder
        os.close(fd)


def _acquire(path: Path, out: Path, stage: str) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise OutputLocked(f"{out} is being written by {_describe(holder)}: wait for it to finish or stop it "
                               f"(lock {path})") from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                raise
            return _acquire_without_flock(fd, path, out, stage)
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # its holder removed it between our open and our lock: take the new one
            os.close(fd)
            continue
        _take(fd, path, out, stage)
        return fd


def _take(fd: int, path: Path, out: Path, stage: str) -> None:
    """Write this process as the holder; say whose lock it was when a dead holder left one."""
    before = _read_holder(fd)
    if before and before.get("pid") != os.getpid():
        log(f"{out}: took over the lock of {_describe(before)}, which is no longer running")
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(_holder(stage)).encode())
    os.fsync(fd)


def _acquire_without_flock(fd: int, path: Path, out: Path, stage: str) -> int:
    """The holder file alone (module doc)."""
    holder = _read_holder(fd)
    here = socket.gethostname()
    if holder and holder.get("pid") != os.getpid():
        if holder.get("host") != here or _alive(holder.get("pid")):
            os.close(fd)
            raise OutputLocked(f"{out} is being written by {_describe(holder)}: wait for it to finish or stop it; "
                               f"remove {path} if that process is gone (this file system has no flock)")
    _take(fd, path, out, stage)
    return fd
