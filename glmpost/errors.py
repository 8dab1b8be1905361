"""Errors a user can act on.

Every failure that bad input can cause is raised as a :class:`GlmpostError`; the CLI prints its
message as one line (``glmpost: error: ...``) and exits with :attr:`GlmpostError.exit_code`,
never with a traceback. Messages name the file, field or option at fault.
"""

from __future__ import annotations


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
