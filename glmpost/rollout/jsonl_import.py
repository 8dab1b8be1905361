"""One ``glmpost shards import`` run: a file of records or text conversations as trajectory shards.

The file is JSONL, parquet, CSV or a JSON array, or a ``datasets`` directory (read row by row, its
columns mapped: :mod:`glmpost.formats.sources`). A line (row) is a record in the JSON form ``glmpost shards cat`` prints, or a text conversation (``prompt``
or chat ``messages``, an optional reference ``response``) that the checkpoint's tokenizer and chat
template encode (:func:`glmpost.formats.prompts.conversation_record`). Records go into shards of
``records_per_shard`` in the caller's staging directory, one ``metrics.jsonl`` line per shard and a
summary line at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

from glmpost.config import ConfigError, section, setting, shared
from glmpost.errors import GlmpostError
from glmpost.formats import ShardWriter, record_from_json
from glmpost.formats.chat_format import template_kwargs
from glmpost.formats.prompts import conversation_record, parse_prompt_line
from glmpost.formats.sources import ColumnsConfig, source_rows
from glmpost.kernel.loading import load_tokenizer
from glmpost.stage import MetricsWriter, write_stage_json

STAGE = "shards.import"


@dataclass
class ImportConfig:
    """The settings of one import: the options of ``glmpost shards import``; refusals name these fields."""

    source: Optional[Path] = None  # the JSONL, parquet, CSV or JSON file, or datasets directory
    out: Optional[Path] = None  # the shard directory (the caller stages it)
    checkpoint: Optional[Path] = setting(
        None, "Checkpoint (root or version) whose tokenizer and chat template encode text lines.")
    records_per_shard: int = setting(1024, "Records in each output shard.", min=1)
    columns: ColumnsConfig = section(ColumnsConfig)
    chat_template_kwargs: str = shared("chat_template_kwargs")
    zstd_level: int = shared("zstd_level")
    overwrite: bool = shared("overwrite")


class JsonlImport:
    """One import: building it loads the tokenizer (with ``checkpoint``); :meth:`write` writes the
    shards into a staging directory and returns the counts."""

    def __init__(self, config: ImportConfig):
        self.config = config
        self.tokenizer = self.revision = None
        if config.checkpoint is not None:
            self.tokenizer, self.revision = load_tokenizer(config.checkpoint)
        self.template_kwargs = template_kwargs(config.chat_template_kwargs)

    def write(self, staging: Path, options: dict[str, Any]) -> dict[str, int]:
        """Every line (row) of ``source`` as a record in shards under ``staging``, with ``metrics.jsonl`` and
        ``stage.json`` (recording ``options``); the counts (records, shards, prompt and response tokens)."""
        c = self.config
        counts = {"records": 0, "shards": 0, "prompt_tokens": 0, "response_tokens": 0}
        writer: ShardWriter | None = None
        shard_records = 0
        with MetricsWriter(staging / "metrics.jsonl") as metrics:

            def close_shard() -> None:
                writer.close()
                metrics.write(shard=writer.path.name, records=shard_records)
                counts["shards"] += 1

            try:
                rows = source_rows(c.source, c.columns)
                for where, default_id, obj in tqdm(rows, desc="import", unit="rec", leave=False, disable=None):
                    record = self._record(obj, where=where, default_id=default_id)
                    if writer is None:
                        writer = ShardWriter(staging / f"shard-{counts['shards']:05d}.msgpack.zst", stage=STAGE, options=options,
                                             tokenizer_revision=record["tokenizer_revision"], level=c.zstd_level)
                        shard_records = 0
                    try:
                        writer.write(record)
                    except GlmpostError as exc:
                        raise GlmpostError(f"{where}: {exc}") from None
                    counts["records"] += 1
                    counts["prompt_tokens"] += len(record["prompt_token_ids"])
                    counts["response_tokens"] += len(record["response_token_ids"])
                    shard_records += 1
                    if shard_records == c.records_per_shard:
                        close_shard()
                        writer = None
                if writer is not None:
                    close_shard()
                    writer = None
            finally:
                if writer is not None:
                    writer.abort()
            if counts["records"] == 0:
                raise GlmpostError(f"{c.source}: no records (the file is empty)")
            metrics.write(summary=True, **counts)
        write_stage_json(staging, STAGE, options, **counts)
        return counts

    def _record(self, obj: Any, *, where: str, default_id: str) -> dict[str, Any]:
        """The record of one line: a JSON-form record as it is (its tokenizer revision checked), or a
        text conversation encoded with the checkpoint's tokenizer."""
        if isinstance(obj, dict) and "prompt_token_ids" in obj:
            try:
                record = record_from_json(obj)
            except GlmpostError as exc:
                raise GlmpostError(f"{where}: {exc}") from None
            if self.revision is not None and record.get("tokenizer_revision") != self.revision:
                raise ConfigError("{where}: tokenizer revision {theirs} differs from {checkpoint}'s {revision}", where=where,
                                  theirs=record.get("tokenizer_revision"), revision=self.revision, exit_code=1)
            return record
        if self.tokenizer is None:
            raise ConfigError("{where}: a text line needs {checkpoint} (its tokenizer and chat template encode the text)",
                              where=where)
        item = parse_prompt_line(obj, where=where, default_id=default_id)
        return conversation_record(item, self.tokenizer, self.revision, self.template_kwargs)


def import_summary(out: Path, counts: dict[str, int]) -> tuple[dict[str, Any], str]:
    """``(summary, human line)`` of an import."""
    human = (f"{out}: {counts['records']} records in {counts['shards']} shard(s), "
             f"{counts['prompt_tokens']} prompt + {counts['response_tokens']} response tokens")
    return {"out": str(out), **counts}, human
