"""``glmpost shards``: look into trajectory shards (inspect, verify, cat, head).

Every subcommand takes PATH... arguments: shard files, directories (their ``*.msgpack.zst``
files) and globs. A bad shard stops the command with one line naming the file and the record
(exit 1); an input that matches nothing is a usage error (exit 2).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Iterable, Iterator, List, Optional

import typer
from tqdm import tqdm

from glmpost.commands.common import print_summary
from glmpost.errors import UsageError
from glmpost.formats import FIELDS, ShardReader, record_to_json, resolve_shard_paths
from glmpost.formats.inspection import DatasetStats

app = typer.Typer(
    name="shards",
    help=(
        "Look into trajectory shards (*.msgpack.zst): summarise, verify, print as JSON lines. "
        "PATH arguments are shard files, directories of shards or globs."
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)

PATHS_HELP = "Shard files, directories of shards (*.msgpack.zst inside) or globs."
FIELDS_HELP = (
    "Comma-separated record fields to print, e.g. --fields id,reward,status (default: all). "
    f"Known: {', '.join(FIELDS)}."
)


def _progress(items: list, desc: str) -> Iterable:
    """A progress bar on stderr, shown only on a terminal and only for more than one shard."""
    return tqdm(items, desc=desc, unit="shard", file=sys.stderr, leave=False, disable=None if len(items) > 1 else True)


def _human_inspect(stats: dict[str, Any]) -> str:
    n = stats["records"]
    everywhere = [name for name, count in stats["fields"].items() if count == n]
    some = [f"{name} {count}/{n}" for name, count in stats["fields"].items() if count != n]
    tokens = stats["tokens"]
    lines = [
        f"{stats['input']}: {stats['shards']} shards, {n} records",
        f"  stages:      {_counts(stats['stages'])}",
        f"  tokenizer:   {', '.join(stats['tokenizer_revisions'])}",
        f"  fields:      {', '.join(everywhere) or '-'}" + (f"; partly: {', '.join(some)}" if some else ""),
        f"  tokens:      prompt {tokens['prompt']}, response {tokens['response']} "
        f"(action {tokens['action']}, observation {tokens['observation']})"
        + (f"; {tokens['retokenize_drift']} action tokens a text round trip would change" if "retokenize_drift" in tokens else ""),
        f"  status:      {_counts(stats['status']) or '-'}",
    ]
    reward = stats["reward"]
    if reward is not None:
        line = f"  reward:      n {reward['n']}, failed {reward['failed']}"
        if "mean" in reward:
            line += f", mean {reward['mean']:.4g}, std {reward['std']:.4g}, min {reward['min']:.4g}, max {reward['max']:.4g}"
        lines.append(line)
    if stats["policy_versions"] is not None:
        lines.append(f"  policy versions: {stats['policy_versions']['min']}..{stats['policy_versions']['max']}")
    if stats["compaction"]["compacted"]:
        lines.append(_human_compaction(stats["compaction"], n))
    return "\n".join(lines)


def _human_compaction(compaction: dict[str, Any], n: int) -> str:
    histogram = ", ".join(f"{count}: {records}" for count, records in compaction["per_trajectory"].items())
    line = (
        f"  compaction:  {compaction['compacted']}/{n} records compacted, {compaction['compactions']} compactions; "
        f"compactions per trajectory {{{histogram}}}; summary tokens {compaction['summary_tokens']}"
    )
    peak = compaction["peak_context"]
    if peak is not None:
        line += f"; peak context mean {peak['mean']:.4g}, max {peak['max']}"
    return line


def _counts(counter: dict[str, int]) -> str:
    return ", ".join(f"{key} {count}" for key, count in counter.items())


@app.command("inspect")
def inspect(
    paths: List[str] = typer.Argument(..., help=PATHS_HELP, metavar="PATH"),
    as_json: bool = typer.Option(False, "--json", help='Print {"datasets": [...]} as JSON instead of text.'),
) -> None:
    """Summarise each PATH as a dataset: shards, records, fields present, token counts
    (prompt/response/action/observation; for multi-turn records the action tokens naive
    re-tokenization would change), status counts, reward mean/std/min/max, policy-version
    range of action tokens, tokenizer revisions, producing stages and, where records were
    compacted (rollout --compaction), compactions per trajectory, summary tokens and peak
    context. Reads (and so verifies) every record."""
    datasets = []
    for item in paths:
        stats = DatasetStats(input=item)
        for path in _progress(resolve_shard_paths([item]), desc=f"inspect {item}"):
            stats.add_shard(ShardReader(path))
        datasets.append(stats.to_json())
    human = "\n".join(_human_inspect(d) for d in datasets)
    print_summary({"datasets": datasets}, as_json=as_json, human=human)


# --------------------------------------------------------------------------------------------
# verify


@app.command("verify")
def verify(
    paths: List[str] = typer.Argument(..., help=PATHS_HELP, metavar="PATH"),
    as_json: bool = typer.Option(False, "--json", help='Print {"ok": true, "shards": N, "records": M} as JSON.'),
) -> None:
    """Read every shard completely: header, every record against the schema, footer record count,
    checksum and the end of the zstd frame. Prints "ok: N shards, M records" and exits 0, or exits
    1 with one line naming the first bad file and record."""
    shard_paths = resolve_shard_paths(paths)
    records = 0
    for path in _progress(shard_paths, desc="verify"):
        for _ in ShardReader(path):
            records += 1
    summary = {"ok": True, "shards": len(shard_paths), "records": records}
    print_summary(summary, as_json=as_json, human=f"ok: {len(shard_paths)} shards, {records} records")


# --------------------------------------------------------------------------------------------
# cat, head


def _parse_fields(fields: Optional[str]) -> Optional[list[str]]:
    if fields is None:
        return None
    names = [name.strip() for name in fields.split(",") if name.strip()]
    unknown = [name for name in names if name not in FIELDS]
    if not names or unknown:
        raise UsageError(f"--fields {fields!r}: unknown field(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(FIELDS)}")
    return names


def _json_lines(records: Iterator[dict[str, Any]], fields: Optional[list[str]]) -> Iterator[str]:
    for record in records:
        if fields is not None:
            record = {name: record[name] for name in fields if name in record}
        yield json.dumps(record_to_json(record), allow_nan=False, separators=(",", ":"))


def _records(paths: list[str]) -> Iterator[dict[str, Any]]:
    for path in resolve_shard_paths(paths):
        yield from ShardReader(path)


def _write_lines(lines: Iterable[str]) -> None:
    """Write to stdout; a reader that stops early (``| head``) ends the command quietly."""
    try:
        for line in lines:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        raise typer.Exit(0)


@app.command("cat")
def cat(
    paths: List[str] = typer.Argument(..., help=PATHS_HELP, metavar="PATH"),
    fields: Optional[str] = typer.Option(None, "--fields", help=FIELDS_HELP),
) -> None:
    """Print every record as one JSON object per line (the JSON form of formats/SPEC.md §10:
    arrays as lists, NaN as null), validating each record and each shard's footer."""
    _write_lines(_json_lines(_records(paths), _parse_fields(fields)))


@app.command("head")
def head(
    paths: List[str] = typer.Argument(..., help=PATHS_HELP, metavar="PATH"),
    n: int = typer.Option(5, "-n", "--records", min=0, help="Number of records to print."),
    fields: Optional[str] = typer.Option(None, "--fields", help=FIELDS_HELP),
) -> None:
    """Print the first N records (default 5) as JSON lines, like `cat`; reads only as far as needed."""
    def first(records: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for i, record in enumerate(records):
            if i >= n:
                return
            yield record

    _write_lines(_json_lines(first(_records(paths)), _parse_fields(fields)))


# --------------------------------------------------------------------------------------------
# import: `glmpost shards import` (commands/shards_import.py, built on formats.record_from_json) is
# registered here by the lead, e.g.:
#     app.command("import")(shards_import.shards_import)
