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

from glmpost.config import ConfigError, SettingError, from_values, setting_of
from glmpost.errors import GlmpostError, UsageError


def option(cls: type, name: str, **overrides: Any) -> Any:
    """The typer option of field ``name`` of config ``cls`` (its default, flag, help and bounds)."""
    default, meta = setting_of(cls, name)
    flag = meta.get("flag") or "--" + name.replace("_", "-")
    bounds = {k: meta[k] for k in ("min", "max") if meta.get(k) is not None}
    return typer.Option(default, flag, help=meta["help"], **{**bounds, **overrides})


def config_from(ctx: typer.Context, cls: type, **overrides: Any):
    """``cls`` from the command's parsed options (every field that is an option of the command)."""
    return from_values(cls, ctx.params, **overrides)


def follow_from(ctx: typer.Context, cls: type, inputs, *, name: str, what: str):
    """The follow settings (``cls``) when ``--follow`` is given, INPUTS then refused; else None,
    INPUTS then required (``name`` the argument as --help shows it, ``what`` what it holds)."""
    follow = config_from(ctx, cls)
    if follow.follow is not None:
        if inputs:
            raise UsageError(f"--follow reads its input from the spool: drop the {name}")
        return follow
    if not inputs:
        raise UsageError(f"give the {what} ({name}), or --follow SPOOL")
    return None


def json_option(what: str = "the result summary") -> Any:
    """``--json``: stdout carries ``what`` as one JSON document instead of text."""
    return typer.Option(False, "--json", help=f"Print {what} as JSON.")


def flag_of(command: Any, name: str) -> str:
    """How a (click) command spells the parameter ``name``: its long flag (``engine_name`` ->
    ``--engine``), an argument's name (``INPUTS``), else ``--name-with-dashes`` (a field it does not take)."""
    for param in command.params:
        if param.name == name:
            longs = [o for o in param.opts if o.startswith("--")]
            return longs[0] if longs else name.upper()
    return "--" + name.replace("_", "-")


@contextmanager
def flags_in_errors(ctx: typer.Context) -> Iterator[None]:
    """A library error naming config fields (:class:`~glmpost.config.SettingError`,
    :class:`~glmpost.config.ConfigError`) is said with the command's flags instead."""
    try:
        yield
    except SettingError as exc:
        raise UsageError(f"{flag_of(ctx.command, exc.field)} {exc.value!r} {exc.problem}") from None
    except ConfigError as exc:
        kind = UsageError if exc.exit_code == UsageError.exit_code else GlmpostError
        error = kind(exc.spelled(lambda name: flag_of(ctx.command, name)))
        error.exit_code = exc.exit_code
        raise error from None


def spelled_with_flags(fn):
    """``fn`` as a command whose library errors name its flags (:func:`flags_in_errors`); the app
    registers every stage through it."""
    import functools
    import inspect

    signature = inspect.signature(fn)
    takes_ctx = "ctx" in signature.parameters

    @functools.wraps(fn)
    def command(*args, **kwargs):
        ctx = kwargs["ctx"] if takes_ctx else kwargs.pop("ctx")
        with flags_in_errors(ctx):
            return fn(*args, **kwargs)

    if not takes_ctx:
        ctx_param = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
        command.__signature__ = signature.replace(parameters=[ctx_param, *signature.parameters.values()])
    return command


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


FOLLOW_OPTIONS = ("follow", "consumer", "follow_records", "publish_every", "poll_s", "lease_s", "max_steps", "max_versions",
                  "idle_timeout")
TRAINING_RUN_OPTIONS = ("zero_stage", "deepspeed_config", "device", "deterministic", "attention", "save_every", "resume",
                        "overwrite")
