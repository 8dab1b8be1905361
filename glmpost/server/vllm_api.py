"""``glmpost serve --api vllm``: the routes and fields of vLLM's OpenAI-compatible server that glmpost's
:class:`~glmpost.kernel.vllm_client.VLLMClient` uses, over the same :class:`~glmpost.server.engine.EngineServer`.

A stand-in for tests and for closure checks, shaped as vLLM's source shapes them (upstream
``vllm-project/vllm``: completions protocol at commit 002032e, ``vllm/entrypoints/openai/completion/
protocol.py``; ``/server_info`` at 09cb327, ``vllm/entrypoints/serve/instrumentator/server_info.py``;
``/collective_rpc`` at 09cb327, ``serve/rpc/api_router.py``; ``/pause``, ``/resume``, ``/is_paused`` at
0100a21, ``serve/dev/rlhf/api_router.py``):

* ``POST /v1/completions``: ``prompt`` token ids (a list, or a list of lists: every prompt gets the
  request's ``seed``), ``max_tokens`` (default 16, also for None), ``temperature`` (default
  1), ``top_p``, ``top_k`` (0 or -1 off), ``seed``, ``stop_token_ids`` (they stop as the eos ids do,
  which ``ignore_eos`` turns off), ``logprobs`` k, ``prompt_logprobs`` k, ``return_token_ids``,
  ``return_tokens_as_token_ids``, ``skip_special_tokens`` (text only); ``logprobs`` and
  ``prompt_logprobs`` above ``--max-logprobs`` (vLLM's default 20; -1 in a request: the vocabulary)
  are refused as vLLM refuses them. Refused (HTTP 400) unless at
  their neutral values: penalties, ``min_p``, ``n``, ``echo``, ``stream``, ``stop`` strings,
  ``min_tokens``, ``logit_bias``, beam search, grammars; a text prompt; ``ignore_eos`` with
  ``stop_token_ids`` (the embedded engine cannot stop at those ids but not at eos). Unknown fields
  are ignored, as vLLM ignores them (it only logs them). Answer: ``choices[]`` with ``text``,
  ``token_ids``, ``prompt_token_ids``, ``logprobs`` (``token_logprobs``, ``tokens``, ``top_logprobs``:
  the sampled token plus the top k, ``text_offset``), ``prompt_logprobs`` (first entry None; each
  entry the prompt's token plus the top k as ``{id: {"logprob", "rank", "decoded_token"}}``; a rank
  the engine did not compute is None), ``finish_reason`` ``stop`` / ``length``, ``stop_reason``
  (the token id for a stop token, None for the tokenizer's eos); ``usage``.
* Output log-probs are of the engine kind ``--logprobs-mode`` maps to (``raw_logprobs`` -> ``raw``,
  ``processed_logprobs`` -> ``sampled``); greedy requests are ``raw`` either way.
* ``GET /v1/models``; ``GET /server_info`` (``config_format=json``: ``vllm_config.model_config``
  with ``logprobs_mode``; ``vllm_env`` with ``VLLM_BATCH_INVARIANT`` true: a sequence's tokens follow
  from its seed); ``POST /collective_rpc`` (only ``reload_weights`` with ``kwargs.weights_path``: the
  embedded engine's checked load; a refusal is HTTP 500 as a failed RPC is in vLLM);
  ``POST /reset_prefix_cache`` (a reload already starts with empty caches); ``POST /pause``
  (``mode`` wait or abort: in-flight requests finish, new ones wait), ``POST /resume``,
  ``GET /is_paused``, ``POST /update_weight_version`` (``{"new_version"}`` -> ``{"success": true,
  "new_version"}``), ``GET /weight_info`` (``{"weight_version"}``, ``"default"`` until one is set; a
  reload through ``/collective_rpc`` leaves the label as it was, as vLLM's does).
* Dev mode, as vLLM 0.32 gates it (``entrypoints/launchers/api_server/routers.py``: the dev routers
  and the RL router only under ``VLLM_SERVER_DEV_MODE=1``): with ``--no-vllm-dev-mode`` ``/server_info``,
  ``/collective_rpc``, ``/reset_prefix_cache``, ``/pause``, ``/resume``, ``/is_paused``,
  ``/update_weight_version`` and ``/weight_info`` answer 404 ``{"detail": "Not Found"}`` (FastAPI's).
  ``GET /version`` (``{"version": RELEASE}``, ``serve/instrumentator/basic.py``) is always there.
* ``--vllm-release`` picks the release mimicked: before 0.34 a request that comes while paused waits
  for ``/resume`` (0.27.1 and 0.32 queue it: ``PauseState.PAUSED_NEW``, ``v1/engine/core.py``); from
  0.34 it is answered HTTP 503 at once, and ``return_weight_versions: true`` gives each choice
  ``weight_versions`` (``[{"version", "start", "end"}]``, output-token spans, ``vllm/outputs.py``
  ``WeightVersionSpan``).
* ``POST /reset_prefix_cache`` answers ``{"success": true}`` (vLLM 0.32 ``serve/dev/cache/api_router.py``);
  ``max_tokens: null`` is 16 (0.32 ``CompletionRequest.normalize_null_max_tokens``); ``temperature``
  above 2 is refused, ``temperature must be in [0, 2], got T.`` (0.32 ``SamplingParams._verify_args``).
* ``--enable-return-routed-experts`` (vLLM's flag; MoE models): every choice carries
  ``routed_experts``, base64 of ``.npy`` bytes, uint8 (uint16 beyond 256 experts)
  ``[prompt + output - 1, num_hidden_layers, num_experts_per_tok]``, the dense layers' rows 0; without
  it the field is null (``CompletionResponseChoice.routed_experts``, ``vllm/entrypoints/openai/completion/
  protocol.py`` as read at ``local-inference-lab/vllm`` 7b2bff9; the rows as
  ``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py`` at vllm-project/vllm 42fa4c0
  captures them). vLLM has no request field for them.
* ``--enable-lora``: ``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, the adapters' cards in
  ``/v1/models`` and ``model`` naming one (:mod:`glmpost.server.adapters`); without it those routes are
  404, as on a vLLM without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``.
* ``--api-key`` guards only ``/v1``, ``/v2`` and ``/inference`` (``Authorization: Bearer KEY``), as
  vLLM's middleware does (``server_utils`` ``GUARDED_PREFIX``): the RL routes are open, so keep such
  a server on loopback or a private network.
"""

from __future__ import annotations

import base64
import io
import secrets
import threading
import time
import uuid
from typing import Any, Callable

import numpy as np

from glmpost.kernel.vllm_client import LOGPROBS_MODES
from glmpost.kernel.vllm_protocol import release_parts
from glmpost.server.adapters import PlainText, vllm_lora_route
from glmpost.server.parsing import RequestError
from glmpost.server.vllm_checks import VLLMRequestError, check_completion

GUARDED_PREFIXES = ("/v1", "/v2", "/inference")
_NEUTRAL = {"n": 1, "echo": False, "stream": False, "min_tokens": 0, "min_p": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "use_beam_search": False, "logit_bias": None, "stop": None,
            "response_format": None, "structured_outputs": None, "allowed_token_ids": None, "bad_words": None,
            "logprob_token_ids": None, "prompt_embeds": None, "suffix": None, "truncate_prompt_tokens": None}

DEV_ROUTES = frozenset({"/server_info", "/collective_rpc", "/reset_prefix_cache", "/pause", "/resume", "/is_paused",
                        "/update_weight_version", "/weight_info"})
DEFAULT_RELEASE = "0.32.0"

__all__ = ["DEFAULT_RELEASE", "DEV_ROUTES", "GUARDED_PREFIXES", "PlainText", "VLLMApi", "check_release", "guarded"]


def check_release(release: str) -> tuple[int, ...]:
    """``"0.34.0"`` -> ``(0, 34, 0)`` (:func:`~glmpost.kernel.vllm_protocol.release_parts`); raises
    ValueError for what is no release number."""
    parts = release_parts(release)
    if len(parts) < 2:
        raise ValueError(f"must be a vLLM release such as 0.32.0 or 0.34.0, got {release!r}")
    return parts


def guarded(path: str) -> bool:
    """Whether vLLM's ``--api-key`` middleware checks ``path``."""
    return any(path == p or path.startswith(p + "/") for p in GUARDED_PREFIXES)


def error_payload(status: int, message: str, param: str | None = None) -> dict:
    """vLLM's OpenAI ``ErrorResponse``."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 401: "Unauthorized",
            503: "ServiceUnavailableError"}.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": int(status)}}


def _ids(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _prompts(body: dict) -> list[list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
        raise RequestError("glmpost serve takes token ids: send prompt as a list of ids")
    prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
    if prompt is None or prompt == []:
        raise VLLMRequestError("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
    if not all(_ids(p) for p in prompts):
        raise RequestError("prompt must be a non-empty list of token ids (>= 0), or a list of such lists")
    return prompts


def _check_neutral(body: dict) -> None:
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != neutral and value not in ([], "", {}):
            raise RequestError(f"{name} is not supported by glmpost serve --api vllm")


class VLLMApi:
    """The vLLM routes over ``engine`` (an :class:`~glmpost.server.engine.EngineServer` whose
    ``log_prob_kind`` is ``logprobs_mode``'s kind)."""

    def __init__(self, engine: Any, *, logprobs_mode: str, max_logprobs: int = 20, dev_mode: bool = True,
                 release: str = DEFAULT_RELEASE, return_routed_experts: bool = False, max_model_len: int | None = None):
        self.engine = engine
        self._served = str(engine.loaded.version_dir)
        self.logprobs_mode = logprobs_mode
        self.max_logprobs = max_logprobs
        self.dev_mode = dev_mode
        self.release = release
        self.return_routed_experts = return_routed_experts  # --enable-return-routed-experts
        self._max_model_len = max_model_len
        self.rejects_while_paused = check_release(release) >= (0, 34)  # 0.34: 503 to new requests while paused
        self.weight_version = "default"  # vLLM's label until /update_weight_version
        self.started = int(time.time())
        self._cond = threading.Condition()
        self._paused = False
        self._active = 0

    @property
    def model_name(self) -> str:
        """The served model's name: the folder it started with (vLLM keeps it across reload_weights)."""
        return self._served

    def route(self, method: str, path: str, query: dict[str, str], body: Callable[[], Any]) -> tuple[int, Any] | None:
        """``(status, payload)`` of a vLLM route, or None when ``path`` is none of them."""
        if path in DEV_ROUTES and not self.dev_mode:
            return 404, {"detail": "Not Found"}
        if method == "GET" and path == "/version":
            return 200, {"version": self.release}
        if method == "POST" and path == "/update_weight_version":
            payload = body()
            new = payload.get("new_version") if isinstance(payload, dict) else None
            if not isinstance(new, str):
                return 422, {"detail": [{"type": "missing", "loc": ["body", "new_version"], "msg": "Field required"}]}
            with self._cond:
                self.weight_version = new
            return 200, {"success": True, "new_version": new}
        if method == "GET" and path == "/weight_info":
            return 200, {"weight_version": self.weight_version}
        if method == "GET" and path == "/v1/models":
            return 200, self.models()
        if method == "POST" and path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") and self.engine.adapters.enabled:
            return vllm_lora_route(self.engine.adapters, path, body(), self.model_name)
        if method == "POST" and path == "/v1/completions":
            return 200, self.completions(body())
        if method == "GET" and path == "/server_info":
            return 200, self.server_info(query.get("config_format", "text"))
        if method == "POST" and path == "/collective_rpc":
            return self.collective_rpc(body())
        if method == "POST" and path == "/reset_prefix_cache":
            return 200, {"success": True}
        if method == "POST" and path == "/pause":
            return 200, self.pause(query.get("mode", "abort"))
        if method == "POST" and path == "/resume":
            with self._cond:
                self._paused = False
                self._cond.notify_all()
            return 200, {"status": "resumed"}
        if method == "GET" and path == "/is_paused":
            return 200, {"is_paused": self._paused}
        return None

    @property
    def max_model_len(self) -> int:
        """vLLM's ``--max-model-len``: the longest sequence served (the model's ``max_position_embeddings`` by default)."""
        return int(self._max_model_len or self.engine.loaded.config.get("max_position_embeddings") or 2 ** 31 - 1)

    def models(self) -> dict:
        permission = {"id": f"modelperm-{secrets.token_hex(8)}", "object": "model_permission", "created": self.started,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                      "group": None, "is_blocking": False}
        adapters = [{**card, "permission": [permission]} for card in self.engine.adapters.cards(self.model_name, self.started, "vllm")]
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.started,
                                            "owned_by": "vllm", "root": self.model_name, "parent": None,
                                            "max_model_len": self.max_model_len, "permission": [permission]}, *adapters]}

    def server_info(self, config_format: str) -> dict:
        vllm_config = {"model_config": {"model": self.model_name, "served_model_name": self.model_name,
                                        "logprobs_mode": self.logprobs_mode,
                                        "max_model_len": self.max_model_len, "dtype": "float32"}}
        if config_format not in ("text", "json"):
            raise RequestError(f"config_format must be text or json, got {config_format!r}")
        return {"vllm_config": vllm_config if config_format == "json" else str(vllm_config),
                "vllm_env": {"VLLM_SERVER_DEV_MODE": True, "VLLM_BATCH_INVARIANT": True}, "system_env": {}}

    def pause(self, mode: str) -> dict:
        if mode not in ("abort", "wait", "keep"):
            raise RequestError(f"mode must be abort, wait or keep, got {mode!r}")
        with self._cond:
            self._paused = True
            self._cond.wait_for(lambda: self._active == 0)
        return {"status": "paused"}

    def collective_rpc(self, body: Any) -> tuple[int, Any]:
        if not isinstance(body, dict) or body.get("method") is None:
            raise RequestError("Missing 'method' in request body")
        if body["method"] != "reload_weights":  # vLLM: the worker has no such method, a failed RPC (500)
            raise RequestError(f"Call to collective_rpc method failed: Worker failed with error ''CPUWorker' object has no "
                               f"attribute '{body['method']}'' (glmpost serve runs only reload_weights)", 500)
        path = (body.get("kwargs") or {}).get("weights_path")
        if not isinstance(path, str) or not path:
            raise RequestError("reload_weights needs kwargs.weights_path (a checkpoint directory)")
        status, answer = self.engine.update_weights_from_disk({"model_path": path})
        if status != 200:
            raise RequestError(f"reload_weights failed: {answer.get('message')}", 500)
        return 200, {"results": [None]}

    def completions(self, body: Any) -> dict:
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        prompts = _prompts(body)
        _check_neutral(body)
        adapter = body.get("model") if self.engine.adapters.holds(body.get("model")) else None  # glmpost.server.adapters
        check_completion(body, prompts, model_name=adapter or self.model_name,
                         vocab_size=int(self.engine.loaded.config.get("vocab_size")), max_model_len=self.max_model_len)
        with self._cond:
            if self._paused and self.rejects_while_paused:
                raise RequestError("The engine is paused for a weight update: retry after /resume", 503)
            self._cond.wait_for(lambda: not self._paused)
            self._active += 1
            label = self.weight_version  # labels change only while paused, so not during this request
        try:
            choices = [self._choice(i, prompt, body, adapter) for i, prompt in enumerate(prompts)]
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()
        prompt_tokens = sum(len(p) for p in prompts)
        if body.get("return_weight_versions") and self.rejects_while_paused:
            for choice in choices:  # one span: the label cannot change while a request runs here
                choice["weight_versions"] = [{"version": label, "start": 0, "end": choice["_n"]}] if choice["_n"] else []
        completion_tokens = sum(c.pop("_n") for c in choices)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": adapter or self.model_name, "choices": choices,
                "service_tier": None, "system_fingerprint": f"vllm-{self.release}-glmpost",
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                          "completion_tokens": completion_tokens, "prompt_tokens_details": None,
                          "completion_tokens_details": None},
                "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}  # vLLM 0.32's fields

    def _generate_body(self, prompt: list[int], body: dict) -> dict:
        """The SGLang ``/generate`` body of one prompt (the engine's own request form)."""
        max_tokens = body.get("max_tokens")
        max_tokens = 16 if max_tokens is None else max_tokens  # vLLM's default, also for null
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {max_tokens}")
        stops = body.get("stop_token_ids") or []
        if body.get("ignore_eos") and stops:
            raise RequestError("ignore_eos with stop_token_ids is not supported by glmpost serve --api vllm")
        top_k = body.get("top_k")
        seed = body.get("seed")
        logprobs, prompt_logprobs = body.get("logprobs"), body.get("prompt_logprobs")
        vocab = int(self.engine.loaded.config.get("vocab_size") or 0)
        for name, value, words in (("logprobs", logprobs, "sample"), ("prompt_logprobs", prompt_logprobs, "prompt")):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < -1):
                raise RequestError(f"`{name}` must be a positive value or -1.")
            wanted = vocab if value == -1 else value
            if value is not None and self.max_logprobs != -1 and wanted > self.max_logprobs:
                raise RequestError(f"Requested {words} logprobs of {wanted}, which is greater than max allowed: {self.max_logprobs}")
        logprobs = vocab if logprobs == -1 else logprobs
        prompt_logprobs = vocab if prompt_logprobs == -1 else prompt_logprobs
        sampling = {"max_new_tokens": max_tokens, "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
                    "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
                    "top_k": -1 if top_k in (None, 0, -1) else top_k, "stop_token_ids": stops,
                    "ignore_eos": bool(body.get("ignore_eos", False)),
                    "sampling_seed": secrets.randbits(63) if seed is None else seed}
        return {"input_ids": prompt, "sampling_params": sampling, "return_routed_experts": self.return_routed_experts,
                "return_logprob": logprobs is not None or prompt_logprobs is not None,
                "logprob_start_len": 0 if prompt_logprobs is not None else -1,
                "top_logprobs_num": max(logprobs or 0, prompt_logprobs or 0)}

    def _choice(self, index: int, prompt: list[int], body: dict, adapter: str | None = None) -> dict:
        answer = self.engine.generate({**self._generate_body(prompt, body), "lora_path": adapter})
        meta, ids = answer["meta_info"], answer["output_ids"]
        tokenizer = self.engine.loaded.tokenizer
        finish = meta["finish_reason"]
        stop_reason = None
        if finish.get("type") == "stop":
            last = ids[-1]
            stop_reason = None if last == tokenizer.eos_token_id and last not in (body.get("stop_token_ids") or []) else last
        with_ids = bool(body.get("return_token_ids"))
        choice: dict[str, Any] = {
            "index": index, "text": tokenizer.decode(ids, skip_special_tokens=body.get("skip_special_tokens", True) is not False),
            "logprobs": None, "finish_reason": finish.get("type"), "stop_reason": stop_reason,
            "token_ids": ids if with_ids else None, "prompt_logprobs": None,
            "prompt_token_ids": prompt if with_ids else None, "routed_experts": self._routed_experts(meta), "_n": len(ids)}
        vocab = int(self.engine.loaded.config.get("vocab_size") or 0)
        if body.get("logprobs") is not None:
            choice["logprobs"] = self._output_logprobs(meta, ids, body, vocab if body["logprobs"] == -1 else body["logprobs"])
        if body.get("prompt_logprobs") is not None:
            k = vocab if body["prompt_logprobs"] == -1 else body["prompt_logprobs"]
            choice["prompt_logprobs"] = self._prompt_logprobs(meta, k)
        return choice

    def _routed_experts(self, meta: dict) -> str | None:
        """The engine's SGLang-shaped ``routed_experts`` (base64 int32 ``[P + n - 1, num_hidden_layers, k]``)
        as vLLM answers them: base64 of ``.npy`` bytes of the same rows, uint8 (uint16 beyond 256 experts)."""
        encoded = meta.get("routed_experts")
        if not self.return_routed_experts or encoded is None:
            return None
        layout = self.engine._routing_layout()
        rows = np.frombuffer(base64.b64decode(encoded), dtype=np.int32).reshape(-1, layout.hidden_layers, layout.k)
        buffer = io.BytesIO()
        np.save(buffer, rows.astype(np.uint8 if layout.experts <= 256 else np.uint16), allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")

    def _token(self, token: int, as_ids: bool) -> str:
        return f"token_id:{token}" if as_ids else self.engine.loaded.tokenizer.decode([token])

    def _output_logprobs(self, meta: dict, ids: list[int], body: dict, k: int) -> dict:
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        entries = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or [[] for _ in ids]
        tokens = [self._token(t, as_ids) for t in ids]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        top_rows = []
        for (lp, token, _), row in zip(entries, tops):
            top = {self._token(t, as_ids): lp_t for lp_t, t, _ in (row or [])[:k]}
            top[self._token(token, as_ids)] = lp
            top_rows.append(top)
        return {"text_offset": offsets, "token_logprobs": [e[0] for e in entries], "tokens": tokens, "top_logprobs": top_rows}

    def _prompt_logprobs(self, meta: dict, k: int) -> list:
        tokenizer = self.engine.loaded.tokenizer
        entries = meta.get("input_token_logprobs") or []
        tops = meta.get("input_top_logprobs") or [None] * len(entries)
        rows: list = [None]
        for (lp, token, _), top in zip(entries[1:], tops[1:]):
            ranked = list(top or [])[:k]
            row = {str(t): {"logprob": lp_t, "rank": r + 1, "decoded_token": tokenizer.decode([t])}
                   for r, (lp_t, t, _) in enumerate(ranked)}
            if str(token) not in row:
                row[str(token)] = {"logprob": lp, "rank": None, "decoded_token": tokenizer.decode([token])}
            rows.append(row)
        return rows


def check_logprobs_mode(mode: str) -> str:
    """The engine's log-prob kind of a ``--logprobs-mode``; raises ValueError for the logits modes
    (the embedded engine returns log-probs only) and unknown ones."""
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"must be {' or '.join(LOGPROBS_MODES)} (glmpost serve returns log-probs, not logits), got {mode!r}")
    return LOGPROBS_MODES[mode]
