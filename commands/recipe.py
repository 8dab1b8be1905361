"""Check a TOML recipe before any stage runs (`glmpost recipe check FILE`).

A recipe has one section per stage, named after its command (`[rollout]`, `[train-grpo]`,
`[shards.import]`, ...), whose keys are that command's options (see `glmpost STAGE --help`), plus
an optional `[pipeline]` section. The check reads the options from the command tree itself, so it
knows every stage glmpost has, and reports each problem as one line naming the file, the section
and the key (exit 2): an unknown section or key (with the known ones), a value the option's type
refuses (a string for an integer, a choice not allowed, a number out of range, a scalar where a
list is expected), an input file that does not exist (data files such as *.jsonl, *.json, *.parquet, *.csv and
DeepSpeed configs; relative paths are resolved against the current directory, as the stages
resolve them), trainer settings out of range, and batch arithmetic that does not divide.
"""

from __future__ import annotations

from pathlib import Path

import typer

from glmpost.commands.common import print_summary
from glmpost.commands.options import json_option
from glmpost.commands.recipe_checks import PIPELINE_SECTION, check_recipe
from glmpost.errors import UsageError
from glmpost.toml import load_recipe

app = typer.Typer(
    name="recipe",
    help="Work with TOML recipes: `glmpost recipe check FILE` validates one before any stage runs.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)


@app.command("check", help=__doc__)
def check(
    ctx: typer.Context,
    recipe: Path = typer.Argument(..., help="The TOML recipe to check.", dir_okay=False),
    ranks: int | None = typer.Option(
        None, "--ranks", min=1,
        help="Data-parallel ranks the training stages run on, for the batch arithmetic. Default: [pipeline] train-ranks x train-nodes, else 1."),
    as_json: bool = json_option(),
) -> None:
    import sys

    report = check_recipe(recipe, ranks=ranks, root=ctx.find_root().command)
    for warning in report.warnings:
        sys.stderr.write(f"glmpost: warning: {warning}\n")
    if report.errors:
        for error in report.errors[:-1]:
            sys.stderr.write(f"glmpost: error: {error}\n")
        raise UsageError(report.errors[-1])
    stages = ", ".join(f"{name} ({len(values)} option{'s' if len(values) != 1 else ''})" for name, values in report.stages.items())
    extra = " + [pipeline]" if PIPELINE_SECTION in load_recipe(recipe) else ""
    human = f"{recipe}: ok: {len(report.stages)} stage(s): {stages or 'none'}{extra}"
    if report.warnings:
        human += f"; {len(report.warnings)} warning(s)"
    print_summary(report.to_dict(), as_json=as_json, human=human)

