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

from pathlib import Path
from typing import List, Optional

import typer

from glmpost.commands.common import config_option, effective_options, print_summary
from glmpost.commands.options import json_option
from glmpost.serving.convert import DTYPES, SCHEMES
from glmpost.serving.weight_sync import SyncConfig, failed_servers_error, sync_report, sync_weights_run


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
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
) -> None:
    settings = SyncConfig(
        checkpoint=checkpoint, out=out, base=base, quantize=quantize, group_size=group_size, dtype=dtype,
        max_shard_size=max_shard_size, server=list(server), retries=retries, backoff=backoff, timeout=timeout,
        keep=keep,
    )
    summary = sync_weights_run(settings, effective_options(ctx))
    print_summary(summary, as_json=as_json, human=sync_report(summary))
    error = failed_servers_error(summary)
    if error is not None:
        raise error
