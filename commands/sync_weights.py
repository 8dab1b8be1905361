"""Publish a training checkpoint as a rollout checkpoint and switch the rollout servers to it.

Training shards -> inference shards -> quantization -> send -> atomic switch -> confirmation: the
training checkpoint (a glmpost root or version, a Hugging Face directory, or a DeepSpeed ZeRO
checkpoint with --base for its config and tokenizer) is converted to Hugging Face safetensors
shards, optionally quantized for rollout (--quantize fp8-block or w4a16, the same quantizer as
`glmpost quantize`), written into a hidden staging directory of the rollout root --out, fsynced,
renamed to vNNNNNN (the source's policy version) and only then is LATEST switched atomically. Each
--server is told update_weights_from_disk(model_path=VERSION_DIR, weight_version=POLICY_VERSION)
and the sync is confirmed by reading the server's weight version back; a server that fails or
still reports the old version is retried (--retries, --backoff), then reported, and the command
exits 1 naming it. A version already published from the same source is not written again (its
servers are still confirmed). --keep N prunes old versions (never LATEST). Per-server results go to
stdout (--json) and to ROOT/metrics.jsonl.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import List, Optional

import typer
from tqdm import tqdm

from glmpost.checkpoints import (
    MANIFEST,
    CheckpointManifest,
    CheckpointRoot,
    read_manifest,
    tokenizer_revision,
    write_manifest,
)
from glmpost.commands.common import config_option, effective_options, print_summary
from glmpost.errors import GlmpostError, UsageError
from glmpost.serving.convert import DTYPES, SCHEMES, convert, resolve_source
from glmpost.serving.sync import (
    clean_stale_staging,
    prune,
    publish,
    root_lock,
    staging_dir,
    sync_servers,
    weight_version_name,
)
from glmpost.stage import MetricsWriter, log, write_stage_json

STAGE = "sync-weights"


def _server_urls(values: List[str]) -> list[str]:
    from glmpost.serving.sglang_client import parse_server_urls

    items = [item for value in values for item in value.split(",") if item.strip()]
    if not items:
        return []
    urls = parse_server_urls(items)
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise UsageError(f"--server {url!r}: expected http://HOST:PORT")
    return urls


def _describe(quantization: dict | None) -> str:
    q = quantization or {}
    text = f"--quantize {q.get('scheme')}"
    if q.get("group_size"):
        text += f" --group-size {q['group_size']}"
    return text + f" --dtype {q.get('dtype')}"


def _table(results: list[dict]) -> str:
    headers = ["server", "status", "before", "after", "attempts", "seconds", "error"]
    rows = [[r["url"], r["status"], str(r["version_before"]), str(r["version_after"]), str(r["attempts"]),
             f"{r['seconds']:.2f}", r["error"] or ""] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def sync_weights(
    ctx: typer.Context,
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Training checkpoint: a glmpost root (LATEST) or version directory, a Hugging Face directory, or a DeepSpeed checkpoint directory (save dir with 'latest', or a tag dir)."),
    out: Path = typer.Option(..., "--out", help="Rollout checkpoint root: version directories vNNNNNN and LATEST (created)."),
    base: Optional[Path] = typer.Option(None, "--base", help="For a DeepSpeed checkpoint: the checkpoint whose config.json and tokenizer files to use (default: the glmpost version directory holding it)."),
    quantize: str = typer.Option("none", "--quantize", help=f"Rollout weight quantization: {', '.join(SCHEMES)}."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="w4a16 group size along the input dim (default 128)."),
    dtype: str = typer.Option("auto", "--dtype", help=f"Dtype of the unquantized tensors: {', '.join(DTYPES)} (auto keeps the training dtype)."),
    max_shard_size: float = typer.Option(4096.0, "--max-shard-size", help="Largest safetensors shard to write, in MiB."),
    server: List[str] = typer.Option([], "--server", help="Server(s) to switch, URL[,URL...] (repeatable); none = publish only."),
    retries: int = typer.Option(3, "--retries", help="Extra attempts per server after a failed update or confirmation."),
    backoff: float = typer.Option(1.0, "--backoff", help="Seconds before a server's first retry; doubled before each further one."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait for one server answer (a weight load must fit in it)."),
    keep: int = typer.Option(0, "--keep", help="Keep only the newest N versions of --out (never LATEST nor a version a server reports); 0 keeps all."),
    as_json: bool = typer.Option(False, "--json", help="Print the result summary as JSON."),
    config: Optional[Path] = config_option(),
) -> None:
    if quantize not in SCHEMES:
        raise UsageError(f"--quantize {quantize!r}: expected one of {', '.join(SCHEMES)}")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if group_size is not None and quantize != "w4a16":
        raise UsageError(f"--group-size applies to --quantize w4a16 only, not {quantize}")
    for flag, value in (("--keep", keep), ("--retries", retries)):
        if value < 0:
            raise UsageError(f"{flag} {value}: must be >= 0")
    if max_shard_size <= 0:
        raise UsageError(f"--max-shard-size {max_shard_size}: must be > 0")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    urls = _server_urls(server)
    source = resolve_source(checkpoint, base)
    if out.resolve() in (source.path.resolve(), *source.path.resolve().parents):
        raise UsageError(f"--out {out} holds the training checkpoint {source.path}; use a separate rollout root")
    options = effective_options(ctx)
    root = CheckpointRoot(out)
    version = source.policy_version
    weight_version = weight_version_name(version)
    quantization = {"scheme": quantize, "group_size": (group_size or 128) if quantize == "w4a16" else None, "dtype": dtype}

    with root_lock(out), MetricsWriter(out / "metrics.jsonl") as metrics:
        stale = clean_stale_staging(out)
        if stale:
            log(f"removed staging left by an interrupted sync: {', '.join(stale)}")
        latest = root.latest()
        target = root.version_dir(version)
        convert_summary: dict = {}
        if (target / MANIFEST).is_file():
            before = read_manifest(target)
            done_source = before.extra.get("source", {})
            if before.stage != STAGE or done_source.get("revision") != source.revision:
                raise UsageError(f"--out {out}: {target.name} was published from another checkpoint "
                                 f"({done_source.get('path', before.parent)}); policy versions are never overwritten")
            if before.extra.get("quantization") != quantization:
                raise UsageError(f"--out {out}: {target.name} was synced with {_describe(before.extra.get('quantization'))}, "
                                 f"now {_describe(quantization)}; use another --out")
            log(f"{target} already exists: this source was synced; nothing to write")
            skipped = True
            if latest is None or latest < version:  # a sync killed between the rename and LATEST
                root.set_latest(version)
        else:
            if target.exists():
                raise GlmpostError(f"{target} exists but has no {MANIFEST}; remove it (not written by sync-weights)")
            if latest is not None and version < latest:
                raise UsageError(f"--checkpoint {source.path} is policy version {version}, older than {out}'s LATEST "
                                 f"v{latest:06d}; rollout versions only move forward")
            skipped = False
            staging = staging_dir(out, version)
            log(f"converting {source.path} ({source.kind}, policy version {version}) -> {target}"
                + (f" quantized {quantize}" if quantize != "none" else ""))
            try:
                with tqdm(desc=STAGE, unit="tensor", leave=False, disable=None, file=sys.stderr) as bar:
                    result = convert(source, staging, scheme=quantize, group_size=group_size, dtype=dtype,
                                     max_shard_bytes=int(max_shard_size * 2**20), progress=bar.update)
                if result.unexpected:
                    log(f"{len(result.unexpected)} tensor(s) the architecture does not load were copied as they are "
                        f"(first: {result.unexpected[0]})")
                manifest = CheckpointManifest(
                    policy_version=version, tokenizer_revision=tokenizer_revision(staging), stage=STAGE,
                    step=source.step, parent=str(source.path),
                    extra={"source": source.to_json(), "quantization": quantization,
                           "quantized_layers": len(result.quantized_layers), "files": result.files},
                )
                write_manifest(staging, manifest)
                write_stage_json(staging, STAGE, options, source=source.to_json())
                publish(out, staging, version)
            except BaseException:  # a failed conversion leaves nothing behind (a killed one: the next run cleans)
                shutil.rmtree(staging, ignore_errors=True)
                raise
            convert_summary = {"convert_s": round(result.seconds, 3), "bytes_in": result.bytes_in,
                               "bytes_out": result.bytes_out, "tensors": result.tensors,
                               "quantized_layers": len(result.quantized_layers), "files": result.files}
            metrics.write(**{"sync/policy_version": version, "sync/convert_s": round(result.seconds, 3),
                             "sync/bytes_in": result.bytes_in, "sync/bytes_out": result.bytes_out,
                             "sync/quantize": quantize, "sync/quantized_layers": len(result.quantized_layers)})
            log(f"published {target} and switched {out}/LATEST to it")

        results = sync_servers(urls, target.resolve(), weight_version, retries=retries, backoff=backoff,
                               timeout=timeout, skip_if_current=skipped)
        rows = [r.to_json() for r in results]
        for row in rows:
            metrics.write(**{"sync/policy_version": version, "sync/server": row["url"], "sync/status": row["status"],
                             "sync/version_before": row["version_before"], "sync/version_after": row["version_after"],
                             "sync/attempts": row["attempts"], "sync/server_s": row["seconds"], "sync/error": row["error"]})
        reported = {int(v) for r in rows for v in (r["version_before"], r["version_after"]) if v and str(v).isdigit()}
        removed = prune(out, keep, protect=reported)
        if removed:
            log(f"pruned {', '.join(f'v{v:06d}' for v in removed)} (--keep {keep})")

    failed = [r for r in rows if r["status"] == "failed"]
    summary = {
        "out": str(out), "version_dir": str(target), "policy_version": version, "weight_version": weight_version,
        "source": str(source.path), "source_kind": source.kind, "quantize": quantize, "skipped": skipped,
        **convert_summary, "servers": rows, "failed_servers": [r["url"] for r in failed], "pruned": removed,
    }
    action = "already published (skipped)" if skipped else (
        f"published from {source.path} ({quantize}, {convert_summary['bytes_in'] / 2**20:.2f} MiB -> "
        f"{convert_summary['bytes_out'] / 2**20:.2f} MiB in {convert_summary['convert_s']:.2f} s)")
    human = f"{target}: policy version {version} {action}"
    if rows:
        human += "\n" + _table(rows)
    if removed:
        human += f"\npruned: {', '.join(f'v{v:06d}' for v in removed)}"
    print_summary(summary, as_json=as_json, human=human)
    if failed:
        first = failed[0]
        more = f" (and {len(failed) - 1} more server(s))" if len(failed) > 1 else ""
        raise GlmpostError(f"server {first['url']} is not on weight version {weight_version} after "
                           f"{first['attempts']} attempt(s): {first['error']}{more}")

