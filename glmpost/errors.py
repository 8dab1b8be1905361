"""Errors a user can act on.

Every failure that bad input can cause is raised as a :class:`GlmpostError`; the CLI prints its
message as one line (``glmpost: error: ...``) and exits with :attr:`GlmpostError.exit_code`,
never with a traceback. Messages name the file, field or option at fault.
"""

from __future__ import annotations

import errno
import os


class GlmpostError(Exception):
    """The work failed for a reason the user can fix (exit code 1)."""

    exit_code = 1


class UsageError(GlmpostError):
    """The invocation was wrong: a bad option value, a missing input (exit code 2)."""

    exit_code = 2


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none), for one-line errors."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# What a full, read-only or over-quota file system raises.
STORAGE_ERRORS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG)


def storage_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a file system refusing a write: an ``OSError`` with one of
    :data:`STORAGE_ERRORS`, or a library's wrapping of one (safetensors, torch.save) whose message
    names it."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno in STORAGE_ERRORS
    text = str(exc)
    return any(os.strerror(code) in text for code in STORAGE_ERRORS)
