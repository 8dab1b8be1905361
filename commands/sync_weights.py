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
exits 1 naming it. Servers started with an API key need --api-key KEY (never recorded). A version
already published from the same source is not written again (its servers are still confirmed).
--keep N prunes old versions (never LATEST). --engine vllm switches vLLM servers instead:
/pause?mode=wait, /collective_rpc reload_weights(weights_path=VERSION_DIR), /reset_prefix_cache,
/resume (dev-mode routes: VLLM_SERVER_DEV_MODE=1, not behind --api-key, so loopback or a private
network only); vLLM reports no version, so the switch is confirmed by fingerprint: the server's
prompt log-probs of a fixed sequence within --fingerprint-tolerance (mean |difference|) of the new
version's, computed on CPU in float32 and kept as glmpost-fingerprint.json in the version directory,
and nearer to them than to the previous version's. A LoRA version is published as it is (its adapter,
never the base) and loaded on each server as the adapter ROOTNAME-vNNNNNN (vLLM /v1/load_lora_adapter:
--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; SGLang /load_lora_adapter: --enable-lora) once
the server's base is confirmed by fingerprint to be the adapter's; the adapter is confirmed the same
way and the root's previous adapters unloaded. Per-server results go to stdout (--json) and to
ROOT/metrics.jsonl.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from glmpost.commands.common import config_option, effective_options, print_summary
from glmpost.commands.options import config_from, json_option, with_config
from glmpost.kernel.sglang_client import check_api_key, without_api_key
from glmpost.weight_sync.run import SyncConfig, failed_servers_error, sync_report, sync_weights_run


@with_config(SyncConfig)
def sync_weights(
    ctx: typer.Context,
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Training checkpoint: a glmpost root (LATEST) or version directory, a Hugging Face directory, or a DeepSpeed checkpoint directory (save dir with 'latest', or a tag dir)."),
    out: Path = typer.Option(..., "--out", help="Rollout checkpoint root: version directories vNNNNNN and LATEST (created)."),
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
    **settings: Any,
) -> None:
    api_key = ctx.params["api_key"]
    check_api_key(api_key)  # before anything is published
    check_api_key(ctx.params.get("admin_api_key"), "admin_api_key")
    summary = sync_weights_run(config_from(ctx, SyncConfig), without_api_key(effective_options(ctx)))
    print_summary(summary, as_json=as_json, human=sync_report(summary))
    error = failed_servers_error(summary)
    if error is not None:
        raise error
