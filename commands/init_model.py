"""Build a tiny GLM-5-architecture checkpoint and its locally trained tokenizer (no download).

The output directory is a normal Hugging Face checkpoint (AutoModelForCausalLM and AutoTokenizer
load it) plus glmpost.json (policy version 0). The same --seed gives byte-identical files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from glmpost.commands.common import (
    config_option,
    effective_options,
    print_summary,
    report_skipped,
    staged_output_dir,
)
from glmpost.commands.options import config_from, json_option, with_config
from glmpost.models.tiny import STAGE, InitModelConfig, init_model_run


@with_config(InitModelConfig)
def init_model(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="Directory to write the checkpoint into (created; never silently replaced)."),
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
    **settings: Any,
) -> None:
    overwrite = ctx.params["overwrite"]
    init = config_from(ctx, InitModelConfig)
    settings = init.model_settings()
    options = effective_options(ctx)
    with staged_output_dir(out, overwrite=overwrite, complete_marker="glmpost.json", stage=STAGE,
                           options=options) as staging:
        if staging is None:
            report_skipped(out, as_json=as_json)
            return
        summary, human = init_model_run(init, settings, staging, options)
    print_summary(summary, as_json=as_json, human=human)
