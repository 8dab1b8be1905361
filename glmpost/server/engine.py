"""``glmpost serve``: the embedded engine behind the subset of SGLang's native HTTP API glmpost uses.

DESIGN.md §6 ("rollout / teacher engine: in-process torch engine, also served over HTTP by
``glmpost serve`` with SGLang's native API"); the brief's weight-sync chain "发送 → 原子切换 → 确认"
ends in ``/update_weights_from_disk`` and a read of the weight version.

Endpoints and shapes follow SGLang (python/sglang/srt/entrypoints/http_server.py for the routes and
the ``update_weights_from_disk`` answer; managers/io_struct.py ``GenerateReqInput``;
managers/tokenizer_manager.py ``detokenize_logprob_tokens`` / ``convert_logprob_style`` for
``meta_info``; managers/scheduler ``_process_input_token_logprobs`` for the leading ``None``;
managers/schedule_batch.py ``FINISH_*.to_json`` for ``finish_reason``):

* ``POST /generate``: ``input_ids`` (one list or a batch), ``sampling_params`` (a dict or one per
  sequence: ``max_new_tokens`` (0 = prefill-only scoring), ``temperature``, ``top_p``, ``top_k``,
  ``stop_token_ids``, ``stop`` (a string or a list: the sequence stops once its decoded output
  contains one; ``finish_reason`` ``{"type": "stop", "matched": "STRING"}``), ``ignore_eos``,
  ``sampling_seed``, ``no_stop_trim`` (``text`` keeps the matched stop); ``skip_special_tokens``,
  ``spaces_between_special_tokens``, ``stream_interval``, ``custom_params`` accepted and ignored;
  penalties, ``min_p``, ``min_new_tokens``, ``n``, grammars, ``logit_bias`` and ``stop_regex``
  refused unless at their defaults (None is every key's default); a key SGLang 0.5.23 lacks is
  answered as its contract check answers, HTTP 400 ``{"error": "unknown field `X`, expected one of
  ..."}``), a request id still in flight is HTTP 400 ``Duplicate request ID detected: RID``,
  ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``, ``return_text_in_logprobs``
  (entries ``[logprob, id, token_text]``), ``rid`` (echoed as ``meta_info["id"]``; a batch's string
  ``RID`` as ``RID_0``, ``RID_1``, ..., or a list, one per sequence), ``return_routed_experts``
  (MoE models: ``meta_info.routed_experts``). Answer per sequence ``{"text", "output_ids",
  "meta_info"}`` (:mod:`glmpost.server.answers`).
* ``POST /update_weights_from_disk``: ``model_path``, ``weight_version``, ``flush_cache``,
  ``abort_all_requests`` (the queued and running requests stop first, answered ``abort`` with their
  partial output); answer ``{"success", "message", "num_paused_requests"}`` (HTTP 400 when
  refused; the old weights stay).
* ``POST /abort_request``: ``rid`` (a batch's ``rid`` stops each ``rid_i``) or ``abort_all``; a
  queued sequence answers at once, a running one after its current decode step, each with
  ``finish_reason`` ``{"type": "abort", "message", "status_code", "err_type"}`` and the tokens it has.
* ``GET /get_weight_version``, ``/model_info``, ``/health``; ``/server_info`` (``/get_server_info``):
  the model info, ``enable_deterministic_inference`` (always true), ``log_prob_kind``, ``version``
  (glmpost's) and counters since start.
* ``POST /load_lora_adapter``, ``/unload_lora_adapter``, ``GET /v1/models`` and ``lora_path`` per request
  (``--enable-lora``): :mod:`glmpost.server.adapters`.
* Keys: :mod:`glmpost.server.http` (SGLang's ``--api-key`` and ``--admin-api-key`` rules).

One worker thread owns the :class:`~glmpost.kernel.engine.LocalEngine`; HTTP threads only parse, queue and
wait. Concurrent single-sequence requests are merged into one engine batch (up to ``batch_size``); a
batch request runs as its own batch(es), exactly as the in-process engine would run the same list,
so ``rollout --engine sglang`` reproduces ``--engine local`` bit for bit. Weight swaps happen between
batches. Output log-probs are of the server's ``log_prob_kind`` (:mod:`glmpost.kernel.distribution`;
by default ``tempered``, as SGLang's: ``log_softmax(z / T)`` before top-k and top-p; greedy requests
``raw``); input log-probs are the model's own (temperature 1), by the trainer's formula.

This module holds :class:`EngineServer` (the routes, the queue, aborts); the worker loop, request
batching and weight swaps are :mod:`glmpost.server.worker`; parsing is :mod:`glmpost.server.parsing`,
answers :mod:`glmpost.server.answers`, HTTP :mod:`glmpost.server.http`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from http import HTTPStatus
from pathlib import Path
from typing import Any

from glmpost import __version__
from glmpost.kernel.distribution import DEFAULT_LOG_PROB_KIND, check_log_prob_kind
from glmpost.kernel.engine import Completion
from glmpost.server.answers import sequence_answer
from glmpost.server.adapters import NOT_ENABLED, ServedAdapters
from glmpost.server.loading import LoadedCheckpoint, load_checkpoint
from glmpost.server.parsing import RequestError, SequenceRequest, parse_generate
from glmpost.server.worker import ARRIVAL_GAP_S, EngineWorker, Job


class EngineServer(EngineWorker):
    """The worker that owns the engine, and the request handling behind the HTTP routes."""

    def __init__(self, checkpoint: str | Path, *, device: Any = "cpu", batch_size: int = 32, deterministic_topk: bool = True,
                 weight_version: str | None = None, batch_wait_s: float = 0.05, log_prob_kind: str = DEFAULT_LOG_PROB_KIND,
                 prefix_cache_batches: int = 0, attention: str = "native", max_queued: int = 1024,
                 enable_lora: bool = False):
        self.device = device
        self.max_queued = max_queued
        self.attention = attention
        self.log_prob_kind = check_log_prob_kind(log_prob_kind)
        self.batch_size = batch_size
        self.deterministic_topk = deterministic_topk
        self.batch_wait_s = batch_wait_s
        self.prefix_cache_batches = prefix_cache_batches
        self.loaded = load_checkpoint(checkpoint, device=device, batch_size=batch_size, deterministic_topk=deterministic_topk,
                                      prefix_cache_batches=prefix_cache_batches, attention=attention)
        self.weight_version = weight_version if weight_version is not None else (
            str(self.loaded.policy_version) if self.loaded.policy_version is not None else "default")
        self.adapters = ServedAdapters(self._adapted, enabled=enable_lora)
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._inflight = 0  # single-sequence generate requests received and not yet answered
        self._last_merged = 1  # sequences in the last merged batch of single requests
        # Most single requests in flight at once while the last batch ran, and during the current
        # one: the number of clients that will send again within milliseconds of being answered.
        self._recent_peak = 1
        self._peak_now = 0
        self._last_arrival = 0.0
        self._running: list[SequenceRequest] = []  # the batch the worker runs now
        self._rids: set[str] = set()  # request ids received and not yet answered (SGLang's rid_to_state)
        self._worker = threading.Thread(target=self._work, name="glmpost-serve-engine", daemon=True)
        # Counters since start (GET /get_server_info): requests answered, engine batches, sequences
        # and tokens generated, prompt tokens read from the prefix cache, and the seconds the engine
        # spent running batches.
        self.started = int(time.time())
        self.stats = {"requests": 0, "batches": 0, "sequences": 0, "generated_tokens": 0, "cached_tokens": 0,
                      "engine_busy_s": 0.0}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._worker.start()

    @property
    def queued(self) -> int:
        """Requests waiting for the engine (at most ``max_queued``)."""
        return len(self._queue)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            pending = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for job in pending:
            job.error = RequestError("server is shutting down", 503)
            job.done.set()
        if self._worker.ident is not None:  # started
            self._worker.join(timeout=30)

    def submit(self, job: Job) -> Any:
        with self._cond:
            if self._stopping:
                raise RequestError("server is shutting down", 503)
            if len(self._queue) >= self.max_queued:
                raise RequestError(f"{len(self._queue)} requests are waiting for the engine (--max-queued); retry", 503)
            self._queue.append(job)
            self._last_arrival = time.perf_counter()
            self._cond.notify()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    # ------------------------------------------------------------------ routes

    def model_info(self) -> dict:
        loaded = self.loaded

        return {
            "model_path": str(loaded.version_dir),
            "tokenizer_path": str(loaded.version_dir),
            "is_generation": True,
            "weight_version": self.weight_version,
            "model_type": loaded.config.get("model_type"),
            "architectures": loaded.config.get("architectures"),
            "tokenizer_revision": loaded.revision,
            "policy_version": loaded.policy_version,
            "vocab_size": loaded.config.get("vocab_size"),
            "max_position_embeddings": loaded.config.get("max_position_embeddings"),
            "engine": "glmpost-serve",
            "engine_version": __version__,
            "batch_size": self.batch_size,
            "device": str(self.device),
        }

    def generate(self, body: dict) -> Any:
        items, batch = parse_generate(body, self.loaded, log_prob_kind=self.log_prob_kind)
        names = body.get("lora_path")  # SGLang: an adapter's name, or one per sequence of a batch
        if names is not None:
            names = names if isinstance(names, list) else [names] * len(items)
            if len(names) != len(items):
                raise RequestError(f"lora_path: {len(names)} entries for {len(items)} sequences")
            for item, name in zip(items, names):
                item.target = self.adapters.resolve(name)
        rids = self._hold_rids(items)
        try:
            if batch:
                return self.submit(Job("generate", items, batch=True))
            with self._cond:
                self._inflight += 1
                self._peak_now = max(self._peak_now, self._inflight)
            try:
                return self.submit(Job("generate", items))[0]
            finally:
                with self._cond:
                    self._inflight -= 1
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._rids.difference_update(rids)

    def _hold_rids(self, items: list[SequenceRequest]) -> list[str]:
        """Register the request ids of ``items`` until they are answered, refusing one still held as
        SGLang does: HTTP 400 ``Duplicate request ID detected: RID`` (an aborted request's id is held
        until its abort is answered; managers/tokenizer_manager.py ``_init_req_state``, sglang 0.5.23)."""
        rids = [item.rid for item in items if item.rid is not None]
        with self._cond:
            held = next((rid for rid in rids if rid in self._rids), None)
            if held is not None:
                raise RequestError(f"Duplicate request ID detected: {held}")
            self._rids.update(rids)
        return rids

    def server_info(self) -> dict:
        """``GET /server_info`` (and ``/get_server_info``): what ``/model_info`` says, the settings
        clients read (``enable_deterministic_inference``: a sequence's tokens and log-probs are a
        function of its ``sampling_seed``; ``log_prob_kind``; ``version``; glmpost's ``attention`` path)
        and the counters since start."""

        stats = {**self.stats, "engine_busy_s": round(self.stats["engine_busy_s"], 6)}
        # quantization: SGLang's launch flag (serve has none); what was loaded is /model_info.model_path's config.
        return {**self.model_info(), "quantization": None, "enable_deterministic_inference": True,
                "log_prob_kind": self.log_prob_kind,
                "version": __version__, "attention": self.attention, "batch_wait_s": self.batch_wait_s, "stats": stats}

    def abort_request(self, body: Any) -> int:
        """``POST /abort_request``: ``rid`` (a string) or ``abort_all`` (SGLang's ``AbortReq``)."""
        if not isinstance(body, dict) or not (isinstance(body.get("rid"), str) or body.get("abort_all") is True):
            raise RequestError("abort_request needs rid (a string) or abort_all true")
        message = body.get("abort_message") or "Abort by /abort_request"
        return self.abort(body.get("rid") if not body.get("abort_all") else None, abort_all=body.get("abort_all") is True,
                          message=str(message))

    def update_weights_from_disk(self, body: dict) -> tuple[int, dict]:
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str) or not body["model_path"]:
            raise RequestError("update_weights_from_disk needs model_path (a checkpoint directory)")
        version = body.get("weight_version")
        job = Job("update", {"model_path": body["model_path"], "weight_version": None if version is None else str(version)})
        if body.get("abort_all_requests", False):  # SGLang: the running requests stop too, their partial output answered
            self.abort(abort_all=True, message="Abort by update_weights_from_disk")
        answer = self.submit(job)
        return (HTTPStatus.OK if answer["success"] else HTTPStatus.BAD_REQUEST), answer

    # ------------------------------------------------------------------ LoRA adapters (glmpost.server.adapters)

    def _adapted(self, path: str) -> LoadedCheckpoint:
        """The served weights with the adapter folder ``path`` applied (unmerged)."""
        return load_checkpoint(self.loaded.version_dir, device=self.device, batch_size=self.batch_size,
                               deterministic_topk=self.deterministic_topk, prefix_cache_batches=self.prefix_cache_batches,
                               attention=self.attention, adapter=path)

    def load_lora_adapter(self, body: Any) -> tuple[int, dict]:
        """SGLang's ``POST /load_lora_adapter``: ``{success, error_message, loaded_adapters}``, 400 when refused."""
        body = body if isinstance(body, dict) else {}
        problem = self.adapters.load(body.get("lora_name"), body.get("lora_path"))
        answer = {"success": problem is None, "error_message": problem or "", "loaded_adapters": self.adapters.paths()}
        return (HTTPStatus.OK if problem is None else HTTPStatus.BAD_REQUEST), answer

    def unload_lora_adapter(self, body: Any) -> tuple[int, dict]:
        """SGLang's ``POST /unload_lora_adapter``: the name dropped at once, its requests in flight finish on it."""
        name = body.get("lora_name") if isinstance(body, dict) else None
        problem = NOT_ENABLED if not self.adapters.enabled else (
            None if self.adapters.unload(name) else f"LoRA with name {name} does not exist. Loaded LoRAs: "
            f"odict_keys({list(self.adapters.paths())})")
        answer = {"success": problem is None, "error_message": problem or "", "loaded_adapters": self.adapters.paths()}
        return (HTTPStatus.OK if problem is None else HTTPStatus.BAD_REQUEST), answer

    def model_list(self) -> dict:
        """SGLang's ``GET /v1/models``: the served model's card, then one per adapter held."""
        name = str(self.loaded.version_dir)
        base = {"id": name, "object": "model", "created": self.started, "owned_by": "sglang", "root": name, "parent": None,
                "max_model_len": self.loaded.config.get("max_position_embeddings")}
        return {"object": "list", "data": [base, *self.adapters.cards(name, self.started, "sglang")]}

    def abort(self, rid: str | None = None, *, abort_all: bool = False, message: str = "Abort by /abort_request") -> int:
        """Stop request ``rid`` (a batch's sequences ``rid_i`` too), or every generate request
        (``abort_all``), as SGLang's ``/abort_request`` does: one still queued is answered at once,
        one running stops after its current decode step; either answers ``finish_reason`` ``abort``
        with the output it has. Returns the sequences told to stop."""

        def chosen(item: SequenceRequest) -> bool:
            return abort_all or (rid is not None and item.rid is not None
                                 and (item.rid == rid or item.rid.startswith(f"{rid}_")))

        with self._cond:
            queued = [j for j in self._queue if j.kind == "generate" and any(chosen(it) for it in j.payload)]
            for job in queued:
                self._queue.remove(job)
            running = [it for it in self._running if chosen(it)]
            for item in running + [it for job in queued for it in job.payload]:
                item.abort_message = message
        for job in queued:  # never started: answered now, every sequence of the job aborted
            job.result = [sequence_answer(it, Completion([], [], "abort"), None, tokenizer=self.loaded.tokenizer,
                                          weight_version=self.weight_version, latency=0.0) for it in job.payload]
            job.done.set()
        return len(running) + sum(len(job.payload) for job in queued)


__all__ = ["ARRIVAL_GAP_S", "EngineServer", "Job"]
