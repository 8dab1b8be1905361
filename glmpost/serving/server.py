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
  ``stop_token_ids``, ``ignore_eos``, ``sampling_seed``), ``return_logprob``, ``logprob_start_len``,
  ``top_logprobs_num``. Answer per sequence ``{"text", "output_ids", "meta_info"}``.
* ``POST /update_weights_from_disk``: ``model_path``, ``weight_version``, ``flush_cache``,
  ``abort_all_requests``; answer ``{"success", "message", "num_paused_requests"}`` (HTTP 400 when
  refused; the old weights stay).
* ``GET /get_weight_version``, ``GET /model_info``, ``GET /health``; ``GET /get_server_info``: the
  model info, and counters since start (requests, engine batches, sequences, generated tokens,
  seconds the engine was busy).

One worker thread owns the :class:`~glmpost.rollout.engine.LocalEngine`; HTTP threads only parse, queue and
wait. Concurrent single-sequence requests are merged into one engine batch (up to ``batch_size``); a
batch request runs as its own batch(es), exactly as the in-process engine would run the same list,
so ``rollout --engine sglang`` reproduces ``--engine local`` bit for bit. Weight swaps happen between
batches. Output log-probs are those of the distribution sampled from (temperature, top-k, top-p; as
``rollout_log_probs``); input log-probs are the model's own (temperature 1), by the trainer's formula.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from glmpost.rollout.engine import LocalEngine, SamplingParams, Scores
from glmpost.errors import GlmpostError

# Sampling parameters that would change the output if honoured; refused unless at SGLang's default.
_UNSUPPORTED_DEFAULTS = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                         "min_new_tokens": 0, "min_p": 0.0, "n": 1, "json_schema": None, "regex": None, "ebnf": None,
                         "stop": None}
_KNOWN = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "sampling_seed",
          "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "custom_params",
          *_UNSUPPORTED_DEFAULTS}


class RequestError(Exception):
    """A request the server refuses (HTTP 4xx) with a one-line message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class _Item:
    """One sequence of a /generate request."""

    prompt: list[int]
    params: SamplingParams  # max_new_tokens may be 0 here (prefill only)
    seed: int
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    result: dict | None = None


@dataclass
class _Job:
    kind: str  # "generate" or "update"
    payload: Any
    batch: bool = False  # a batch request: run as its own engine batch(es), never merged
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    started: float = field(default_factory=time.perf_counter)


@dataclass
class _Loaded:
    engine: LocalEngine
    tokenizer: Any
    version_dir: Path
    revision: str
    policy_version: int | None
    config: dict
    tensors: dict[str, tuple[int, ...]]


def model_tensors(model) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a loaded model's parameters and buffers (quantized checkpoints are
    dequantized on load, so a float and a quantized version of one model compare equal)."""
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def load_checkpoint(checkpoint: str | Path, *, device: Any, batch_size: int, deterministic_topk: bool) -> _Loaded:
    """Model, tokenizer and identity of a checkpoint root or version directory."""
    from glmpost.checkpoints import (
        CheckpointError,
        load_model,
        load_tokenizer,
        read_manifest,
        resolve_checkpoint,
    )

    version_dir = resolve_checkpoint(checkpoint)
    tokenizer, revision = load_tokenizer(version_dir)
    try:
        policy_version: int | None = read_manifest(version_dir).policy_version
    except CheckpointError:
        policy_version = None
    try:
        config = json.loads((version_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GlmpostError(f"{version_dir}/config.json: unreadable ({exc})") from None
    model = load_model(version_dir, device=device, deterministic_topk=deterministic_topk)
    tensors = model_tensors(model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    engine = LocalEngine(model, batch_size=batch_size, pad_token_id=pad)
    return _Loaded(engine, tokenizer, version_dir, revision, policy_version, config, tensors)


# A pause between requests this long ends a burst of clients sending their next request.
ARRIVAL_GAP_S = 0.01


class EngineServer:
    """The worker that owns the engine, and the request handling behind the HTTP routes."""

    def __init__(self, checkpoint: str | Path, *, device: Any = "cpu", batch_size: int = 32, deterministic_topk: bool = True,
                 weight_version: str | None = None, batch_wait_s: float = 0.05):
        self.device = device
        self.batch_size = batch_size
        self.deterministic_topk = deterministic_topk
        self.batch_wait_s = batch_wait_s
        self.loaded = load_checkpoint(checkpoint, device=device, batch_size=batch_size, deterministic_topk=deterministic_topk)
        self.weight_version = weight_version if weight_version is not None else (
            str(self.loaded.policy_version) if self.loaded.policy_version is not None else "default")
        self._queue: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._inflight = 0  # single-sequence generate requests received and not yet answered
        self._last_merged = 1  # sequences in the last merged batch of single requests
        # Most single requests in flight at once while the last batch ran, and during the current
        # one: the number of clients that will send again within milliseconds of being answered.
        self._recent_peak = 1
        self._peak_now = 0
        self._last_arrival = 0.0
        self._worker = threading.Thread(target=self._work, name="glmpost-serve-engine", daemon=True)
        # Counters since start (GET /get_server_info): requests answered, engine batches, sequences
        # and tokens generated, and the seconds the engine spent running batches.
        self.stats = {"requests": 0, "batches": 0, "sequences": 0, "generated_tokens": 0, "engine_busy_s": 0.0}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._worker.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            pending = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for job in pending:
            job.error = RequestError("server is shutting down", 503)
            job.done.set()
        self._worker.join(timeout=30)

    def submit(self, job: _Job) -> Any:
        with self._cond:
            if self._stopping:
                raise RequestError("server is shutting down", 503)
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
        from glmpost import __version__

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
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        if body.get("text") is not None and body.get("input_ids") is None:
            raise RequestError("glmpost serve takes token ids: send input_ids, not text")
        input_ids = body.get("input_ids")
        batch = isinstance(input_ids, list) and len(input_ids) > 0 and isinstance(input_ids[0], list)
        prompts = input_ids if batch else [input_ids]
        if not isinstance(input_ids, list) or not input_ids or not all(_is_ids(p) for p in prompts):
            raise RequestError("input_ids must be a non-empty list of token ids, or a list of such lists")
        sampling = body.get("sampling_params") or {}
        per_item = _per_item(sampling, len(prompts), "sampling_params")
        flags = {name: _per_item(body.get(name, default), len(prompts), name)
                 for name, default in (("return_logprob", False), ("logprob_start_len", -1), ("top_logprobs_num", 0))}
        if body.get("stream"):
            raise RequestError("stream is not supported by glmpost serve")
        items = [self._item(prompts[i], per_item[i], flags["return_logprob"][i], flags["logprob_start_len"][i],
                            flags["top_logprobs_num"][i]) for i in range(len(prompts))]
        if batch:
            return self.submit(_Job("generate", items, batch=True))
        with self._cond:
            self._inflight += 1
            self._peak_now = max(self._peak_now, self._inflight)
        try:
            return self.submit(_Job("generate", items))[0]
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def server_info(self) -> dict:
        """``GET /get_server_info``: what ``/model_info`` says, and the counters since start."""
        stats = {**self.stats, "engine_busy_s": round(self.stats["engine_busy_s"], 6)}
        return {**self.model_info(), "batch_wait_s": self.batch_wait_s, "stats": stats}

    def update_weights_from_disk(self, body: dict) -> tuple[int, dict]:
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str) or not body["model_path"]:
            raise RequestError("update_weights_from_disk needs model_path (a checkpoint directory)")
        version = body.get("weight_version")
        job = _Job("update", {"model_path": body["model_path"], "weight_version": None if version is None else str(version),
                              "abort_all_requests": bool(body.get("abort_all_requests", False))})
        answer = self.submit(job)
        return (HTTPStatus.OK if answer["success"] else HTTPStatus.BAD_REQUEST), answer

    # ------------------------------------------------------------------ parsing

    def _item(self, prompt: list[int], sp: Any, return_logprob: Any, start: Any, top_n: Any) -> _Item:
        if not isinstance(sp, dict):
            raise RequestError("sampling_params must be an object (or a list of objects, one per sequence)")
        unknown = sorted(set(sp) - _KNOWN)
        if unknown:
            raise RequestError(f"sampling_params: unknown key(s) {', '.join(unknown)}")
        for key, default in _UNSUPPORTED_DEFAULTS.items():
            if sp.get(key, default) not in (default, None) and not (key == "stop" and sp.get(key) == []):
                raise RequestError(f"sampling_params.{key} is not supported by glmpost serve")
        try:
            max_new = int(sp.get("max_new_tokens", 128))
            temperature = float(sp.get("temperature", 1.0))
            top_p = float(sp.get("top_p", 1.0))
            top_k = int(sp.get("top_k", -1))
            stops = [int(t) for t in (sp.get("stop_token_ids") or [])]
            seed = sp.get("sampling_seed")
            seed = secrets.randbits(63) if seed is None else int(seed)
            start, top_n = int(start), int(top_n)
        except (TypeError, ValueError) as exc:
            raise RequestError(f"sampling_params: {exc}") from None
        if max_new < 0:
            raise RequestError(f"max_new_tokens must be >= 0, got {max_new}")
        # SGLang's Req._check_token_based_finish: ignore_eos turns off every token stop; otherwise
        # stop_token_ids and the model's eos ids both end a sequence.
        stops = [] if sp.get("ignore_eos", False) else sorted(set(stops) | set(self._eos_ids()))
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=0 if top_k in (-1, 0) else top_k,
                                max_new_tokens=max(max_new, 1), seed=0, stop_token_ids=stops)
        try:
            params.validate()
        except ValueError as exc:
            raise RequestError(f"sampling_params: {exc}") from None
        if top_k < -1:
            raise RequestError(f"top_k must be -1 (off) or >= 1, got {top_k}")
        params.max_new_tokens = max_new
        vocab = self.loaded.config.get("vocab_size")
        if vocab is not None and any(not 0 <= t < vocab for t in prompt):
            raise RequestError(f"input_ids: a token id is outside the vocabulary [0, {vocab})")
        context = self.loaded.config.get("max_position_embeddings")
        if context is not None and len(prompt) + max_new > context:
            raise RequestError(f"{len(prompt)} input tokens + max_new_tokens {max_new} exceed the context of {context}")
        if start >= len(prompt):
            raise RequestError(f"logprob_start_len {start} must be < the {len(prompt)} input tokens")
        if top_n < 0:
            raise RequestError("top_logprobs_num must be >= 0")
        return _Item(list(prompt), params, seed, bool(return_logprob), start, top_n)

    def _eos_ids(self) -> list[int]:
        eos = getattr(self.loaded.engine.model.generation_config, "eos_token_id", None)
        if eos is None:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]

    # ------------------------------------------------------------------ the worker

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._queue.popleft()
            jobs = [job]
            if job.kind == "generate" and not job.batch:
                jobs = self._gather(job)
            try:
                if job.kind == "update":
                    job.result = self._update(job.payload)
                else:
                    self._run_generate([it for j in jobs for it in j.payload])
                    for j in jobs:
                        j.result = [it.result for it in j.payload]
            except RequestError as exc:
                for j in jobs:
                    j.error = exc
            except Exception as exc:  # the engine failed on this batch: answer 500, keep serving
                for j in jobs:
                    j.error = RequestError(f"engine error: {type(exc).__name__}: {exc}", 500)
            if job.kind == "generate":
                self.stats["requests"] += sum(j.error is None for j in jobs)
            for j in jobs:
                j.done.set()

    def _gather(self, first: _Job) -> list[_Job]:
        """Merge queued single-sequence generate jobs into ``first``'s batch, up to ``batch_size``."""
        jobs, count = [first], len(first.payload)
        with self._cond:
            # Wait up to batch_wait_s for at least as many single requests as the previous merged
            # batch had, for every one received, and for as many as were in flight at once while
            # the last batch ran (the clients just answered are sending their next request right
            # now), so clients that fell into two cohorts merge back into one batch. Answered clients
            # send again in a burst: once no request has arrived for ARRIVAL_GAP_S the burst is over
            # (clients that finished are not coming back), and the batch starts.
            started = time.perf_counter()
            deadline = started + self.batch_wait_s
            while True:
                target = min(self.batch_size, max(self._last_merged, self._inflight, self._recent_peak, 1))
                waiting = sum(len(j.payload) for j in self._queue if j.kind == "generate" and not j.batch)
                now = time.perf_counter()
                quiet = now - max(self._last_arrival, started)
                if count + waiting >= target or now >= deadline or quiet >= ARRIVAL_GAP_S or self._stopping:
                    break
                self._cond.wait(min(deadline - now, ARRIVAL_GAP_S - quiet))
            kept: deque[_Job] = deque()
            while self._queue:
                job = self._queue.popleft()
                if job.kind == "generate" and not job.batch and count + len(job.payload) <= self.batch_size:
                    jobs.append(job)
                    count += len(job.payload)
                elif job.kind == "update":  # keep order: nothing queued after an update joins earlier work
                    kept.append(job)
                    kept.extend(self._queue)
                    self._queue.clear()
                else:
                    kept.append(job)
            self._queue.extendleft(reversed(kept))
            self._recent_peak, self._peak_now = max(self._peak_now, 1), self._inflight
        self._last_merged = count
        return jobs

    def _run_generate(self, items: list[_Item]) -> None:
        loaded = self.loaded
        engine = loaded.engine
        started = time.perf_counter()
        # Input log-probs (SGLang's input_token_logprobs): entries for positions start .. P-1, the
        # first one None (it has no prefix in the request's window), so score start+1 .. P-1.
        need_scores = [i for i, it in enumerate(items) if it.return_logprob and it.logprob_start_len + 1 < len(it.prompt)]
        scores: dict[int, Scores] = {}
        for top_n in sorted({items[i].top_logprobs_num for i in need_scores}):
            idx = [i for i in need_scores if items[i].top_logprobs_num == top_n]
            for i, s in zip(idx, engine.score([items[i].prompt for i in idx], [_start(items[i]) + 1 for i in idx],
                                              top_logprobs_num=top_n)):
                scores[i] = s
        # Generation: one engine call per group of identical sampling settings, in request order.
        groups: dict[tuple, list[int]] = {}
        for i, it in enumerate(items):
            if it.params.max_new_tokens > 0:
                p = it.params
                key = (p.temperature, p.top_p, p.top_k, p.max_new_tokens, tuple(p.stop_token_ids), it.top_logprobs_num)
                groups.setdefault(key, []).append(i)
        completions = {}
        for key, idx in groups.items():
            outs = engine.generate([items[i].prompt for i in idx], None, items[idx[0]].params,
                                   seeds=[items[i].seed for i in idx], top_logprobs_num=key[-1])
            completions.update(zip(idx, outs))
        latency = time.perf_counter() - started
        for i, it in enumerate(items):
            completion = completions.get(i)
            out_ids = completion.token_ids if completion is not None else []
            if completion is None:
                finish = {"type": "length", "length": 0}
            elif completion.finish_reason == "stop":
                finish = {"type": "stop", "matched": out_ids[-1]}
            else:
                finish = {"type": "length", "length": len(out_ids)}
            meta: dict[str, Any] = {"id": uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(it.prompt),
                                    "completion_tokens": len(out_ids), "cached_tokens": 0,
                                    "weight_version": self.weight_version, "e2e_latency": round(latency, 6)}
            if it.return_logprob:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(completion.log_probs, out_ids)] if completion else []
                start = _start(it)
                first = [[None, it.prompt[start], None]]
                s = scores.get(i)
                rest = [[lp, t, None] for lp, t in zip(s.log_probs, it.prompt[start + 1:])] if s else []
                meta["input_token_logprobs"] = first + rest
                if it.top_logprobs_num > 0:
                    meta["output_top_logprobs"] = ([_top_rows(ids, lps) for ids, lps in zip(completion.top_ids, completion.top_log_probs)]
                                                   if completion else [])
                    meta["input_top_logprobs"] = [None] + ([_top_rows(ids, lps) for ids, lps in zip(s.top_ids, s.top_log_probs)]
                                                           if s else [])
            it.result = {"text": loaded.tokenizer.decode(out_ids), "output_ids": out_ids, "meta_info": meta}
            self.stats["generated_tokens"] += len(out_ids)
        self.stats["batches"] += 1
        self.stats["sequences"] += len(items)
        self.stats["engine_busy_s"] += time.perf_counter() - started

    def _update(self, payload: dict) -> dict:
        """Validate and load a checkpoint; swap it in only when everything checks out."""
        old = self.loaded

        def refuse(message: str) -> dict:
            return {"success": False, "message": message, "num_paused_requests": 0, "weight_version": self.weight_version}

        try:
            from glmpost.checkpoints import resolve_checkpoint, tokenizer_revision

            target = resolve_checkpoint(payload["model_path"])
            config = json.loads((target / "config.json").read_text())
            for key in ("architectures", "model_type"):
                if config.get(key) != old.config.get(key):
                    return refuse(f"{target}: {key} {config.get(key)!r} differs from the served {old.config.get(key)!r}")
            revision = tokenizer_revision(target)
            if revision != old.revision:
                return refuse(f"{target}: tokenizer revision {revision} differs from the served {old.revision}")
            # load_model refuses a checkpoint that lacks a tensor; shapes must match the served model's.
            new = load_checkpoint(target, device=self.device, batch_size=self.batch_size, deterministic_topk=self.deterministic_topk)
            bad = sorted(n for n in old.tensors if new.tensors.get(n) != old.tensors[n])
            if bad:
                return refuse(f"{target}: tensor {bad[0]} has shape {list(new.tensors.get(bad[0], ()))}, the served one {list(old.tensors[bad[0]])}")
        except (GlmpostError, OSError, ValueError) as exc:
            return refuse(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        aborted = 0
        if payload["abort_all_requests"]:
            aborted = self._abort_queued()
        self.loaded = new
        if payload["weight_version"] is not None:
            self.weight_version = payload["weight_version"]
        del old
        return {"success": True, "message": f"Succeeded to update model weights from {target}.",
                "num_paused_requests": 0, "num_aborted_requests": aborted, "weight_version": self.weight_version}

    def _abort_queued(self) -> int:
        """Answer every queued generate request with finish_reason abort (SGLang's abort_all_requests)."""
        with self._cond:
            jobs = [j for j in self._queue if j.kind == "generate"]
            for j in jobs:
                self._queue.remove(j)
        for j in jobs:
            j.result = [{"text": "", "output_ids": [], "meta_info": {
                "id": uuid.uuid4().hex, "finish_reason": {"type": "abort", "message": "aborted by update_weights_from_disk"},
                "prompt_tokens": len(it.prompt), "completion_tokens": 0, "cached_tokens": 0,
                "weight_version": self.weight_version}} for it in j.payload]
            j.done.set()
        return len(jobs)


def _start(item: _Item) -> int:
    """SGLang's default logprob_start_len -1 means the last input token (one input entry)."""
    return len(item.prompt) - 1 if item.logprob_start_len < 0 else item.logprob_start_len


def _top_rows(ids: list[int], lps: list[float]) -> list[list]:
    return [[lp, t, None] for lp, t in zip(lps, ids)]


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _per_item(value: Any, count: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(f"{name}: {len(value)} entries for {count} sequences")
        return value
    return [value] * count


class _Handler(BaseHTTPRequestHandler):
    server_version = "glmpost-serve"
    engine: EngineServer  # set on the subclass made by make_http_server
    quiet = True

    def log_message(self, format: str, *args: Any) -> None:
        if not self.quiet:
            super().log_message(format, *args)

    def _send(self, status: int, payload: Any) -> None:
        body = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": {"message": message, "code": int(status)}})

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw) if raw else {}
        except json.JSONDecodeError as exc:
            raise RequestError(f"the request body is not JSON ({exc})") from None

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        try:
            if method == "GET" and path == "/health":
                self._send(200, None)
            elif method == "GET" and path in ("/get_weight_version", "/weight_version"):
                self._send(200, {"weight_version": self.engine.weight_version})
            elif method == "GET" and path in ("/model_info", "/get_model_info"):
                self._send(200, self.engine.model_info())
            elif method == "GET" and path == "/get_server_info":
                self._send(200, self.engine.server_info())
            elif method == "POST" and path == "/generate":
                self._send(200, self.engine.generate(self._body()))
            elif method == "POST" and path == "/update_weights_from_disk":
                status, answer = self.engine.update_weights_from_disk(self._body())
                self._send(status, answer)
            elif path in ("/health", "/get_weight_version", "/model_info", "/get_server_info", "/generate", "/update_weights_from_disk"):
                self._error(405, f"{method} is not allowed on {path}")
            else:
                self._error(404, f"no route {path}")
        except RequestError as exc:
            self._error(exc.status, str(exc))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away
        except Exception as exc:  # never let one request take the server down
            try:
                self._error(500, f"{type(exc).__name__}: {exc}")
            except OSError:
                pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")


def make_http_server(engine: EngineServer, host: str, port: int, *, quiet: bool = True) -> ThreadingHTTPServer:
    """A threading HTTP server whose handlers call ``engine`` (``port`` 0 picks a free port)."""
    handler = type("GlmpostServeHandler", (_Handler,), {"engine": engine, "quiet": quiet})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def serve_until_signalled(engine: EngineServer, server: ThreadingHTTPServer, *, on_ready=None, on_tick=None,
                          tick_s: float = 10.0) -> None:
    """Serve until SIGTERM or SIGINT, then stop accepting, fail queued work with 503, and return.
    ``on_tick(final)`` runs every ``tick_s`` seconds and once more (``final`` True) after the stop."""
    import signal

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="glmpost-serve-http", daemon=True)
    engine.start()
    thread.start()
    try:
        if on_ready is not None:
            on_ready()
        next_tick = time.monotonic() + tick_s
        while not stop.wait(min(0.5, max(0.0, next_tick - time.monotonic()))):
            if time.monotonic() >= next_tick:
                if on_tick is not None:
                    on_tick(False)
                next_tick += tick_s
                if next_tick <= time.monotonic():  # a slow tick: skip the missed ones, no backlog
                    next_tick = time.monotonic() + tick_s
    finally:
        server.shutdown()
        server.server_close()
        engine.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if on_tick is not None:
            on_tick(True)


def bound_address(server: ThreadingHTTPServer) -> tuple[str, int]:
    host, port = server.server_address[:2]
    return (host if isinstance(host, str) else host.decode()), int(port)


__all__ = [
    "EngineServer",
    "RequestError",
    "bound_address",
    "load_checkpoint",
    "make_http_server",
    "model_tensors",
    "serve_until_signalled",
]
