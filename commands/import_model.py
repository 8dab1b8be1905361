"""Make a checkpoint root from a Hugging Face model folder (`save_pretrained` output), to train it
version after version: ROOT/v000000 holds the folder's files and a glmpost.json naming the source,
ROOT/LATEST names it. The files are hard links by default (no bytes copied; where the file system
cannot link, copies), or --link symbolic / copy. Then `--checkpoint ROOT --out ROOT` trains it: each
training stage publishes v000001, v000002, ... beside it. A root already imported from the same
folder with the same options is left as it is; --overwrite imports it again. The root holds
stage.json, v000000 holds metrics.jsonl.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from glmpost.checkpoints import CheckpointRoot
from glmpost.commands.common import config_option, effective_options, print_summary, report_skipped, staged_output_dir
from glmpost.commands.options import config_from, json_option, with_config
from glmpost.config import ConfigError
from glmpost.model_import import STAGE, ImportModelConfig, import_model_run


@with_config(ImportModelConfig)
def import_model(
    ctx: typer.Context,
    source: Path = typer.Argument(..., help="The Hugging Face model folder (config.json, weights, tokenizer files)."),
    out: Path = typer.Option(..., "--out", help="The checkpoint root to create (v000000 and LATEST)."),
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
    **settings: Any,
) -> None:
    options = effective_options(ctx)
    trained = [v for v in CheckpointRoot(out).versions() if v > 0]
    if ctx.params["overwrite"] and trained:
        raise ConfigError("{out} %s holds trained versions (v%06d ... v%06d): importing again over it would delete them; "
                          "import into another directory" % (out, trained[0], trained[-1]))
    with staged_output_dir(out, overwrite=ctx.params["overwrite"], complete_marker="LATEST", stage=STAGE, options=options) as staging:
        if staging is None:
            report_skipped(out, as_json=as_json, holds=f"already holds the import of {source}", redo="imports it again",
                           done="already imported")
            return
        summary = import_model_run(source, staging, config_from(ctx, ImportModelConfig), options)
    placed = ", ".join(f"{count} {how}" for how, count in sorted(summary["placed"].items()))
    print_summary({"out": str(out), **summary}, as_json=as_json, human=(
        f"{out}: v000000 from {source} ({summary['files']} files, {summary['bytes'] / 1e6:,.1f} MB: {placed}); "
        f"train it with --checkpoint {out} --out {out}"))
