"""Crash-safe file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path


def current_umask() -> int:
    """The process's umask (reading it means setting it, so it is set back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Make a rename inside ``directory`` durable."""
    fsync_path(directory)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it, rename it over ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp's 0600 would make shared outputs unreadable to others
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def make_readable(directory: Path) -> None:
    """Give every file under ``directory`` (and itself) the permissions the umask allows
    (0644 / 0755 under the usual 022): checkpoints are read by servers running as other users, and
    some writers (safetensors, mkdtemp) create 0600 / 0700. Links to files elsewhere (an imported
    model's weights) keep their mode: changing it would change the source's."""
    mask = current_umask()
    directory = Path(directory)
    os.chmod(directory, 0o777 & ~mask)
    for path in directory.rglob("*"):
        if path.is_symlink() or (path.is_file() and path.stat().st_nlink > 1):  # a link to a file not ours
            continue
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def file_system_problem(path: Path) -> str | None:
    """After a write under ``path`` failed with an error that does not say why (``torch.save``'s
    "iostream error"): what its file system says, "No space left on device" (less than 1 MiB free)
    or "Read-only file system"; None when neither."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    if stats.f_flag & os.ST_RDONLY:
        return os.strerror(errno.EROFS)
    if stats.f_bavail * stats.f_frsize < 1 << 20:
        return os.strerror(errno.ENOSPC)
    return None
