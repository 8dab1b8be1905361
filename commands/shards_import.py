"""Turn a JSONL file into trajectory shards.

Each line is either a record in the JSON form `glmpost shards cat` prints (token ids as lists, NaN
as null), or a text conversation: `prompt` or chat `messages`, an optional reference `response`,
`domain`, `task`, `id`. Text lines need --checkpoint: the prompt is rendered with its chat template
and the response tokenized as the model would emit it (then end-of-text); every token of the
response is marked as an action. Use it to bring data from other tools into glmpost, or SFT data
for `glmpost qat`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from tqdm import tqdm

from glmpost.checkpoints import load_tokenizer
from glmpost.commands.common import (
    config_option,
    effective_options,
    print_summary,
    staged_output_dir,
)
from glmpost.commands.options import json_option
from glmpost.errors import GlmpostError, UsageError
from glmpost.formats import ShardWriter, record_from_json
from glmpost.rollout.prompts import conversation_record, parse_prompt_line, read_jsonl
from glmpost.stage import MetricsWriter, log, write_stage_json

STAGE = "shards.import"


def shards_import(
    ctx: typer.Context,
    source: Path = typer.Argument(..., help="JSONL file: JSON-form records, or prompt/messages + response text.", dir_okay=False),
    out: Path = typer.Option(..., "--out", help="Output directory of shards (created; never silently replaced)."),
    checkpoint: Optional[Path] = typer.Option(
        None, "--checkpoint", help="Checkpoint (root or version) whose tokenizer and chat template encode text lines."
    ),
    records_per_shard: int = typer.Option(1024, "--records-per-shard", min=1, help="Records in each output shard."),
    zstd_level: int = typer.Option(3, "--zstd-level", min=1, max=22, help="zstd compression level of the shards."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
) -> None:
    """Turn a JSONL file of records or text conversations into trajectory shards."""
    tokenizer = revision = None
    if checkpoint is not None:
        tokenizer, revision = load_tokenizer(checkpoint)
    options = effective_options(ctx)
    counts = {"records": 0, "shards": 0, "prompt_tokens": 0, "response_tokens": 0}
    with staged_output_dir(out, overwrite=overwrite, complete_marker="stage.json", stage=STAGE,
                           options=options, ctx=ctx) as staging:
        if staging is None:
            log(f"{out} is already complete; nothing to do (--overwrite replaces it)")
            print_summary({"out": str(out), "skipped": True}, as_json=as_json, human=f"{out}: already complete (skipped)")
            return
        writer: ShardWriter | None = None
        with MetricsWriter(staging / "metrics.jsonl") as metrics:
            try:
                for where, obj in tqdm(read_jsonl(source), desc="import", unit="rec", leave=False, disable=None):
                    record = _to_record(obj, where=where, tokenizer=tokenizer, revision=revision, line_id=where)
                    if writer is None:
                        name = f"shard-{counts['shards']:05d}.msgpack.zst"
                        writer = ShardWriter(
                            staging / name, stage=STAGE, options=options,
                            tokenizer_revision=record["tokenizer_revision"], level=zstd_level,
                        )
                        shard_records = 0
                    try:
                        writer.write(record)
                    except GlmpostError as exc:
                        raise GlmpostError(f"{where}: {exc}") from None
                    counts["records"] += 1
                    counts["prompt_tokens"] += len(record["prompt_token_ids"])
                    counts["response_tokens"] += len(record["response_token_ids"])
                    shard_records += 1
                    if shard_records == records_per_shard:
                        writer.close()
                        metrics.write(shard=writer.path.name, records=shard_records)
                        counts["shards"] += 1
                        writer = None
                if writer is not None:
                    writer.close()
                    metrics.write(shard=writer.path.name, records=shard_records)
                    counts["shards"] += 1
                    writer = None
            finally:
                if writer is not None:
                    writer.abort()
            if counts["records"] == 0:
                raise GlmpostError(f"{source}: no records (the file is empty)")
            metrics.write(summary=True, **counts)
        write_stage_json(staging, STAGE, options, **counts)
    summary = {"out": str(out), **counts}
    human = (
        f"{out}: {counts['records']} records in {counts['shards']} shard(s), "
        f"{counts['prompt_tokens']} prompt + {counts['response_tokens']} response tokens"
    )
    print_summary(summary, as_json=as_json, human=human)


def _to_record(obj: Any, *, where: str, tokenizer, revision: str | None, line_id: str) -> dict[str, Any]:
    if isinstance(obj, dict) and "prompt_token_ids" in obj:
        try:
            record = record_from_json(obj)
        except GlmpostError as exc:
            raise GlmpostError(f"{where}: {exc}") from None
        if revision is not None and record.get("tokenizer_revision") != revision:
            raise GlmpostError(
                f"{where}: tokenizer revision {record.get('tokenizer_revision')} differs from --checkpoint's {revision}"
            )
        return record
    if tokenizer is None:
        raise UsageError(f"{where}: a text line needs --checkpoint (its tokenizer and chat template encode the text)")
    stem = Path(where.rsplit(":", 1)[0]).stem
    item = parse_prompt_line(obj, where=where, default_id=f"{stem}-{where.rsplit(':', 1)[1]}")
    return conversation_record(item, tokenizer, revision)
