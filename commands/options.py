"""Options defined once: a stage's command-line option is derived from the config field it sets.

The field (``glmpost.config.setting``) holds the default and the help text; :func:`option` turns it
into the typer option (``--field-name`` unless the field names its flag), :func:`config_from`
builds the config from the parsed options, and :func:`flags_in_errors` rephrases a refused setting
with the flag the user typed. Options every stage has (``--json``, ``--config``) live here too.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import typer

from glmpost.config import SettingError, from_values, setting_of
from glmpost.errors import UsageError


def option(cls: type, name: str, **overrides: Any) -> Any:
    """The typer option of field ``name`` of config ``cls`` (its default, flag, help and bounds)."""
    default, meta = setting_of(cls, name)
    flag = meta.get("flag") or "--" + name.replace("_", "-")
    bounds = {k: meta[k] for k in ("min", "max") if meta.get(k) is not None}
    return typer.Option(default, flag, help=meta["help"], **{**bounds, **overrides})


def config_from(ctx: typer.Context, cls: type, **overrides: Any):
    """``cls`` from the command's parsed options (every field that is an option of the command)."""
    return from_values(cls, ctx.params, **overrides)


def json_option(what: str = "the result summary") -> Any:
    """``--json``: stdout carries ``what`` as one JSON document instead of text."""
    return typer.Option(False, "--json", help=f"Print {what} as JSON.")


@contextmanager
def flags_in_errors(ctx: typer.Context) -> Iterator[None]:
    """A :class:`~glmpost.config.SettingError` becomes a usage error that names the option's flag."""
    try:
        yield
    except SettingError as exc:
        flag = next((o for p in ctx.command.params if p.name == exc.field for o in p.opts if o.startswith("--")), None)
        raise UsageError(f"{flag} {exc.value!r} {exc.problem}" if flag else str(exc)) from None


def with_options(cls: type, names: tuple[str, ...]):
    """Add the options of fields ``names`` of config ``cls`` to a command (before ``--config``), so
    commands that share a config share its option lines too; the body reads them with
    :func:`config_from` and receives them in ``**shared``."""
    import functools
    import inspect
    import typing

    hints = typing.get_type_hints(cls)

    def wrap(fn):
        signature = inspect.signature(fn)
        params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        at = next((i for i, p in enumerate(params) if p.name == "config"), len(params))
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option(cls, name), annotation=hints[name])
                 for name in names]
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
                  and i > 0 else p for i, p in enumerate(params)]

        @functools.wraps(fn)
        def command(*args, **kwargs):
            return fn(*args, **kwargs)

        command.__signature__ = signature.replace(parameters=params[:at] + added + params[at:])
        return command

    return wrap


TRAINING_RUN_OPTIONS = ("zero_stage", "deepspeed_config", "device", "deterministic", "save_every", "resume", "overwrite")
