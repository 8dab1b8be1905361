"""One writer per output: a stage that writes an output (a shard directory, a task's share of one, a
checkpoint root, a whole output directory) holds its lock while it writes.

The lock is a file beside the output's real path (symlinks resolved: two writers that reach one
directory by two paths take one lock), ``.NAME.lock``, held with ``flock`` and holding its holder as
JSON: pid, host, since when, which stage. One task of a split stage (tasks of one Slurm array write
one directory side by side) holds ``.NAME.lock`` shared and ``.NAME.task-I-of-N.lock`` exclusive;
an unsplit writer holds ``.NAME.lock`` exclusive, so it and the tasks exclude each other. A second
writer exits in one line naming the holder (``--overwrite`` included). The kernel releases a lock
whose process died (``kill -9`` included); the next writer takes it over and says whose it was. The
file is removed when its (last) holder lets go. A full or read-only file system met while the lock
is held is one error naming the output (and the file being written under it), never an input.

A file system without ``flock`` (some parallel file systems mount without it) falls back to the
holder file alone: a lock whose holder ran on this host and is gone is taken over; one held from
another host has to be removed by hand, as the message says.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator

from glmpost.errors import STORAGE_ERRORS, GlmpostError, UsageError, first_line, storage_error
from glmpost.stage import log


class OutputLocked(GlmpostError):
    """Another process writes this output."""


_WRITING: list[Path] = []  # the outputs this process holds the lock of, outermost first


def _split(task: tuple[int, int] | None) -> bool:
    return task is not None and task[1] > 1


def lock_path(out: Path, *, task: tuple[int, int] | None = None) -> Path:
    """The lock file of ``out``'s real path (of task ``(index, count)`` of a split stage)."""
    out = Path(out).resolve()
    suffix = f".task-{task[0]}-of-{task[1]}" if _split(task) else ""
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
    task = f", {holder['task']}" if holder.get("task") else ""
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since {holder.get('since', '?')}"
            f" ({holder.get('stage', '?')}{task})")


def _task_holders(path: Path) -> dict[str, Any]:
    """The holder of one task lock beside the whole-output lock ``path`` (its shared holders write
    nothing into it); the first one whose process runs, else any."""
    holders = []
    for task in sorted(path.parent.glob(f"{glob.escape(path.name[:-len('.lock')])}.task-*-of-*.lock")):
        with contextlib.suppress(OSError):
            fd = os.open(task, os.O_RDONLY)
            try:
                holders.append(_read_holder(fd))
            finally:
                os.close(fd)
    alive = [h for h in holders if h and _alive(h.get("pid"))]
    return (alive or [h for h in holders if h] or [{}])[0]


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
    """Hold the lock of ``out`` (module doc) while the block writes it; yields the lock file. A block
    that fails leaves no empty folder it made: ``out`` (with its empty files; not when tasks share
    it) and the parents the lock made are removed when nothing else is in them."""
    path = lock_path(out, task=task)
    if Path(out).exists() and not Path(out).is_dir():
        raise UsageError(f"{out} exists and is not a directory: name a directory for this output")
    made = _missing(Path(out).resolve())
    held: list[tuple[Path, int]] = []
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if _split(task):  # the whole output shared with the other tasks, then this task's own
            held.append((lock_path(out), _acquire(lock_path(out), out, stage, shared=True)))
        held.append((path, _acquire(path, out, stage, task=f"shard index {task[0]} of {task[1]}" if _split(task) else None)))
    except BaseException as exc:
        _release(held)
        _remove_empty(made[1:], files=False)  # the parents it made; ``out`` may be another writer's by now
        if not isinstance(exc, OSError):
            raise
        # a read-only or missing parent: one line naming the path
        raise GlmpostError(f"{out}: cannot write beside it ({path}): {os.strerror(exc.errno) if exc.errno else exc}") from None
    _WRITING.append(Path(out))
    failed = True
    try:
        yield path
        failed = False
    except Exception as exc:  # a full or read-only disk met while writing: one line naming this output
        failure = _write_failure(Path(out), exc)
        if failure is None:
            raise
        raise failure from None
    finally:
        _WRITING.remove(Path(out))
        if failed and not _split(task):
            _remove_empty(made[:1], files=True)  # while it is held: nobody else writes there
        _release(held)
        if failed:
            _remove_empty(made[1:], files=False)


def _missing(out: Path) -> list[Path]:
    """``out`` and its parents that do not exist yet, innermost first."""
    made = []
    while not out.exists() and out != out.parent:
        made.append(out)
        out = out.parent
    return made


def _remove_empty(folders: list[Path], *, files: bool) -> None:
    """Remove each of ``folders`` (innermost first) that holds nothing (``files``: nothing but empty
    files, removed with it, such as a metrics file opened before the failure)."""
    for folder in folders:
        with contextlib.suppress(OSError):
            items = list(folder.iterdir())
            if files and all(not i.name.startswith(".") and i.is_file() and not i.is_symlink() and i.stat().st_size == 0
                             for i in items):
                for item in items:
                    item.unlink()
            folder.rmdir()


def _write_failure(out: Path, exc: Exception) -> GlmpostError | None:
    """``exc`` as an error naming the output ``out`` when it is a file system refusing a write under
    it (:func:`~glmpost.errors.storage_error`): the file being written when the error names one
    under ``out`` (a copy names its source first, its destination second: never the input), else
    ``out`` alone when this is the outermost output being written. None for anything else, and for
    an error another output (or an input) is to answer for."""
    if isinstance(exc, GlmpostError) or not storage_error(exc):
        return None
    target = (exc.filename2 or exc.filename) if isinstance(exc, OSError) else None
    if target is not None and not _under(Path(os.fsdecode(target)), out):
        return None
    if target is None and _WRITING[0] != out:
        return None
    reason = next((os.strerror(code) for code in STORAGE_ERRORS if os.strerror(code) in str(exc)), first_line(exc))
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRORS:
        reason = os.strerror(exc.errno)
    where = f" ({os.fsdecode(target)})" if target is not None else ""
    return GlmpostError(f"{out}: cannot write{where}: {reason}")


def _under(path: Path, out: Path) -> bool:
    try:
        path.resolve().relative_to(Path(out).resolve())
    except ValueError:
        return False
    return True


def _release(held: list[tuple[Path, int]]) -> None:
    """Let go of ``held`` (last taken first), removing each file its last holder leaves."""
    for path, fd in reversed(held):
        try:  # a shared holder removes the file only when no other holds it (an exclusive lock it can take)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            no_flock = exc.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)
            if not no_flock or _read_holder(fd).get("pid") != os.getpid():  # held by others, or not ours to remove
                os.close(fd)
                continue
        with contextlib.suppress(OSError):
            path.unlink()  # before the kernel lock goes: a waiting writer then finds no stale holder
        os.close(fd)


def _acquire(path: Path, out: Path, stage: str, *, shared: bool = False, task: str | None = None) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd) or (_task_holders(path) if not task else {})
            os.close(fd)
            raise OutputLocked(f"{out} is being written by {_describe(holder)}: wait for it to finish or stop it "
                               f"(lock {path})") from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                raise
            return _acquire_without_flock(fd, path, out, stage, shared=shared, task=task)
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # its holder removed it between our open and our lock: take the new one
            os.close(fd)
            continue
        _take(fd, out, stage, shared=shared, task=task)
        return fd


def _take(fd: int, out: Path, stage: str, *, shared: bool = False, task: str | None = None) -> None:
    """Write this process as the holder (a shared holder leaves the file empty: the task locks name
    the holders); say whose lock it was when a dead holder left one."""
    before = _read_holder(fd)
    if before and before.get("pid") != os.getpid():
        log(f"{out}: took over the lock of {_describe(before)}, which is no longer running")
    os.ftruncate(fd, 0)
    if shared:
        return
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps({**_holder(stage), **({"task": task} if task else {})}).encode())
    os.fsync(fd)


def _acquire_without_flock(fd: int, path: Path, out: Path, stage: str, *, shared: bool = False,
                           task: str | None = None) -> int:
    """The holder file alone (module doc); a task's shared hold on the whole output is then a check
    that no unsplit writer holds it."""
    holder = _read_holder(fd)
    here = socket.gethostname()
    if holder and holder.get("pid") != os.getpid():
        if holder.get("host") != here or _alive(holder.get("pid")):
            os.close(fd)
            raise OutputLocked(f"{out} is being written by {_describe(holder)}: wait for it to finish or stop it; "
                               f"remove {path} if that process is gone (this file system has no flock)")
    if shared:
        return fd  # leaves the file as it is: an unsplit writer's holder file, or none
    _take(fd, out, stage, task=task)
    return fd
