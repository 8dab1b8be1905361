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
import time
from pathlib import Path
from typing import Optional

import typer

from glmpost.commands.common import config_option
from glmpost.errors import UsageError
from glmpost.npu import resolve_device
from glmpost.stage import MetricsWriter, log

STAGE = "serve"


def serve(
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Checkpoint to serve: a root (its LATEST) or a version directory."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback by default; 0.0.0.0 exposes it)."),
    port: int = typer.Option(30000, "--port", min=0, max=65535, help="TCP port; 0 picks a free one (printed when ready)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda[:N] or npu[:N]."),
    batch_size: int = typer.Option(32, "--batch-size", min=1, help="Most sequences decoded together in one engine batch."),
    batch_wait_ms: float = typer.Option(
        50.0, "--batch-wait-ms", min=0.0,
        help="Most time the engine waits for as many single requests as its last batch had before it starts a batch.",
    ),
    weight_version: Optional[str] = typer.Option(
        None, "--weight-version", help="Initial weight_version reported; default: the checkpoint's policy version."
    ),
    deterministic_topk: bool = typer.Option(
        True, "--deterministic-topk/--torch-topk",
        help="DSA indexer top-k with ties to the lower position (as rollout and training); --torch-topk keeps torch.topk's tie order.",
    ),
    log_requests: bool = typer.Option(False, "--log-requests", help="Log every HTTP request to stderr."),
    metrics: Optional[Path] = typer.Option(
        None, "--metrics", dir_okay=False,
        help="Append the server's counters to this JSONL file every --metrics-interval seconds and at stop.",
    ),
    metrics_interval: float = typer.Option(10.0, "--metrics-interval", min=0.1, help="Seconds between --metrics lines."),
    config: Optional[Path] = config_option(),
) -> None:
    from glmpost.serving.http_server import bound_address, make_http_server, serve_until_signalled
    from glmpost.serving.server import EngineServer

    metrics_writer = None
    if metrics is not None:
        try:
            metrics_writer = MetricsWriter(metrics)
        except OSError as exc:
            raise UsageError(f"--metrics {metrics}: cannot open for appending ({exc.strerror or exc})") from None
    torch_device = resolve_device(device)
    engine = EngineServer(checkpoint, device=torch_device, batch_size=batch_size, deterministic_topk=deterministic_topk,
                          weight_version=weight_version, batch_wait_s=batch_wait_ms / 1000.0)
    try:
        server = make_http_server(engine, host, port, quiet=not log_requests)
    except OSError as exc:
        raise UsageError(f"--host {host} --port {port}: cannot listen ({exc.strerror or exc})") from None
    bound_host, bound_port = bound_address(server)
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host

    def ready() -> None:
        log(f"serving {engine.loaded.version_dir} (weight_version {engine.weight_version}, tokenizer "
            f"{engine.loaded.revision}) on {torch_device}, batch size {batch_size}")
        sys.stdout.write(f"glmpost serve: listening on http://{shown}:{bound_port}\n")
        sys.stdout.flush()

    started = time.monotonic()
    last = {"time": started, "generated_tokens": 0}

    def write_metrics(final: bool) -> None:
        now, stats = time.monotonic(), dict(engine.stats)
        interval = max(now - last["time"], 1e-9)
        try:
            metrics_writer.write(
                **{f"serve/{k}": (round(v, 6) if isinstance(v, float) else v) for k, v in stats.items()},
                **{"serve/uptime_s": round(now - started, 3), "serve/weight_version": engine.weight_version,
                   "serve/tokens_per_s": round((stats["generated_tokens"] - last["generated_tokens"]) / interval, 3),
                   "serve/final": final},
            )
        except OSError as exc:  # a full disk must not take the server down
            log(f"--metrics {metrics}: cannot write ({exc.strerror or exc}); serving on")
        last.update(time=now, generated_tokens=stats["generated_tokens"])

    try:
        serve_until_signalled(engine, server, on_ready=ready, on_tick=write_metrics if metrics_writer else None,
                              tick_s=metrics_interval)
    finally:
        if metrics_writer is not None:
            metrics_writer.close()
    stats = engine.stats
    log(f"stopped after {stats['batches']} engine batches, {stats['sequences']} sequences, "
        f"{stats['generated_tokens']} generated tokens")
