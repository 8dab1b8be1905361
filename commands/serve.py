"""Serve a checkpoint over the subset of SGLang's native HTTP API that glmpost uses.

POST /generate: input_ids (one list or a batch), rid (echoed as meta_info.id; a batch's string RID
becomes RID_0, RID_1, ..., or pass a list), return_logprob, logprob_start_len, top_logprobs_num,
return_text_in_logprobs (log-prob entries [logprob, id, token text]), and sampling_params:
max_new_tokens (0 scores the input only), temperature, top_p, top_k, stop_token_ids, ignore_eos,
sampling_seed, stop (a string or a list: the response ends at the token after which its decoded
text contains one; finish_reason {"type": "stop", "matched": "STRING"}; output_ids keep that token
and text is cut before the stop unless no_stop_trim). skip_special_tokens,
spaces_between_special_tokens, stream_interval and custom_params are accepted and ignored;
penalties, min_p, min_new_tokens, n and grammars are refused unless at their defaults.
POST /update_weights_from_disk (model_path, weight_version, flush_cache, abort_all_requests; a
checkpoint of another architecture or tokenizer revision, or with missing tensors, is refused and
the old weights stay), GET /get_weight_version, GET /model_info (model path, weight version,
tokenizer revision), GET /health, GET /server_info (also /get_server_info: the model info,
enable_deterministic_inference true, log_prob_kind, version, and counters since start: requests,
engine batches, sequences, generated tokens, cached tokens, seconds the engine was busy).
Answers are shaped as SGLang shapes them, so `rollout --engine sglang`, `score-teacher` and
`sync-weights` work against this server and real SGLang servers alike.

--log-prob-kind says what output log-probs are log-probs of (greedy requests always get raw):
sampled (default; the distribution sampled from, what --engine local records), tempered (SGLang's
default), raw, top_p_renormalized. --api-key KEY makes every route but /health answer HTTP 401
{"error": "Unauthorized"} unless the request carries `Authorization: Bearer KEY`; the key is never
logged.

--api vllm serves the vLLM OpenAI-server routes glmpost uses instead (a stand-in for vLLM, shaped as
its source shapes them): POST /v1/completions (token-id prompt, max_tokens default 16, temperature,
top_p, top_k, seed, stop_token_ids, ignore_eos, logprobs, prompt_logprobs, return_token_ids,
return_tokens_as_token_ids; penalties, min_p, n, echo, stream, stop strings and grammars refused),
GET /v1/models, and the dev-mode routes GET /server_info (logprobs_mode, VLLM_BATCH_INVARIANT),
POST /collective_rpc (reload_weights), /reset_prefix_cache, /pause, /resume, GET /is_paused.
--logprobs-mode raw_logprobs (kind raw) or processed_logprobs (kind sampled) replaces
--log-prob-kind; --max-logprobs caps logprobs and prompt_logprobs per position as vLLM's does
(default 20; -1: the vocabulary); --api-key then guards only /v1, /v2 and /inference, as vLLM's does.

One engine thread runs the model: concurrent requests are batched (up to --batch-size); a batch
request runs exactly as the in-process engine runs the same list, so with the same seeds the server
reproduces `rollout --engine local` bit for bit. The KV caches of the last --prefix-cache-batches
engine batches are kept: a request whose input_ids extend a cached sequence (the next turn of a
multi-turn trajectory) prefills only its new tokens, as SGLang's radix cache does, and its
meta_info.cached_tokens says how many it read (same tokens; log-probs within float rounding of a
full prefill). Listens on loopback by default; --port 0 picks a
free port. When ready it prints one line `glmpost serve: listening on http://HOST:PORT` to stdout.
SIGTERM or SIGINT stops it cleanly (queued requests, and connections still in the listen backlog, are answered with HTTP 503 and Retry-After; none is reset). --metrics FILE
appends the counters as JSONL (serve/requests, serve/batches, serve/sequences,
serve/generated_tokens, serve/cached_tokens, serve/engine_busy_s, serve/tokens_per_s over the interval,
serve/weight_version, serve/uptime_s) every --metrics-interval seconds and once at stop.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from glmpost.commands.common import config_option
from glmpost.commands.options import config_from, with_config
from glmpost.server.http import ServeConfig, serve_checkpoint

STAGE = "serve"


@with_config(ServeConfig)
def serve(
    ctx: typer.Context,
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Checkpoint to serve: a root (its LATEST) or a version directory."),
    config: Optional[Path] = config_option(),
    **settings: Any,
) -> None:
    def listening(url: str) -> None:
        sys.stdout.write(f"glmpost serve: listening on {url}\n")
        sys.stdout.flush()

    serve_checkpoint(config_from(ctx, ServeConfig), on_listening=listening)
