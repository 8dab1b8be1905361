"""Serve a checkpoint over the subset of SGLang's native HTTP API that glmpost uses.

POST /generate (input_ids, sampling_params with sampling_seed, return_logprob, logprob_start_len,
top_logprobs_num; max_new_tokens 0 scores the input only), POST /update_weights_from_disk
(model_path, weight_version, flush_cache, abort_all_requests; a checkpoint of another architecture
or tokenizer revision, or with missing tensors, is refused and the old weights stay), GET
/get_weight_version, GET /model_info (model path, weight version, tokenizer revision), GET /health,
GET /get_server_info (the model info and counters since start: requests, engine batches,
sequences, generated tokens, seconds the engine was busy).
Answers are shaped as SGLang shapes them, so `rollout --engine sglang`, `score-teacher` and
`sync-weights` work against this server and real SGLang servers alike.

One engine thread runs the model: concurrent requests are batched (up to --batch-size); a batch
request runs exactly as the in-process engine runs the same list, so with the same seeds the server
reproduces `rollout --engine local` bit for bit. Listens on loopback by default; --port 0 picks a
free port. When ready it prints one line `glmpost serve: listening on http://HOST:PORT` to stdout.
SIGTERM or SIGINT stops it cleanly (queued requests are answered with HTTP 503). --metrics FILE
appends the counters as JSONL (serve/requests, serve/batches, serve/sequences,
serve/generated_tokens, serve/engine_busy_s, serve/tokens_per_s over the interval,
serve/weight_version, serve/uptime_s) every --metrics-interval seconds and once at stop.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from glmpost.commands.common import config_option
from glmpost.commands.options import config_from, option
from glmpost.serving.http_server import ServeConfig, serve_checkpoint

STAGE = "serve"


def serve(
    ctx: typer.Context,
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Checkpoint to serve: a root (its LATEST) or a version directory."),
    host: str = option(ServeConfig, "host"),
    port: int = option(ServeConfig, "port"),
    device: str = option(ServeConfig, "device"),
    batch_size: int = option(ServeConfig, "batch_size"),
    batch_wait_ms: float = option(ServeConfig, "batch_wait_ms"),
    weight_version: Optional[str] = option(ServeConfig, "weight_version"),
    deterministic_topk: bool = option(ServeConfig, "deterministic_topk"),
    log_requests: bool = option(ServeConfig, "log_requests"),
    metrics: Optional[Path] = option(ServeConfig, "metrics", dir_okay=False),
    metrics_interval: float = option(ServeConfig, "metrics_interval"),
    config: Optional[Path] = config_option(),
) -> None:
    def listening(url: str) -> None:
        sys.stdout.write(f"glmpost serve: listening on {url}\n")
        sys.stdout.flush()

    serve_checkpoint(config_from(ctx, ServeConfig), on_listening=listening)
