"""One weight sync run: a training checkpoint published as a rollout version, the servers switched to it.

    check the settings -> resolve the source -> lock the rollout root -> clean stale staging
    -> convert (with progress) and publish, or find it published -> tell and confirm the servers
    -> prune (``keep``) -> the summary

The steps themselves live in :mod:`glmpost.weight_sync.convert` (:func:`resolve_source`,
:func:`convert`) and :mod:`glmpost.weight_sync.sync` (:func:`publish`, :func:`prune`,
:func:`sync_servers`); :func:`sync_weights_run` runs them in order for ``glmpost sync-weights``,
writing ``ROOT/metrics.jsonl`` and the version's ``stage.json`` and ``glmpost.json``.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

from glmpost.checkpoints import (
    LATEST,
    MANIFEST,
    CheckpointManifest,
    CheckpointRoot,
    model_folder_problem,
    read_manifest,
    tokenizer_revision,
    version_dir_name,
    write_manifest,
)
from glmpost.config import ConfigError, setting
from glmpost.errors import GlmpostError
from glmpost.kernel.fingerprint import DEFAULT_TOLERANCE, checkpoint_fingerprint
from glmpost.kernel.lora_routes import adapter_name
from glmpost.kernel.lora_versions import is_lora_version
from glmpost.kernel.sglang_client import parse_server_urls
from glmpost.locks import output_lock
from glmpost.quant.spec import GroupSizeSetting
from glmpost.stage import MetricsWriter, log, write_json_atomic, write_stage_json
from glmpost.weight_sync.convert import DTYPES, SCHEMES, ConvertResult, TrainSource, convert, resolve_source
from glmpost.weight_sync.sync import (
    clean_stale_staging,
    prune,
    publish,
    staging_dir,
    sync_servers,
    weight_version_name,
)
from glmpost.weight_sync.lora_sync import copy_lora_version, sync_lora_servers, unload_root_adapters
from glmpost.weight_sync.vllm_sync import sync_vllm_servers

STAGE = "sync-weights"


@dataclass
class SyncConfig(GroupSizeSetting):
    """The settings of one sync: the options of ``glmpost sync-weights`` (``group_size`` is the one
    ``glmpost quantize`` has too); refusals name these fields."""

    checkpoint: Optional[Path] = None  # a glmpost root or version, a Hugging Face or DeepSpeed directory
    out: Optional[Path] = None  # the rollout root: version directories vNNNNNN and LATEST
    base: Optional[Path] = setting(
        None, "For a DeepSpeed checkpoint: the checkpoint whose config.json and tokenizer files to use "
        "(default: the glmpost version directory holding it).")
    quantize: str = setting("none", f"Rollout weight quantization: {', '.join(SCHEMES)}.")
    dtype: str = setting("auto", f"Dtype of the unquantized tensors: {', '.join(DTYPES)} (auto keeps the training dtype).")
    max_shard_size: float = setting(4096.0, "Largest safetensors shard to write, in MiB.")
    server: list[str] = setting([], "Server(s) to switch, URL[,URL...] (repeatable); none = publish only.")
    retries: int = setting(3, "Extra attempts per server after a failed update or confirmation.", min=0)
    backoff: float = setting(1.0, "Seconds before a server's first retry; doubled before each further one.", min=0.0)
    timeout: float = setting(600.0, "Seconds to wait for one server answer (a weight load must fit in it).", above=0.0)
    api_key: Optional[str] = setting(None, "The servers' API key, sent as 'Authorization: Bearer KEY' (never recorded).", cli={"show_default": False})
    admin_api_key: Optional[str] = setting(
        None, "The servers' admin key (SGLang's --admin-api-key), sent instead of --api-key with update_weights_from_disk "
        "(never recorded).", cli={"show_default": False})
    abort_in_flight: bool = setting(
        True, "Abort the servers' running requests when they switch (SGLang's abort_all_requests; they answer with their "
        "partial output, which rollout continues); --wait-in-flight: the switch waits for every running request.",
        flag="--abort-in-flight/--wait-in-flight")
    keep: int = setting(0, "Keep only the newest N versions of --out (never LATEST nor a version a server reports); 0 keeps all.")
    engine: str = setting("sglang", "The servers' API: sglang (update_weights_from_disk, confirmed by the weight version it "
                          "reports) or vllm (dev-mode /pause, /collective_rpc reload_weights, /reset_prefix_cache, /resume, "
                          "confirmed by fingerprint: vLLM reports no version).")
    fingerprint_tolerance: float = setting(
        DEFAULT_TOLERANCE, "With --engine vllm: most mean |difference| between the server's prompt log-probs of a fixed "
        "sequence and the new version's (float32, CPU) for the switch to count (and nearer to it than to the previous "
        "version's).", above=0.0)

    def check(self) -> None:
        """Refuse settings that cannot work (before anything is read or written)."""
        if self.engine not in ("sglang", "vllm"):
            raise ConfigError("{engine} {value!r}: expected sglang or vllm", value=self.engine)
        if self.quantize not in SCHEMES:
            raise ConfigError("{quantize} {value!r}: expected one of {known}", value=self.quantize, known=", ".join(SCHEMES))
        if self.dtype not in DTYPES:
            raise ConfigError("{dtype} {value!r}: expected one of {known}", value=self.dtype, known=", ".join(DTYPES))
        if self.group_size is not None and self.quantize != "w4a16":
            raise ConfigError("{group_size} applies to {quantize} w4a16 only, not {value}", value=self.quantize)
        for name in ("keep", "retries"):
            if getattr(self, name) < 0:
                raise ConfigError("{%s} {value}: must be >= 0" % name, value=getattr(self, name))
        if self.max_shard_size <= 0:
            raise ConfigError("{max_shard_size} {value}: must be > 0", value=self.max_shard_size)
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError("{out} {root} exists and is not a directory", root=self.out)

    def quantization(self) -> dict[str, Any]:
        """The quantization a version is synced with (kept in its manifest; a rerun must match it)."""
        group_size = (self.group_size or 128) if self.quantize == "w4a16" else None
        return {"scheme": self.quantize, "group_size": group_size, "dtype": self.dtype}


def server_urls(values: list[str]) -> list[str]:
    """The servers of repeated ``--server URL[,URL...]`` values, each ``http(s)://HOST:PORT``."""

    items = [item for value in values for item in value.split(",") if item.strip()]
    if not items:
        return []
    urls = parse_server_urls(items)
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError("{server} {url!r}: expected http://HOST:PORT", url=url)
    return urls


def describe_quantization(quantization: dict | None) -> str:
    """A quantization as the settings that give it, for a :class:`~glmpost.config.ConfigError` message
    (``{quantize} w4a16 {group_size} 128 {dtype} auto``: a command spells the fields as its flags)."""
    def literal(value: Any) -> str:
        return str(value).replace("{", "{{").replace("}", "}}")

    q = quantization or {}
    text = "{quantize} " + literal(q.get("scheme"))
    if q.get("group_size"):
        text += " {group_size} " + literal(q["group_size"])
    return text + " {dtype} " + literal(q.get("dtype"))


def _resolve(config: SyncConfig) -> TrainSource:
    """The training checkpoint, refused when the rollout root holds it (a LoRA version: also when a
    conversion is asked for, its adapter being synced as it is)."""
    source = resolve_source(config.checkpoint, config.base)
    if source.kind == "lora" and (config.quantize != "none" or config.dtype != "auto"):
        raise ConfigError("{checkpoint} {path} is a LoRA version, synced as its adapter files as they are: leave "
                          "{quantize} none and {dtype} auto (merge it into a full version to quantize)", path=source.path)
    out = config.out
    if out.resolve() in (source.path.resolve(), *source.path.resolve().parents):
        raise ConfigError("{out} {root} holds the training checkpoint {path}; use a separate rollout root", root=out, path=source.path)
    return source


def _check_published(config: SyncConfig, source: TrainSource, target: Path) -> None:
    """``target`` exists: it must be this source synced with these settings (versions are never overwritten)."""
    before = read_manifest(target)
    done_source = before.extra.get("source", {})
    if before.stage != STAGE or done_source.get("revision") != source.revision:
        raise ConfigError("{out} {root}: {name} was published from another checkpoint ({path}); policy versions are "
                          "never overwritten", root=config.out, name=target.name, path=done_source.get("path", before.parent))
    if before.extra.get("quantization") != config.quantization():
        raise ConfigError("{out} {root}: {name} was synced with " + describe_quantization(before.extra.get("quantization"))
                          + ", now " + describe_quantization(config.quantization()) + "; use another {out}",
                          root=config.out, name=target.name)


def _check_new(config: SyncConfig, source: TrainSource, target: Path, latest: int | None) -> None:
    """``target`` may be written: no foreign directory there, and the version is not older than LATEST."""
    if target.exists():
        raise GlmpostError(f"{target} exists but has no {MANIFEST}; remove it (not written by sync-weights)")
    version = source.policy_version
    if latest is not None and version < latest:
        raise ConfigError("{checkpoint} {path} is policy version {version}, older than {root}'s LATEST v{latest:06d}; "
                          "rollout versions only move forward", path=source.path, version=version, root=config.out, latest=latest)


def _convert_into(config: SyncConfig, source: TrainSource, staging: Path, options: dict[str, Any]) -> ConvertResult:
    """Convert ``source`` into ``staging`` (progress on stderr; a LoRA version: copied as it is) with its
    manifest (a LoRA version's naming the same base) and ``stage.json``."""
    lora_base = read_manifest(source.path).lora_base if source.kind == "lora" else None
    if lora_base is not None:
        result = copy_lora_version(source, staging)
    else:
        with tqdm(desc=STAGE, unit="tensor", leave=False, disable=None, file=sys.stderr) as bar:
            result = convert(source, staging, scheme=config.quantize, group_size=config.group_size, dtype=config.dtype,
                             max_shard_bytes=int(config.max_shard_size * 2**20), progress=bar.update)
    if result.unexpected:
        log(f"{len(result.unexpected)} tensor(s) the architecture does not load were copied as they are "
            f"(first: {result.unexpected[0]})")
    manifest = CheckpointManifest(
        policy_version=source.policy_version, tokenizer_revision=tokenizer_revision(staging), stage=STAGE,
        step=source.step, parent=str(source.path),
        extra={"source": source.to_json(), "quantization": config.quantization(),
               "quantized_layers": len(result.quantized_layers), "files": result.files},
        lora_base=lora_base,
    )
    write_manifest(staging, manifest)
    write_stage_json(staging, STAGE, options, source=source.to_json())
    return result


def _write_version(config: SyncConfig, source: TrainSource, target: Path, options: dict[str, Any],
                   metrics: MetricsWriter) -> dict[str, Any]:
    """Convert into a staging directory, publish it as ``target`` and switch LATEST; the convert summary."""
    version = source.policy_version
    staging = staging_dir(config.out, version)
    log(f"{'copying' if source.kind == 'lora' else 'converting'} {source.path} ({source.kind}, policy version {version}) -> {target}"
        + (f" quantized {config.quantize}" if config.quantize != "none" else ""))
    try:
        result = _convert_into(config, source, staging, options)
        publish(config.out, staging, version)
    except BaseException:  # a failed conversion leaves nothing behind (a killed one: the next run cleans)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    metrics.write(**{"sync/policy_version": version, "sync/convert_s": round(result.seconds, 3),
                     "sync/bytes_in": result.bytes_in, "sync/bytes_out": result.bytes_out,
                     "sync/quantize": config.quantize, "sync/quantized_layers": len(result.quantized_layers),
                     **({"sync/adapter": adapter_name(target)} if source.kind == "lora" else {})})
    log(f"published {target} and switched {config.out}/LATEST to it")
    return {"convert_s": round(result.seconds, 3), "bytes_in": result.bytes_in, "bytes_out": result.bytes_out,
            "tensors": result.tensors, "quantized_layers": len(result.quantized_layers), "files": result.files}


def _sync(config: SyncConfig, urls: list[str], target: Path, version: int, *, skipped: bool,
          metrics: MetricsWriter, previous: Optional[Path] = None) -> list[dict[str, Any]]:
    """Tell every server to load ``target`` and confirm it; one metrics line per server; the rows
    (``previous``: the version ``LATEST`` named before, whose fingerprint a vLLM server must not match better)."""
    common = dict(retries=config.retries, backoff=config.backoff, timeout=config.timeout, skip_if_current=skipped,
                  api_key=config.api_key)
    if is_lora_version(target) and urls:
        results = sync_lora_servers(urls, target.resolve(), version, previous=previous, engine=config.engine,
                                    tolerance=config.fingerprint_tolerance, admin_api_key=config.admin_api_key, **common)
    elif config.engine == "vllm" and urls:
        old = checkpoint_fingerprint(previous) if previous is not None and previous != target else None
        results = sync_vllm_servers(urls, target.resolve(), weight_version_name(version), expected=checkpoint_fingerprint(target),
                                    previous=old, tolerance=config.fingerprint_tolerance, **common)
    else:
        results = sync_servers(urls, target.resolve(), weight_version_name(version), admin_api_key=config.admin_api_key,
                               abort_in_flight=config.abort_in_flight, **common)
    root = CheckpointRoot(config.out)
    if not is_lora_version(target) and any(is_lora_version(root.version_dir(v)) for v in root.versions()):
        # a full version in a root of LoRA versions: their adapters were trained on the base it replaced
        unload_root_adapters(results, config.out, engine=config.engine, timeout=config.timeout, backoff=config.backoff,
                             api_key=config.api_key, admin_api_key=config.admin_api_key)
    rows = [r.to_json() for r in results]
    for row in rows:
        metrics.write(**{"sync/policy_version": version, "sync/server": row["url"], "sync/status": row["status"],
                         "sync/version_before": row["version_before"], "sync/version_after": row["version_after"],
                         "sync/attempts": row["attempts"], "sync/server_s": row["seconds"], "sync/error": row["error"]})
    return rows


def _record_servers(target: Path, rows: list[dict[str, Any]]) -> None:
    """Add the synced vLLM servers (URL, engine, release from ``GET /version``) to the version's
    ``stage.json``, as a rollout's records its servers."""
    path = target / "stage.json"
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    payload["servers"] = [{"url": r["url"], "engine": "vllm", "version": r.get("engine_release")} for r in rows]
    write_json_atomic(path, payload)


def _prune(config: SyncConfig, rows: list[dict[str, Any]]) -> list[int]:
    """``keep``: remove old versions, never one a server reported (before or after its update)."""
    reported = {int(v) for r in rows for v in (r["version_before"], r["version_after"]) if v and str(v).isdigit()}
    removed = prune(config.out, config.keep, protect=reported)
    if removed:
        log(f"pruned {', '.join(f'v{v:06d}' for v in removed)} (--keep {config.keep})")
    return removed


def sync_weights_run(config: SyncConfig, options: dict[str, Any]) -> dict[str, Any]:
    """Publish ``config.checkpoint`` into ``config.out`` and switch ``config.server`` to it; the summary.

    ``options`` (the effective command-line options) go to the version's ``stage.json``. A version
    already published from the same source is not written again (its servers are still confirmed);
    failed servers are in the summary's ``failed_servers`` (see :func:`failed_servers_error`)."""
    config.check()
    urls = server_urls(config.server)
    source = _resolve(config)
    out = Path(config.out)
    problem = model_folder_problem(out)
    if problem:
        raise ConfigError("{out} {path} {problem}", path=out, problem=problem)
    with output_lock(out, stage="sync-weights"):
        out.mkdir(parents=True, exist_ok=True)
        return _publish_and_switch(config, urls, source, out, options)


def _publish_and_switch(config: SyncConfig, urls: list[str], source: TrainSource, out: Path,
                        options: dict[str, Any]) -> dict[str, Any]:
    """:func:`sync_weights_run` with the root's lock held."""
    version, root = source.policy_version, CheckpointRoot(out)
    with MetricsWriter(out / "metrics.jsonl") as metrics:
        stale = clean_stale_staging(out)
        if stale:
            log(f"removed staging left by an interrupted sync: {', '.join(stale)}")
        repaired = root.repair_latest()  # a sync killed between moving a version in and moving LATEST
        if repaired is not None:
            log(f"{out}: {LATEST} named {repaired[0] or 'nothing'}, but {version_dir_name(repaired[1])} was published; moved it")
        latest = root.latest()
        target = root.version_dir(version)
        convert_summary: dict[str, Any] = {}
        skipped = (target / MANIFEST).is_file()
        if skipped:
            _check_published(config, source, target)
            log(f"{target} already exists: this source was synced; nothing to write")
            if latest is None or latest < version:  # a sync killed between the rename and LATEST
                root.set_latest(version)
        else:
            _check_new(config, source, target, latest)
            convert_summary = _write_version(config, source, target, options, metrics)
        previous = root.version_dir(latest) if latest is not None and root.version_dir(latest).is_dir() else None
        rows = _sync(config, urls, target, version, skipped=skipped, metrics=metrics, previous=previous)
        if config.engine == "vllm" and rows:
            _record_servers(target, rows)
        removed = _prune(config, rows)
    return {
        "out": str(out), "version_dir": str(target), "policy_version": version,
        "weight_version": weight_version_name(version), "source": str(source.path), "source_kind": source.kind,
        "quantize": config.quantize, "skipped": skipped, **convert_summary, "servers": rows,
        **({"adapter": adapter_name(target)} if source.kind == "lora" else {}),
        "failed_servers": [r["url"] for r in rows if r["status"] == "failed"], "pruned": removed,
    }


def server_table(rows: list[dict[str, Any]]) -> str:
    """The per-server results as an aligned text table."""
    headers = ["server", "status", "before", "after", "attempts", "seconds", "error"]
    cells = [[r["url"], r["status"], str(r["version_before"]), str(r["version_after"]), str(r["attempts"]),
              f"{r['seconds']:.2f}", r["error"] or ""] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def sync_report(summary: dict[str, Any]) -> str:
    """The human-readable summary of :func:`sync_weights_run`: the version, the servers, what was pruned."""
    action = "already published (skipped)" if summary["skipped"] else (
        f"published from {summary['source']} ({summary['quantize']}, {summary['bytes_in'] / 2**20:.2f} MiB -> "
        f"{summary['bytes_out'] / 2**20:.2f} MiB in {summary['convert_s']:.2f} s)")
    text = f"{summary['version_dir']}: policy version {summary['policy_version']} {action}"
    if summary["servers"]:
        text += "\n" + server_table(summary["servers"])
    if summary["pruned"]:
        text += f"\npruned: {', '.join(f'v{v:06d}' for v in summary['pruned'])}"
    return text


def failed_servers_error(summary: dict[str, Any]) -> GlmpostError | None:
    """The error naming the first server that is not on the new weight version, or None when all are."""
    failed = [r for r in summary["servers"] if r["status"] == "failed"]
    if not failed:
        return None
    first = failed[0]
    more = f" (and {len(failed) - 1} more server(s))" if len(failed) > 1 else ""
    return GlmpostError(f"server {first['url']} is not on weight version {summary['weight_version']} after "
                        f"{first['attempts']} attempt(s): {first['error']}{more}")


__all__ = [
    "STAGE",
    "SyncConfig",
    "describe_quantization",
    "failed_servers_error",
    "server_table",
    "server_urls",
    "sync_report",
    "sync_weights_run",
]
