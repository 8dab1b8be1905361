"""What every stage shares: recipe sections as option defaults, output directories, summaries.

A stage is ``glmpost STAGE INPUT... --out DIR [--config RECIPE.toml] [options]``. Every option can
also be set in the recipe's ``[STAGE]`` section (dashes or underscores); a flag given on the command
line wins. The effective options are written to ``DIR/stage.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import typer

from glmpost.config import ConfigError
from glmpost.errors import GlmpostError
from glmpost.fsutil import current_umask, make_readable
from glmpost.locks import output_lock
from glmpost.stage import check_same_options, log, recorded_options
from glmpost.toml import tomllib
from glmpost.trackers import TRACKER_SETTINGS

RECIPE_ARGUMENT_COMMANDS = ("plan",)  # commands reading a recipe given as their argument, not --config
PIPELINE_SECTION = "pipeline"  # bin/pipeline's, read by no stage


RECIPE_META = "glmpost.recipe"  # ctx.meta: the --config recipe's path, section and {setting: key as written}


def _load_recipe_section(ctx: typer.Context, param: Any, value: Path | None) -> Path | None:
    """Eager callback of ``--config``: the recipe section becomes the command's default map."""
    if value is None:
        return None
    section_name = recipe_section_name(ctx)
    try:
        with open(value, "rb") as f:
            recipe = tomllib.load(f)
    except FileNotFoundError:
        raise typer.BadParameter(f"recipe {value} does not exist", ctx=ctx, param=param)
    except tomllib.TOMLDecodeError as exc:
        raise typer.BadParameter(f"recipe {value} is not valid TOML: {exc}", ctx=ctx, param=param)
    except UnicodeDecodeError as exc:
        raise typer.BadParameter(f"recipe {value}: not UTF-8 text (byte {exc.start}: {exc.reason})", ctx=ctx, param=param)
    unknown, known = unknown_sections(recipe, ctx.find_root().command)
    if unknown:  # a misspelled [rolout] would leave this stage on its defaults
        raise typer.BadParameter(f"recipe {value}: unknown section [{unknown[0]}] (known: {', '.join(known)})",
                                 ctx=ctx, param=param)
    section: Any = recipe
    for part in section_name.split("."):
        section = section.get(part, {}) if isinstance(section, dict) else None
    if not isinstance(section, dict):
        raise typer.BadParameter(f"recipe {value}: [{section_name}] must be a table", ctx=ctx, param=param)
    # A key is the option's flag without dashes (`max-new-tokens`, `set`) or its Python name.
    params: dict[str, Any] = {}
    for p in ctx.command.params:
        if p.name in ("config", "help"):
            continue
        params[p.name] = p
        for opt in p.opts:
            if opt.startswith("--"):
                params[opt[2:].replace("-", "_")] = p
    defaults: dict[str, Any] = {}
    written: dict[str, str] = {}  # setting -> its key as the recipe spells it
    for key, setting in section.items():
        target = params.get(key.replace("-", "_"))
        if target is None:
            if isinstance(setting, dict) and f"{section_name}.{key}" in stage_commands(ctx.find_root().command):
                continue  # the section of a subcommand
            flags = sorted({o[2:] for p in params.values() for o in p.opts if o.startswith("--")} | {
                p.name.replace("_", "-") for p in params.values() if p.param_type_name == "argument"})
            unknown = f"sub-table [{section_name}.{key}]" if isinstance(setting, dict) else f"key '{key}' in [{section_name}]"
            raise typer.BadParameter(f"recipe {value}: unknown {unknown} (known{' keys' if isinstance(setting, dict) else ''}: "
                                     f"{', '.join(flags)})", ctx=ctx, param=param)
        if target.param_type_name == "argument":
            setting = [str(s) for s in setting] if isinstance(setting, list) else [str(setting)]
        else:  # refused here, the error names the recipe, not a flag nobody typed
            try:
                coerced = target.get_runtime_param().coerce(setting, param=target, ctx=ctx)
                if target.callback is not None:  # the bounds a stage's options check (commands.options.bounded)
                    target.callback(ctx, target, coerced)
            except typer.BadParameter as exc:
                raise typer.BadParameter(f"recipe {value}: [{section_name}] {key} = {setting!r}: {exc.message}",
                                         ctx=ctx, param=param) from None
        defaults[target.name] = setting
        written[target.name] = key
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    ctx.meta[RECIPE_META] = {"path": value, "section": section_name, "keys": written}
    return value


def stage_commands(root: Any) -> dict[str, Any]:
    """``{section name: click command}`` for every command that reads a recipe section."""
    found: dict[str, Any] = {}

    def walk(command: Any, prefix: list[str]) -> None:
        subcommands = getattr(command, "commands", None)
        if subcommands is not None:
            for name, sub in subcommands.items():
                walk(sub, prefix + [name])
            return
        names = {p.name for p in command.params}
        if "config" in names or (prefix and prefix[-1] in RECIPE_ARGUMENT_COMMANDS):
            found[".".join(prefix)] = command

    walk(root, [])
    return found


def unknown_sections(recipe: dict[str, Any], root: Any) -> tuple[list[str], list[str]]:
    """The sections of ``recipe`` that name no stage of ``root`` reading a recipe (the glmpost
    command; a group's sections are ``[GROUP.STAGE]``) and are not ``[pipeline]``, and the names a
    recipe may use."""
    stages = stage_commands(root)
    groups = {name.rsplit(".", 1)[0] for name in stages if "." in name}
    unknown = []

    def visit(table: dict[str, Any], prefix: str) -> None:
        for key, section in table.items():
            name = f"{prefix}.{key}" if prefix else key
            if name in stages or (not prefix and key == PIPELINE_SECTION):
                continue
            if name in groups and isinstance(section, dict):
                visit(section, name)
            else:
                unknown.append(name)

    visit(recipe, "")
    return unknown, sorted([*stages, PIPELINE_SECTION])


def recipe_section_name(ctx: typer.Context) -> str:
    """``glmpost init-model`` reads ``[init-model]``; ``glmpost shards import`` reads ``[shards.import]``."""
    names = []
    while ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return ".".join(reversed(names))


def config_option() -> Any:
    return typer.Option(
        None,
        "--config",
        help="TOML recipe; its section named after this stage sets any option of it (flags win).",
        is_eager=True,
        callback=_load_recipe_section,
        dir_okay=False,
    )


def effective_options(ctx: typer.Context) -> dict[str, Any]:
    """The options a stage ran with (JSON-safe), for stage.json and shard headers.

    ``--json``, ``--overwrite`` and the trackers say how to report and whether to replace, not how
    the output was made, so they are left out (a rerun with ``--overwrite`` writes identical shards).
    """
    return recorded_options(ctx.params, leave_out=("as_json", "overwrite", *TRACKER_SETTINGS))


def report_skipped(out: Path, *, as_json: bool, holds: str = "already holds a checkpoint", redo: str = "replaces it",
                   done: str = "already complete") -> None:
    """The result of a stage whose output was already complete: a log line saying what ``out``
    ``holds`` and what ``--overwrite`` would do, then ``{"out", "skipped": true}`` (or ``OUT: done (skipped)``)."""
    log(f"{out} {holds}; nothing to do (--overwrite {redo})")
    print_summary({"out": str(out), "skipped": True}, as_json=as_json, human=f"{out}: {done} (skipped)")


def report_update(summary: dict[str, Any] | None, *, as_json: bool, human: Any) -> None:
    """A training stage's result: nothing on a rank other than 0 (``summary`` None), the skip when the
    version existed, else ``human(summary)`` (or the JSON)."""
    if summary is None:
        return
    if summary.get("skipped"):
        log(f"{summary['out']} already exists: this update was done; nothing to do")
        print_summary(summary, as_json=as_json, human=f"{summary['out']}: already trained (skipped)")
        return
    print_summary(summary, as_json=as_json, human=human(summary))


@contextmanager
def staged_output_dir(
    out: Path,
    *,
    overwrite: bool,
    complete_marker: str,
    stage: str | None = None,
    options: dict[str, Any] | None = None,
    ignore: tuple[str, ...] = ("config",),
) -> Iterator[Path | None]:
    """Build a whole output directory under a temporary sibling, then move it into place.

    Yields ``None`` (nothing to do) when ``out`` already holds a complete output (``complete_marker``
    exists in it) made with the same effective ``options`` (its ``stage.json``; ``ignore`` names
    options that do not change the output) and ``overwrite`` is false; other options are refused
    (exit 2) naming the first that differs. A crash leaves ``out`` as it was; an existing incomplete
    ``out`` is refused unless ``overwrite`` is given, so nothing is silently replaced.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError("{out} {out_dir} exists and is not a directory", out_dir=out)
    with output_lock(out, stage=stage or "glmpost"):  # one writer: the checks below see what it left
        if out.exists() and not overwrite:
            if (out / complete_marker).exists():
                if stage is not None and options is not None:
                    check_same_options(out, stage, options, ignore=ignore, overwrite=False)
                yield None
                return
            if any(out.iterdir()):
                raise ConfigError("{out} {out_dir} exists but holds no complete output; pass {overwrite} to replace it", out_dir=out)
        yield from _build_and_move(out)


def _build_and_move(out: Path) -> Iterator[Path]:
    """:func:`staged_output_dir`'s build in a temporary sibling and the move into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    os.chmod(tmp, 0o777 & ~current_umask())
    try:
        yield tmp
        make_readable(tmp)  # outputs are read by other users (an inference server, a shared cluster)
        if out.exists():
            trash = out.with_name(f".{out.name}.old-{os.getpid()}-{time.time_ns()}")
            os.replace(out, trash)
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def print_summary(summary: dict[str, Any], *, as_json: bool, human: str | None = None) -> None:
    """The result summary goes to stdout: JSON with ``--json``, else ``human`` (or key: value lines)."""
    if as_json:
        sys.stdout.write(json.dumps(summary, sort_keys=True) + "\n")
    elif human is not None:
        sys.stdout.write(human.rstrip("\n") + "\n")
    else:
        for key, value in summary.items():
            sys.stdout.write(f"{key}: {value}\n")


def fail(message: str) -> GlmpostError:
    return GlmpostError(message)
