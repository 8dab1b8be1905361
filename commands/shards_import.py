"""Turn a JSONL, parquet, CSV or JSON file, or a Hugging Face datasets directory, into trajectory shards.

Each line (row) is either a record in the JSON form `glmpost shards cat` prints (token ids as lists, NaN
as null), or a text conversation: `prompt` or chat `messages`, an optional reference `response`,
`domain`, `task`, `id`. Text lines need --checkpoint: the prompt is rendered with its chat template
and the response tokenized as the model would emit it (then end-of-text); every token of the
response is marked as an action. Use it to bring data from other tools into glmpost, or SFT data
for `glmpost qat`.

A .parquet file is streamed batch by batch; a .csv file or a .json file holding one JSON array is
read through the `datasets` library, a directory `Dataset.save_to_disk` wrote is memory-mapped
(these need `pip install 'glmpost[data]'`); any other file is JSONL. --prompt-column,
--messages-column, --answer-column (into the task's answer), --domain-column and --task-column name
the columns (keys) to read; a missing one is an error naming the file and the column.
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
from glmpost.rollout.jsonl_import import STAGE, ImportConfig, JsonlImport, import_summary


@with_config(ImportConfig)
def shards_import(
    ctx: typer.Context,
    source: Path = typer.Argument(..., help="JSONL, parquet, CSV or JSON file, or datasets directory: JSON-form records, "
                                  "or prompt/messages + response text."),
    out: Path = typer.Option(..., "--out", help="Output directory of shards (created; never silently replaced)."),
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
    **settings: Any,
) -> None:
    overwrite = ctx.params["overwrite"]
    """Turn a file (or datasets directory) of records or text conversations into trajectory shards."""
    run = JsonlImport(config_from(ctx, ImportConfig))
    options = effective_options(ctx)
    with staged_output_dir(out, overwrite=overwrite, complete_marker="stage.json", stage=STAGE,
                           options=options) as staging:
        if staging is None:
            report_skipped(out, as_json=as_json, holds="is already complete")
            return
        counts = run.write(staging, options)
    summary, human = import_summary(out, counts)
    print_summary(summary, as_json=as_json, human=human)
