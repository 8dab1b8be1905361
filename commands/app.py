"""The ``glmpost`` command: one typer app, one module per stage."""

from __future__ import annotations

import sys

import click
import typer

from glmpost import __version__
from glmpost.commands import init_model, shards
from glmpost.errors import GlmpostError

app = typer.Typer(
    name="glmpost",
    help=(
        "GLM-style post-training beyond SFT as Unix-style stages. Each stage reads and writes "
        "trajectory shards or checkpoints, so shell or Slurm scripts chain them and any stage can "
        "be rerun on saved shards. Exit codes: 0 done, 1 the work failed, 2 the invocation was wrong."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"glmpost {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(
        False, "--version", help="Print the glmpost version and exit.", is_eager=True, callback=_print_version
    ),
) -> None:
    """GLM-style post-training beyond SFT as Unix-style stages."""


app.command("init-model", help=init_model.__doc__)(init_model.init_model)
app.add_typer(shards.app, name="shards")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors become one line on stderr and an exit code, never a traceback."""
    try:
        app(args=argv, prog_name="glmpost")
    except GlmpostError as exc:
        sys.stderr.write(f"glmpost: error: {exc}\n")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("glmpost: interrupted\n")
        sys.exit(130)
    except click.exceptions.Exit as exc:  # pragma: no cover - typer normally handles this
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
