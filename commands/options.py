"""Options defined once: a stage's command-line option is derived from the config field it sets.

A flag's whole path, in the order it runs (``rollout --top-k 20`` as the example):

1. **Declared** once, as a field of the stage's config dataclass: ``top_k: int = setting(0, "Sample
   among the k most likely tokens; 0 disables.", min=0)`` (``glmpost/rollout/settings.py:
   RolloutConfig``; :func:`glmpost.config.setting` keeps the default, the help, the bounds and, in
   ``cli=``, what the command line needs beyond the field's type; ``shared(name)`` for a setting
   many stages have). A field inside a ``section(...)`` is a setting of the whole tree, flat by name.
2. **Made an option** when the command is defined: ``@with_config(RolloutConfig)`` on the command
   function (``commands/rollout.py``) calls :func:`option` for each setting (``--top-k``, unless
   the field names its ``flag``) and adds it to the function's signature (:func:`with_options`);
   typer then shows it in ``--help`` with that help and default.
3. **Given a recipe value**: ``--config RECIPE`` is eager (``commands/common.py:
   _load_recipe_section``): the recipe's ``[rollout]`` keys (``top-k = 20`` or ``top_k = 20``) are
   checked like the flag and become click's default map, so a flag on the command line wins.
4. **Parsed** by click into ``ctx.params["top_k"]`` (the function also receives it in ``**settings``,
   which a command need not read).
5. **Built into the config**: ``config_from(ctx, RolloutConfig)`` -> :func:`glmpost.config.from_values`,
   which fills every field (and section) from ``ctx.params`` by name. The library sees only the config.
6. **Recorded**: ``commands.common.effective_options(ctx)`` (``ctx.params`` without ``--json``,
   ``--overwrite`` and the trackers; :func:`glmpost.stage.recorded_options`) is what ``stage.json``
   and the shard headers hold; a rerun with other values is refused naming the option.
7. **Refused** in the library as ``ConfigError("{top_k} ...")`` / ``SettingError("top_k", ...)``;
   :func:`spelled_with_flags` (every stage is registered through it in ``commands/app.py``) says it
   with the flag the user typed (:func:`flags_in_errors`).

Options every stage has (``--json``, ``--config``) live here too. CONTRIBUTING.md "Add a setting to a
stage" walks the same path for a new setting; ``tests/test_cli_options.py`` guards every option.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator

import typer

from glmpost.commands.common import RECIPE_META
from glmpost.config import ConfigError, SettingError, from_values, leaves, setting_of
from glmpost.drivers import ShardStage, follow_shards, run_shards
from glmpost.errors import GlmpostError, UsageError
from glmpost.spool.settings import FollowSettings
from glmpost.stage import log, recorded_options
from glmpost.trackers import TRACKER_SETTINGS, TrackerSettings, tracking


def option(cls: type, name: str, **overrides: Any) -> Any:
    """The typer option of field ``name`` of config ``cls`` (its default, flag, help and bounds)."""
    default, meta = setting_of(cls, name)
    flag = meta.get("flag") or "--" + name.replace("_", "-")
    bounds = {k: meta[k] for k in ("min", "max") if meta.get(k) is not None}
    cli = {k: v for k, v in meta.get("cli", {}).items() if k != "annotation"}
    return typer.Option(default, flag, help=meta["help"],
                        **{**bounds, "callback": bounded(above=meta.get("above"), below=meta.get("below")), **cli, **overrides})


def bounded(*, above: float | None = None, below: float | None = None):
    """A typer callback refusing, at parse time, a float that is not finite or not strictly inside
    ``(above, below)`` (an option's inclusive bounds are typer's ``min`` / ``max``)."""
    def check(value: Any) -> Any:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if not isinstance(item, float):
                continue
            if not math.isfinite(item):
                raise typer.BadParameter(f"{item} is not a finite number")
            if above is not None and not item > above:
                raise typer.BadParameter(f"{item} is not > {above:g}")
            if below is not None and not item < below:
                raise typer.BadParameter(f"{item} is not < {below:g}")
        return value

    return check


def settings_of(cls: type, *, exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The settings of the config tree ``cls`` (fields declared with :func:`~glmpost.config.setting`,
    its sections' too)."""
    return tuple(f.name for f, _ in leaves(cls) if "help" in f.metadata and f.name not in exclude)


def with_config(cls: type, *, exclude: tuple[str, ...] = ()):
    """Add an option for every setting of config ``cls`` but ``exclude`` (:func:`with_options`): a
    command declares only its arguments and what no config holds."""
    return with_options(cls, settings_of(cls, exclude=exclude))


def config_from(ctx: typer.Context, cls: type, **overrides: Any):
    """``cls`` from the command's parsed options (every field that is an option of the command)."""
    return from_values(cls, ctx.params, **overrides)


def follow_from(ctx: typer.Context, cls: type, inputs, *, name: str, what: str):
    """The follow settings (``cls``) when ``--follow`` is given, INPUTS then refused; else None,
    INPUTS then required (``name`` the argument as --help shows it, ``what`` what it holds)."""
    if ctx.params.get("follow") is not None:
        if inputs:
            raise UsageError(f"--follow reads its input from the spool: drop the {name}")
        return config_from(ctx, cls)
    if not inputs:
        raise UsageError(f"give the {what} ({name}), or --follow SPOOL")
    return None


def drive_shard_stage(ctx: typer.Context, stage: ShardStage, inputs, *, what: str) -> tuple[dict[str, Any], bool]:
    """Run a shard stage as the options say: following the spool ``--follow`` (INPUTS then refused),
    else once over INPUTS (``what``: what they hold). Returns the summary and whether it followed."""
    follow = follow_from(ctx, FollowSettings, inputs, name="SHARDS", what=what)
    p = ctx.params
    if follow is not None:
        return follow_shards(stage, follow, out=p["out"]), True
    return run_shards(stage, inputs=inputs, out=p["out"], shard_index=p["shard_index"], num_shards=p["num_shards"],
                      overwrite=p["overwrite"]), False


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


def spelled_setting(ctx: typer.Context, name: str) -> str:
    """The setting ``name`` as the user gave it: ``recipe FILE: [SECTION] KEY =`` when its value
    came from the ``--config`` recipe (:data:`RECIPE_META`), else the command's flag."""
    recipe = ctx.meta.get(RECIPE_META)
    if recipe is not None and name in recipe["keys"] and ctx.get_parameter_source(name).name == "DEFAULT_MAP":
        return f"recipe {recipe['path']}: [{recipe['section']}] {recipe['keys'][name]} ="
    return flag_of(ctx.command, name)


@contextmanager
def flags_in_errors(ctx: typer.Context) -> Iterator[None]:
    """A library error naming config fields (:class:`~glmpost.config.SettingError`,
    :class:`~glmpost.config.ConfigError`) is said with the command's flags instead."""
    try:
        yield
    except SettingError as exc:
        raise UsageError(f"{spelled_setting(ctx, exc.field)} {exc.value!r} {exc.problem}") from None
    except ConfigError as exc:
        kind = UsageError if exc.exit_code == UsageError.exit_code else GlmpostError
        error = kind(exc.spelled(lambda name: flag_of(ctx.command, name)))
        error.exit_code = exc.exit_code
        raise error from None


def spelled_with_flags(fn, *, tracked: str | None = None):
    """``fn`` as a command whose library errors name its flags (:func:`flags_in_errors`); the app
    registers every stage through it. ``tracked``: the stage's name, for a stage that writes metrics:
    it takes the tracker options (:class:`~glmpost.trackers.TrackerSettings`) and its metrics lines
    go to those trackers while it runs."""
    import functools
    import inspect

    takes_ctx = "ctx" in inspect.signature(fn).parameters
    inner = with_config(TrackerSettings)(fn) if tracked else fn
    signature = inspect.signature(inner)

    @functools.wraps(fn)
    def command(*args, **kwargs):
        ctx = kwargs["ctx"] if takes_ctx else kwargs.pop("ctx")
        with flags_in_errors(ctx):
            if not tracked:
                return fn(*args, **kwargs)
            for name in TRACKER_SETTINGS:
                kwargs.pop(name)
            with tracking(config_from(ctx, TrackerSettings), stage=tracked, config=tracker_config(ctx),
                          out=ctx.params.get("out") or ctx.params.get("follow") or ctx.params.get("checkpoint"),
                          follow=bool(ctx.params.get("follow"))):
                return fn(*args, **kwargs)

    if not takes_ctx:
        ctx_param = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
        signature = signature.replace(parameters=[ctx_param, *signature.parameters.values()])
    command.__signature__ = signature
    return command


NOT_TRACKER_CONFIG = ("as_json", "overwrite", "api_key", "admin_api_key", *TRACKER_SETTINGS)  # secrets stay out


def tracker_config(ctx: typer.Context) -> dict[str, Any]:
    """The run's options as the trackers' config: what stage.json records, without keys and tracker settings."""
    return recorded_options(ctx.params, leave_out=NOT_TRACKER_CONFIG)


def with_options(cls: type, names: tuple[str, ...]):
    """Add the options of fields ``names`` of config ``cls`` to a command (before ``--config``), so
    commands that share a config share its option lines too; the body reads them with
    :func:`config_from` and receives them in ``**shared``."""
    import functools
    import inspect
    import typing

    owners = {f.name: (f, owner) for f, owner in leaves(cls)}

    def wrap(fn):
        signature = inspect.signature(fn)
        params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        at = next((i for i, p in enumerate(params) if p.name == "config"), len(params))
        def annotation(name: str) -> Any:
            f, owner = owners[name]
            return f.metadata.get("cli", {}).get("annotation") or typing.get_type_hints(owner)[name]

        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option(cls, name), annotation=annotation(name))
                 for name in names]
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
                  and i > 0 else p for i, p in enumerate(params)]

        @functools.wraps(fn)
        def command(*args, **kwargs):
            return fn(*args, **kwargs)

        command.__signature__ = signature.replace(parameters=params[:at] + added + params[at:])
        return command

    return wrap


def with_deprecated_aliases(aliases: dict[str, str], *, until: str = "the next release"):
    """Keep old option names working for a while: ``aliases`` maps an old parameter name (its flag
    ``--old-name``, its recipe key ``old-name``) to the option that replaced it. The old spelling is
    hidden from ``--help``; given, it warns once on stderr and sets the new option (both given: a
    usage error). stage.json records the new name only."""
    import functools
    import inspect
    import typing

    def wrap(fn):
        signature = inspect.signature(fn)
        hints = {**typing.get_type_hints(fn), **{name: p.annotation for name, p in signature.parameters.items()
                                                 if not isinstance(p.annotation, str)}}
        params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        rest = [p for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
        added = [inspect.Parameter(old, inspect.Parameter.KEYWORD_ONLY, annotation=typing.Optional[hints[new]],
                                   default=typer.Option(None, "--" + old.replace("_", "-"), hidden=True,
                                                        help=f"Deprecated: use --{new.replace('_', '-')}."))
                 for old, new in aliases.items()]

        @functools.wraps(fn)
        def command(*args, **kwargs):
            ctx = kwargs.get("ctx") or next(a for a in args if isinstance(a, typer.Context))
            for old, new in aliases.items():
                value = kwargs.pop(old, None)
                ctx.params.pop(old, None)
                if value is None:
                    continue
                old_flag, new_flag = flag_of(ctx.command, old), flag_of(ctx.command, new)
                if ctx.get_parameter_source(new).name in ("COMMANDLINE", "DEFAULT_MAP"):
                    raise UsageError(f"{old_flag} is the deprecated spelling of {new_flag}: give one of them")
                log(f"warning: {old_flag} is deprecated and goes in {until}: use {new_flag}")
                kwargs[new] = ctx.params[new] = value
            return fn(*args, **kwargs)

        command.__signature__ = signature.replace(parameters=params + added + rest)
        return command

    return wrap


TRAINING_RUN_OPTIONS = ("zero_stage", "deepspeed_config", "device", "precision", "activation_checkpointing", "deterministic", "attention", "save_every", "resume",
                        "overwrite")
# The policy trained as a LoRA adapter (issue 45): train-grpo, opd-merge, train-sao (glmpost.rl.lora_training).
LORA_OPTIONS = ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout")
