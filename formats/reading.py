"""Reading a stage's input shards: every record, read through and checked, in one place.

Each stage that consumes records needs the same guarantees before it computes anything: the shards
are complete (footers, checksums), each record has the fields the stage needs (a missing one names
the stage that produces it) and was tokenized with the tokenizer revision the stage's checkpoint
has (token ids mean nothing under another tokenizer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from glmpost.errors import GlmpostError
from glmpost.formats.datasets import resolve_shard_paths
from glmpost.formats.schema import require_fields
from glmpost.formats.shard_reader import ShardReader


def iter_checked_records(
    inputs: Sequence[str | Path],
    *,
    revision: str,
    stage: str,
    require: Sequence[str] = (),
    check: Callable[[dict[str, Any], str], None] | None = None,
) -> Iterator[tuple[dict[str, Any], str]]:
    """``(record, where)`` for every record of the shards ``inputs`` (files, directories or globs).

    ``where`` (``"STAGE: PATH: record N"``) starts every error about the record. Each record must
    carry ``require`` and have tokenizer revision ``revision``; ``check(record, where)`` adds the
    stage's own rule (it raises to refuse).
    """
    for path in resolve_shard_paths(list(inputs)):
        for index, record in enumerate(ShardReader(path)):
            where = f"{stage}: {path}: record {index}"
            require_fields(record, require, where=where)
            if check is not None:
                check(record, where)
            if record["tokenizer_revision"] != revision:
                raise GlmpostError(
                    f"{where}: tokenizer revision {record['tokenizer_revision']} differs from the checkpoint's {revision}"
                )
            yield record, where


def read_checked_records(inputs: Sequence[str | Path], **kwargs: Any) -> list[dict[str, Any]]:
    """Every record :func:`iter_checked_records` yields; an input without records is an error."""
    records = [record for record, _ in iter_checked_records(inputs, **kwargs)]
    if not records:
        raise GlmpostError(f"{kwargs['stage']}: no records in {' '.join(map(str, inputs))}")
    return records
