"""An HTTP client for vLLM's OpenAI-compatible server (and ``glmpost serve --api vllm``), presenting the
interface of :class:`~glmpost.kernel.sglang_client.SGLangClient`: ``generate`` answers in SGLang's
shape, so the SGLang pool, backend, score-teacher, diff-logprobs and weight-sync paths take it.

Routes and fields as read in vLLM's source (upstream ``vllm-project/vllm``; ``/server_info`` at
09cb327 / 0100a21, ``vllm/entrypoints/serve/instrumentator/server_info.py``). The request and answer
shapes are :mod:`glmpost.kernel.vllm_protocol`'s, the weight routes :mod:`glmpost.kernel.vllm_weights`':

* Scoring: ``prompt_logprobs`` k with ``max_tokens`` 1 (vLLM refuses 0): ``prompt_logprobs[0]`` is
  None, entry ``i`` maps token ids (JSON keys) to ``{"logprob", "rank", "decoded_token"}`` and holds
  the prompt's own token plus the top k. Prompt log-probs are the model's own, ``log_softmax(logits)``
  (``compute_logprobs``), for both log-prob modes: prompt tokens skip the sampling processors; but
  under ``raw_logits`` / ``processed_logits`` they are the **logits** (vLLM 0.32
  ``v1/worker/gpu_model_runner.py`` ``_get_prompt_logprobs_dict``, which the CPU runner inherits), so
  :meth:`VLLMClient.score` refuses those modes (:meth:`VLLMClient.scoring_problem`).
* ``GET /v1/models`` (the served model's ``id`` is sent as ``model``), ``GET /health``.
* ``GET /server_info?config_format=json`` (dev mode, ``VLLM_SERVER_DEV_MODE=1``): the server's
  settings (:meth:`VLLMClient.settings`, :func:`~glmpost.kernel.vllm_protocol.vllm_settings`).
* vLLM 0.34 answers a new request HTTP 503 while paused (0.27.1 and 0.32 queue it): such a 503 waits
  for ``GET /is_paused`` to clear, on its own budget (``pause_wait``), not the retry count. From 0.34,
  ``return_weight_versions: true`` gives each choice ``weight_versions``, output-token spans
  ``[{"version", "start", "end"}]`` (``vllm/outputs.py`` ``WeightVersionSpan``; sent only to a
  server whose ``/version`` is at least 0.34, older ones log every unknown field).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from glmpost.kernel.sglang_client import ServerError, SGLangClient
from glmpost.kernel.vllm_protocol import (LOGITS_MODES, LOGPROBS_MODES, completion_request, release_parts, sglang_answer,
                                          sglang_routed_experts, vllm_settings)
from glmpost.kernel.vllm_weights import PAUSE_POLL, DevModeError, ReloadUncertain, VLLMWeights

MAX_PARALLEL = 64  # single requests one generate call sends at once
PAUSE_WAIT = 1800.0  # seconds a request answered 503 by a paused server waits for /is_paused to clear
DEV_MODE_ROUTES = ("/pause", "/resume", "/is_paused", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version",
                   "/weight_info", "/server_info")

__all__ = ["DevModeError", "LOGITS_MODES", "LOGPROBS_MODES", "ReloadUncertain", "VLLMClient", "completion_request",
           "sglang_answer", "sglang_routed_experts", "vllm_settings"]


# vLLM 0.32 maps LoRA adapters onto prompt log-prob rows with one index per *request* (punica's
# sampler indices, vllm-project/vllm#17766, #29955): a batch of several requests asking prompt_logprobs
# under an adapter kills its engine (an einsum of mismatched sizes); one request alone broadcasts its
# index to every row, which is right. So scoring under an adapter sends one request at a time per server.
_ADAPTER_SCORING: dict[str, threading.Lock] = {}
_ADAPTER_SCORING_GUARD = threading.Lock()


def _adapter_scoring_lock(url: str) -> threading.Lock:
    with _ADAPTER_SCORING_GUARD:
        return _ADAPTER_SCORING.setdefault(url, threading.Lock())


class VLLMClient(VLLMWeights, SGLangClient):
    """One vLLM (or ``glmpost serve --api vllm``) server behind :class:`SGLangClient`'s interface.

    ``weight_version``: the version the server serves as far as glmpost knows (None: unknown), stamped
    on every answer's ``meta_info`` unless the answer carries its own ``weight_versions``: the label
    ``/weight_info`` reported (``labelled``) or, for a server without labels, what a fingerprint confirmed.
    ``pause_wait``: seconds a request answered 503 while the server is paused waits for ``/is_paused``
    to clear (vLLM 0.34), apart from ``retries``."""

    engine = "vllm"
    LOAD_ROUTE = "/v1/load_lora_adapter"
    UNLOAD_ROUTE = "/v1/unload_lora_adapter"
    ENABLE_HINT = ("launch vLLM with --enable-lora (--max-lora-rank at least the adapter's rank) and "
                   "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")

    def __init__(self, url: str, *, timeout: float = 600.0, retries: int = 3, backoff: float = 0.5,
                 api_key: str | None = None, admin_api_key: str | None = None, weight_version: str | None = None,
                 pause_wait: float = PAUSE_WAIT):
        super().__init__(url, timeout=timeout, retries=retries, backoff=backoff, api_key=api_key,
                         admin_api_key=admin_api_key)  # vLLM has no admin key: kept for the shared interface
        self.weight_version = weight_version
        self.pause_wait = pause_wait
        self.labelled = False  # weight_version is the server's own label (/weight_info), not a fingerprint's
        self.per_choice_versions = False  # the server answered weight_versions per choice (0.34)
        self.has_labels: bool | None = None  # whether /weight_info answers (None: not asked yet)
        self._model: str | None = None
        self._release: tuple[str | None] | None = None

    # ------------------------------------------------------------------ transport

    def _once(self, method: str, path: str, data: bytes | None, ok: set[int], text: bool = False) -> Any:
        """:meth:`SGLangClient._once`, except that a 503 from a paused server (vLLM 0.34 answers every
        new request so while paused) waits for ``GET /is_paused`` to clear and is sent again, within
        ``pause_wait`` seconds: a weight sync costs no sequence and no retry."""
        deadline = None
        while True:
            try:
                return super()._once(method, path, data, ok, text)
            except ServerError as exc:
                if exc.status != 503 or path.split("?", 1)[0] in DEV_MODE_ROUTES:
                    raise
                deadline = time.monotonic() + self.pause_wait if deadline is None else deadline
                if not self._wait_resumed(deadline):
                    raise

    def _wait_resumed(self, deadline: float) -> bool:
        """After a 503: True once ``/is_paused`` says false again, when it said true (the 503 was the
        pause's); False at once when the server is not paused (another 503: retried as usual) or has
        no ``/is_paused``; raises ServerError when the pause outlasts ``deadline``."""
        waited = False
        while True:
            try:
                answer = super()._once("GET", "/is_paused", None, set())
            except ServerError:
                return waited
            if not (isinstance(answer, dict) and answer.get("is_paused") is True):
                return waited
            if time.monotonic() >= deadline:
                raise ServerError(f"{self.url} stayed paused (GET /is_paused) for more than {self.pause_wait:g} s "
                                  "(pause_wait) while a request waited", url=self.url, status=503, retryable=True)
            waited = True
            time.sleep(PAUSE_POLL)

    def __repr__(self) -> str:
        return f"VLLMClient({self.url!r})"

    def health(self) -> dict:
        """``GET /health``: ``{}`` when the server is up; raises ServerError."""
        answer = self.request("GET", "/health")
        return answer if isinstance(answer, dict) else {}

    def models(self) -> list[dict]:
        """``GET /v1/models``'s ``data``: one entry per served model (``id``, ``root``, ``max_model_len``)."""
        answer = self.request("GET", "/v1/models")
        data = answer.get("data") if isinstance(answer, dict) else None
        if not data:
            raise ServerError(f"GET {self.url}/v1/models: no served model in {str(answer)[:200]!r}", url=self.url)
        return data

    def model_info(self) -> dict:
        """SGLang's ``/model_info`` keys from ``/v1/models``: ``model_path`` (the model's ``root``),
        ``served_model_name``, ``max_model_len``, ``is_generation`` and the confirmed ``weight_version``
        (vLLM reports no tokenizer revision nor vocabulary size)."""
        first = self.models()[0]
        self._model = first.get("id")
        return {"model_path": first.get("root") or first.get("id"), "served_model_name": first.get("id"),
                "max_model_len": first.get("max_model_len"), "is_generation": True, "weight_version": self.weight_version,
                "engine": "vllm"}

    def model(self) -> str | None:
        """The served model's name, sent as ``model`` (read once)."""
        if self._model is None:
            self.model_info()
        return self._model

    def server_info(self) -> dict:
        """``GET /server_info?config_format=json`` as vLLM answers it (``vllm_config``, ``vllm_env``, ...;
        404 when the server is not in dev mode)."""
        answer = self.request("GET", "/server_info?config_format=json")
        return answer if isinstance(answer, dict) else {}

    def settings(self) -> dict:
        """The server's settings under glmpost's keys, read once: ``logprobs_mode`` (vLLM's),
        ``log_prob_kind`` (its glmpost kind; None for the logits modes), ``enable_deterministic_inference``
        (``VLLM_BATCH_INVARIANT``), none of them when ``/server_info`` answers 404 (not dev mode); and
        ``version``, the release ``GET /version`` reports (stage.json records it)."""
        if self._settings is None:
            try:
                info = self.server_info()
            except ServerError as exc:
                if exc.status != 404:
                    raise
                info = {}
            settings = vllm_settings(info) if info else {}
            release = self.release()
            self._settings = {**settings, "version": release} if release is not None else settings
        return self._settings

    def release(self) -> str | None:
        """The server's vLLM release, ``GET /version`` (``{"version": "0.32.0"}``, every vLLM, dev mode or
        not; read once); None where that answers 404."""
        if self._release is None:
            try:
                answer = self.request("GET", "/version")
            except ServerError as exc:
                if exc.status != 404:
                    raise
                answer = None
            version = answer.get("version") if isinstance(answer, dict) else None
            self._release = (None if version is None else str(version),)
        return self._release[0]

    def release_at_least(self, *wanted: int) -> bool:
        """Whether :meth:`release` is ``wanted`` or later (False when unknown or unreadable)."""
        try:
            release = self.release()
        except ServerError:
            return False
        parts = release_parts(release)
        return bool(parts) and parts >= wanted

    def scoring_problem(self) -> str | None:
        """Why this server's prompt log-probs are no log-probs (None when they are, or it does not say):
        under ``raw_logits`` / ``processed_logits`` vLLM returns the prompt tokens' logits."""
        mode = self.settings().get("logprobs_mode")
        if mode in LOGITS_MODES:
            return (f"{self.url} returns logits, not log-probs, as prompt log-probs (vLLM logprobs_mode {mode}): "
                    "start it with --logprobs-mode raw_logprobs or processed_logprobs to score")
        return None

    def completions(self, body: dict) -> dict:
        """``POST /v1/completions``."""
        return self.request("POST", "/v1/completions", body)

    def _one(self, prompt: Sequence[int], sampling: dict, return_logprob: bool, top_logprobs_num: int,
             routed: bool = False) -> dict:
        def send(adapter: str | None) -> dict:
            body = completion_request(prompt, sampling, model=adapter or self.model(),
                                      logprobs=top_logprobs_num if return_logprob else None)
            if self.release_at_least(0, 34):
                body["return_weight_versions"] = True
            try:
                answer = sglang_answer(self.completions(body), weight_version=self.weight_version,
                                       top_logprobs_num=top_logprobs_num, routed_experts=routed)
            except ValueError as exc:
                raise ServerError(f"POST {self.url}/v1/completions: {exc}", url=self.url) from None
            if "weight_versions" in answer["meta_info"] and adapter is None:
                self.per_choice_versions = True
            return answer

        return self.with_adapter(send)  # a client's adapter is named as the model

    def generate(self, input_ids: Sequence[int] | Sequence[Sequence[int]], sampling_params: dict | Sequence[dict], *,
                 return_logprob: bool = True, logprob_start_len: int = -1, top_logprobs_num: int = 0,
                 **fields: Any) -> dict | list[dict]:
        """SGLang's ``generate`` over ``/v1/completions``: one request per sequence (each with its own
        ``seed``), a batch's sent at once; answers as :meth:`SGLangClient.generate` shapes them (no
        input log-probs: ``logprob_start_len`` must be -1; :meth:`score` scores prompts).
        ``return_routed_experts``: read each choice's ``routed_experts`` (vLLM has no request field:
        a server launched with ``--enable-return-routed-experts`` returns them always)."""
        fields.pop("rid", None)  # vLLM stops a request whose client went away: no rid to abort it by
        routed = bool(fields.pop("return_routed_experts", False))
        if logprob_start_len != -1 or fields:
            raise ValueError("VLLMClient.generate takes no input log-probs nor extra fields (use score)")
        batch = len(input_ids) > 0 and isinstance(input_ids[0], (list, tuple))
        prompts = list(input_ids) if batch else [input_ids]
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        try:
            for p in params:
                completion_request([], p, model=None, logprobs=None)
        except ValueError as exc:
            raise ServerError(f"POST {self.url}/v1/completions: HTTP 400: {exc}", url=self.url, status=400) from None
        if len(prompts) == 1:
            answers = [self._one(prompts[0], params[0], return_logprob, top_logprobs_num, routed)]
        else:
            with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(prompts)), thread_name_prefix="vllm") as pool:
                answers = list(pool.map(lambda a: self._one(a[0], a[1], return_logprob, top_logprobs_num, routed),
                                        zip(prompts, params)))
        return answers if batch else answers[0]

    def score(self, input_ids: Sequence[int], logprob_start_len: int, top_logprobs_num: int = 0) -> dict:
        """:meth:`SGLangClient.score` from vLLM's ``prompt_logprobs`` (k = ``top_logprobs_num``; one
        token is generated and dropped, vLLM needs ``max_tokens`` >= 1)."""
        if not 1 <= logprob_start_len <= len(input_ids):
            raise ValueError(f"logprob_start_len must be in [1, {len(input_ids)}], got {logprob_start_len}")
        problem = self.scoring_problem()
        if problem:
            raise ServerError(problem, url=self.url)
        def send(adapter: str | None) -> dict:
            body = completion_request(input_ids, {"max_new_tokens": 1, "temperature": 1.0, "ignore_eos": True},
                                      model=adapter or self.model(), logprobs=None)
            body["prompt_logprobs"] = int(top_logprobs_num)
            return self.completions(body)

        if self.adapter is None:
            answer = self.with_adapter(send)
        else:  # one adapter request in the server's batch at a time (module note above)
            with _adapter_scoring_lock(self.url):
                answer = self.with_adapter(send)
        try:
            rows = answer["choices"][0]["prompt_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"POST {self.url}/v1/completions: no prompt_logprobs in the answer", url=self.url) from None
        if not isinstance(rows, list) or len(rows) != len(input_ids):
            raise ServerError(f"POST {self.url}/v1/completions: {len(rows or [])} prompt log-prob rows for "
                              f"{len(input_ids)} prompt tokens", url=self.url)
        version = str(self.adapter[1]) if self.adapter is not None else self.weight_version
        result: dict[str, Any] = {"token_log_probs": [], "weight_version": version}
        tops_ids, tops_lps = [], []
        for position in range(logprob_start_len, len(input_ids)):
            row = {int(k): v for k, v in (rows[position] or {}).items()}
            token = int(input_ids[position])
            if token not in row:
                raise ServerError(f"POST {self.url}/v1/completions: prompt_logprobs[{position}] lacks the prompt's "
                                  f"token {token}", url=self.url)
            result["token_log_probs"].append(float(row[token]["logprob"]))
            if top_logprobs_num > 0:
                best = sorted(row.items(), key=lambda kv: -float(kv[1]["logprob"]))[:top_logprobs_num]
                tops_ids.append([k for k, _ in best])
                tops_lps.append([float(v["logprob"]) for _, v in best])
        if top_logprobs_num > 0:
            result["top_ids"], result["top_log_probs"] = tops_ids, tops_lps
        return result
