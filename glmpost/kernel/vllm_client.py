"""An HTTP client for vLLM's OpenAI-compatible server (and ``glmpost serve --api vllm``), presenting the
interface of :class:`~glmpost.kernel.sglang_client.SGLangClient`: ``generate`` answers in SGLang's
shape, so the SGLang pool, backend, score-teacher, diff-logprobs and weight-sync paths take it.

Routes and fields as read in vLLM's source (upstream ``vllm-project/vllm``; the completions protocol at
commit 002032e, ``vllm/entrypoints/openai/completion/protocol.py``; ``/server_info``, ``/collective_rpc``
and the RL routes at 09cb327 / 0100a21, ``vllm/entrypoints/serve/{instrumentator/server_info.py,
rpc/api_router.py,dev/rlhf/api_router.py}``):

* ``POST /v1/completions`` with a token-id ``prompt`` (one list per request: vLLM gives every prompt
  of a request the same ``seed``, and glmpost seeds each sequence on its own, so a batch is sent as
  concurrent single requests), an explicit ``max_tokens`` (vLLM's default is 16), ``temperature``,
  ``top_p``, ``top_k`` (-1 = off), ``seed``, ``stop_token_ids``, ``ignore_eos`` and, always, the
  neutral ``min_p`` 0, ``repetition_penalty`` 1, ``presence_penalty`` / ``frequency_penalty`` 0: a
  field left out takes the server's default from the model's generation config
  (``to_sampling_params``: "user -> server default -> OpenAI default"), which would change what
  is sampled while the record says otherwise. ``logprobs`` k (0: the sampled token's only),
  ``return_token_ids`` (``choices[].token_ids``, ``prompt_token_ids``), ``return_tokens_as_token_ids``
  (top-k keys ``token_id:N``). ``finish_reason`` ``stop`` (``stop_reason`` the stop token id, None
  for eos), ``length``, ``abort`` (or ``error``, ``repetition``: aborted here).
* Scoring: ``prompt_logprobs`` k with ``max_tokens`` 1 (vLLM refuses 0): ``prompt_logprobs[0]`` is
  None, entry ``i`` maps token ids (JSON keys) to ``{"logprob", "rank", "decoded_token"}`` and holds
  the prompt's own token plus the top k. Prompt log-probs are the model's own, ``log_softmax(logits)``
  (``compute_logprobs``), for both log-prob modes: prompt tokens skip the sampling processors; but
  under ``raw_logits`` / ``processed_logits`` they are the **logits** (vLLM 0.32
  ``v1/worker/gpu_model_runner.py`` ``_get_prompt_logprobs_dict``, which the CPU runner inherits), so
  :meth:`VLLMClient.score` refuses those modes (:meth:`VLLMClient.scoring_problem`).
* ``GET /v1/models`` (the served model's ``id`` is sent as ``model``), ``GET /health``.
* ``GET /server_info?config_format=json`` (dev mode, ``VLLM_SERVER_DEV_MODE=1``):
  ``vllm_config.model_config.logprobs_mode`` and ``vllm_env.VLLM_BATCH_INVARIANT``, mapped by
  :meth:`VLLMClient.settings` onto glmpost's keys: ``raw_logprobs`` (vLLM's default) is glmpost's
  ``raw``, ``processed_logprobs`` (after temperature, top-k, top-p, renormalised) glmpost's
  ``sampled``; the logits modes have no log-prob kind (:data:`LOGITS_MODES`, refused by the rollout).
  ``enable_deterministic_inference`` is ``VLLM_BATCH_INVARIANT``: only then does a seed give the same
  tokens whatever else the server batches.
* Weights: ``POST /pause?mode=wait&wait_for_inflight_requests=true`` (both spellings: the first
  ``/pause`` (#28037, 2025-11) took only ``wait_for_inflight_requests`` and, without it, aborts what
  is in flight; later releases take ``mode`` and map the old flag to ``mode="wait"`` with a
  DeprecationWarning; 0.32 (``entrypoints/rl/online/api_router.py``) takes only ``mode`` and FastAPI
  ignores the other), ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path":
  DIR}}`` (the worker's ``reload_weights(weights_path, is_checkpoint_format=True)``), ``POST
  /reset_prefix_cache`` (0.32 answers ``{"success": bool}``, false while blocks are held),
  ``POST /update_weight_version {"new_version": V}`` (-> ``{"success": true, "new_version": V}``),
  ``POST /resume``; ``GET /is_paused`` -> ``{"is_paused": bool}``; ``GET /weight_info`` ->
  ``{"weight_version": label}`` (``"default"`` until one is set; a reload through ``/collective_rpc``
  does not change it). All of these exist only with ``VLLM_SERVER_DEV_MODE=1`` (0.32
  ``entrypoints/launchers/api_server/routers.py``) and are not behind ``--api-key``, which guards
  only ``/v1``, ``/v2`` and ``/inference``. ``GET /version`` -> ``{"version": "0.32.0"}`` always.
* vLLM 0.34 answers a new request HTTP 503 while paused (0.27.1 and 0.32 queue it): such a 503 waits
  for ``GET /is_paused`` to clear, on its own budget (``pause_wait``), not the retry count. From 0.34,
  ``return_weight_versions: true`` gives each choice ``weight_versions``, output-token spans
  ``[{"version", "start", "end"}]`` (``vllm/outputs.py`` ``WeightVersionSpan``; sent only to a
  server whose ``/version`` is at least 0.34, older ones log every unknown field).
* ``temperature`` above 2 is refused by vLLM (0.32 ``SamplingParams._verify_args``: ``temperature
  must be in [0, 2]``), so the client refuses it before sending.

Routed experts (``rollout --record-routing``): a vLLM launched with ``--enable-return-routed-experts``
answers every ``/v1/completions`` choice with ``routed_experts``, base64 of ``.npy`` bytes of shape
``[prompt + output - 1, num_hidden_layers, num_experts_per_tok]`` (uint8 / uint16; None without the
flag, or for a request aborted before its first forward); there is no request field
(``CompletionResponseChoice.routed_experts`` in ``vllm/entrypoints/openai/completion/protocol.py`` as
read at ``local-inference-lab/vllm`` 7b2bff9, a mirror of upstream ``vllm-project/vllm``; the rows
come from ``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py`` at vllm-project/vllm
42fa4c0, whose buffer is ``[tokens, num_hidden_layers, num_experts_per_tok]`` with zero rows for the
dense layers, as SGLang's). :func:`sglang_routed_experts` turns it into SGLang's
``meta_info.routed_experts`` (base64 of int32 of the same rows), which the routing code reads.


``weight_version``: a server with ``/weight_info`` reports the label glmpost set after its reload
(``"default"``, never set, counts as none); one without it (no dev mode, or older than the label
routes) has only what glmpost confirmed itself by a fingerprint (:mod:`glmpost.kernel.fingerprint`),
None until then: answers never claim more.
"""

from __future__ import annotations

import time
import base64
import io
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from glmpost.kernel.sglang_client import ServerError, SGLangClient
from glmpost.kernel.sglang_sampling import EXPLICIT_DEFAULTS

LOGPROBS_MODES = {"raw_logprobs": "raw", "processed_logprobs": "sampled"}  # vLLM --logprobs-mode -> glmpost kind
LOGITS_MODES = ("raw_logits", "processed_logits")
NEUTRAL_FIELDS = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
_SGLANG_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "sampling_seed",
                "no_stop_trim", "skip_special_tokens"}
MAX_PARALLEL = 64  # single requests one generate call sends at once
MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses more
PAUSE_WAIT = 1800.0  # seconds a request answered 503 by a paused server waits for /is_paused to clear
PAUSE_POLL = 0.25  # seconds between two /is_paused
DEFAULT_LABEL = "default"  # vLLM's weight_version before anyone sets one (v1/engine/core.py)
UNCONFIRMED_LABEL = "glmpost-unconfirmed"  # set where a reload may or may not have happened
DEV_MODE_ROUTES = ("/pause", "/resume", "/is_paused", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version",
                   "/weight_info", "/server_info")
DEV_MODE_HINT = ("answers 404 on /pause and /collective_rpc: vLLM serves its weight-reload routes only in dev mode; "
                 "start it with VLLM_SERVER_DEV_MODE=1 (and keep it on loopback or a private network: those routes "
                 "take no API key)")

__all__ = ["DevModeError", "LOGITS_MODES", "LOGPROBS_MODES", "ReloadUncertain", "VLLMClient", "completion_request",
           "sglang_answer", "sglang_routed_experts"]


class DevModeError(ServerError):
    """A vLLM server without ``VLLM_SERVER_DEV_MODE=1``: no reload routes (retrying cannot help)."""


class ReloadUncertain(ServerError):
    """``reload_weights`` got no answer in time; the server finished it later, with which weights is
    unknown: confirm them before any new reload (:func:`glmpost.weight_sync.vllm_sync.sync_vllm_server`)."""


def completion_request(prompt: Sequence[int], sampling: dict[str, Any], *, model: str | None, logprobs: int | None) -> dict:
    """The ``/v1/completions`` body of one sequence from SGLang-style ``sampling`` params
    (``max_new_tokens`` >= 1, ``temperature``, ``top_p``, ``top_k`` -1/0 off, ``stop_token_ids``,
    ``ignore_eos``, ``sampling_seed``); raises ValueError for a key vLLM has no field for."""
    # SGLang's explicit no-op keys (glmpost.kernel.sglang_sampling) say nothing to vLLM: NEUTRAL_FIELDS does.
    unknown = sorted(k for k in set(sampling) - _SGLANG_KEYS if EXPLICIT_DEFAULTS.get(k, ...) != sampling[k])
    if unknown:
        raise ValueError(f"sampling_params {', '.join(unknown)} have no vLLM completions field here")
    max_tokens = int(sampling.get("max_new_tokens", 128))
    if max_tokens < 1:
        raise ValueError(f"vLLM samples at least one token (max_tokens >= 1), got max_new_tokens {max_tokens}")
    temperature = float(sampling.get("temperature", 1.0))
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise ValueError(f"vLLM takes temperature in [0, 2] (SamplingParams), got {temperature:g}")
    body: dict[str, Any] = {"prompt": [int(t) for t in prompt], "max_tokens": max_tokens,
                            "temperature": float(sampling.get("temperature", 1.0)), "top_p": float(sampling.get("top_p", 1.0)),
                            "top_k": _top_k(sampling.get("top_k", -1)),
                            "stop_token_ids": [int(t) for t in sampling.get("stop_token_ids") or []],
                            "ignore_eos": bool(sampling.get("ignore_eos", False)),
                            "skip_special_tokens": bool(sampling.get("skip_special_tokens", False)),
                            "return_token_ids": True, **NEUTRAL_FIELDS}
    if model is not None:
        body["model"] = model
    if sampling.get("sampling_seed") is not None:
        body["seed"] = int(sampling["sampling_seed"])
    if logprobs is not None:
        body["logprobs"] = int(logprobs)
        body["return_tokens_as_token_ids"] = True
    return body


def _top_k(value: Any) -> int:
    """-1 for no top-k: every vLLM release takes it (0 means off only since 2025; older ones refuse 0)."""
    k = int(value)
    return k if k > 0 else -1


def _top_row(row: Any) -> list[list]:
    """A ``top_logprobs`` dict (keys ``token_id:N``) as SGLang entries ``[lp, id, None]``, most likely first."""
    entries = [[float(lp), int(str(key).rsplit(":", 1)[-1]), None] for key, lp in (row or {}).items()]
    return sorted(entries, key=lambda e: -e[0])


def sglang_routed_experts(value: Any) -> str:
    """vLLM's per-choice ``routed_experts`` (base64 of ``.npy`` bytes, ``[positions, layers, k]``
    of an integer dtype) as SGLang's ``meta_info.routed_experts`` (base64 of int32, the same rows);
    raises ValueError (one line) for anything else."""
    try:
        array = np.load(io.BytesIO(base64.b64decode(value, validate=True)), allow_pickle=False)
    except (ValueError, TypeError, OSError, EOFError) as exc:
        raise ValueError(f"routed_experts is not base64 of a .npy array ({str(exc).splitlines()[0]})") from None
    if not isinstance(array, np.ndarray) or array.ndim != 3 or array.dtype.kind not in "iu":
        raise ValueError(f"routed_experts is a {getattr(array, 'dtype', type(array).__name__)} array of shape "
                         f"{list(getattr(array, 'shape', []))}, not integer [positions, layers, k]")
    return base64.b64encode(np.ascontiguousarray(array, dtype=np.int32).tobytes()).decode("ascii")


def sglang_answer(response: Any, *, weight_version: str | None, top_logprobs_num: int = 0,
                  routed_experts: bool = False) -> dict:
    """One ``/v1/completions`` answer (one choice) in the shape SGLang's ``/generate`` gives one
    sequence; with ``routed_experts``, the choice's routed experts as SGLang's (:func:`sglang_routed_experts`)."""
    choices = response.get("choices") if isinstance(response, dict) else None
    if not choices or not isinstance(choices[0], dict):
        raise ValueError(f"no choices in the answer {str(response)[:200]!r}")
    choice = choices[0]
    ids = choice.get("token_ids")
    if ids is None:
        raise ValueError("the answer has no token_ids (a vLLM older than return_token_ids, 2025-08?)")
    ids = [int(t) for t in ids]
    reason = choice.get("finish_reason")
    if reason == "stop":
        stop = choice.get("stop_reason")
        finish: dict[str, Any] = {"type": "stop", "matched": stop if stop is not None else (ids[-1] if ids else None)}
    elif reason == "length":
        finish = {"type": "length", "length": len(ids)}
    else:
        finish = {"type": "abort", "message": f"vLLM finish_reason {reason!r}"}
    spans = choice.get("weight_versions")
    if isinstance(spans, list) and spans:  # vLLM 0.34 return_weight_versions: the labels that sampled the tokens
        labels = {str(span.get("version")) for span in spans if isinstance(span, dict)}
        if labels != {DEFAULT_LABEL}:  # vLLM's "default": no label set, what glmpost confirmed stands
            weight_version = labels.pop() if len(labels) == 1 else None  # several: no one version for the sequence
            weight_version = None if weight_version == UNCONFIRMED_LABEL else weight_version
    meta: dict[str, Any] = {"id": response.get("id"), "finish_reason": finish,
                            "prompt_tokens": len(choice.get("prompt_token_ids") or []), "completion_tokens": len(ids),
                            "weight_version": weight_version}
    if isinstance(spans, list):
        meta["weight_versions"] = spans
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        lps = logprobs.get("token_logprobs") or []
        meta["output_token_logprobs"] = [[None if lp is None else float(lp), t, None] for lp, t in zip(lps, ids)]
        if top_logprobs_num > 0:
            meta["output_top_logprobs"] = [_top_row(row)[:top_logprobs_num] for row in logprobs.get("top_logprobs") or []]
    if routed_experts and choice.get("routed_experts") is not None:
        meta["routed_experts"] = sglang_routed_experts(choice["routed_experts"])
    return {"text": choice.get("text", ""), "output_ids": ids, "meta_info": meta}


class VLLMClient(SGLangClient):
    """One vLLM (or ``glmpost serve --api vllm``) server behind :class:`SGLangClient`'s interface.

    ``weight_version``: the version the server serves as far as glmpost knows (None: unknown), stamped
    on every answer's ``meta_info`` unless the answer carries its own ``weight_versions``: the label
    ``/weight_info`` reported (``labelled``) or, for a server without labels, what a fingerprint confirmed.
    ``pause_wait``: seconds a request answered 503 while the server is paused waits for ``/is_paused``
    to clear (vLLM 0.34), apart from ``retries``."""

    engine = "vllm"

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

    def _once(self, method: str, path: str, data: bytes | None, ok: set[int]) -> Any:
        """:meth:`SGLangClient._once`, except that a 503 from a paused server (vLLM 0.34 answers every
        new request so while paused) waits for ``GET /is_paused`` to clear and is sent again, within
        ``pause_wait`` seconds: a weight sync costs no sequence and no retry."""
        deadline = None
        while True:
            try:
                return super()._once(method, path, data, ok)
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
        parts = []
        for piece in str(release or "").split("."):
            digits = "".join(c for c in piece if c.isdigit())
            if not digits or digits != piece[: len(digits)]:
                break
            parts.append(int(digits))
        return bool(parts) and tuple(parts) >= wanted

    def weight_label(self) -> str | None:
        """``GET /weight_info``'s ``weight_version``: the label set by ``/update_weight_version`` (None for
        vLLM's ``"default"``, never set, and glmpost's unconfirmed mark); raises ServerError, status 404
        for a server without labels (no dev mode, or older than the label routes)."""
        answer = self.request("GET", "/weight_info")
        label = answer.get("weight_version") if isinstance(answer, dict) else None
        return None if label is None or str(label) in (DEFAULT_LABEL, UNCONFIRMED_LABEL) else str(label)

    def read_label(self) -> bool:
        """Take the server's label as ``weight_version`` (``labelled`` True) when it has set one; False
        (nothing changed) for a server without labels or with none set."""
        try:
            label = self.weight_label()
        except ServerError as exc:
            if exc.status != 404:
                raise
            self.has_labels = False
            return False
        self.has_labels = True
        if label is None:
            return False
        self.weight_version, self.labelled = label, True
        return True

    def set_label(self, label: str) -> None:
        """``POST /update_weight_version {"new_version": label}`` (answers ``{"success": true, "new_version"}``)."""
        self.request("POST", "/update_weight_version", {"new_version": str(label)})

    def is_paused(self) -> bool:
        """``GET /is_paused``'s ``is_paused``."""
        answer = self.request("GET", "/is_paused")
        return bool(answer.get("is_paused")) if isinstance(answer, dict) else False

    def get_weight_version(self) -> str | None:
        """The server's label where it has one set (``/weight_info``), else the version glmpost
        confirmed by fingerprint (None: not confirmed)."""
        self.read_label()
        return self.weight_version

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
        body = completion_request(prompt, sampling, model=self.model(),
                                  logprobs=top_logprobs_num if return_logprob else None)
        if self.release_at_least(0, 34):
            body["return_weight_versions"] = True
        try:
            answer = sglang_answer(self.completions(body), weight_version=self.weight_version,
                                   top_logprobs_num=top_logprobs_num,
                                   routed_experts=routed)
            if "weight_versions" in answer["meta_info"]:
                self.per_choice_versions = True
            return answer
        except ValueError as exc:
            raise ServerError(f"POST {self.url}/v1/completions: {exc}", url=self.url) from None

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
        body = completion_request(input_ids, {"max_new_tokens": 1, "temperature": 1.0, "ignore_eos": True},
                                  model=self.model(), logprobs=None)
        body["prompt_logprobs"] = int(top_logprobs_num)
        answer = self.completions(body)
        try:
            rows = answer["choices"][0]["prompt_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"POST {self.url}/v1/completions: no prompt_logprobs in the answer", url=self.url) from None
        if not isinstance(rows, list) or len(rows) != len(input_ids):
            raise ServerError(f"POST {self.url}/v1/completions: {len(rows or [])} prompt log-prob rows for "
                              f"{len(input_ids)} prompt tokens", url=self.url)
        result: dict[str, Any] = {"token_log_probs": [], "weight_version": self.weight_version}
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

    def pause(self) -> bool:
        """``POST /pause?mode=wait&wait_for_inflight_requests=true``: in-flight requests finish on the old
        weights, new ones wait (or, on 0.34, are answered 503). True when paused; False for a vLLM older
        than ``/pause`` (404), reloaded unpaused. When the pause gets no answer in time the server is
        resumed (it may be paused by then) before the error is raised."""
        try:
            self.request("POST", "/pause?mode=wait&wait_for_inflight_requests=true")
            return True
        except ServerError as exc:
            if exc.status == 404:
                return False
            if exc.status is None:
                self.resume_quietly()
                raise ServerError(f"{exc}; sent /resume so that the server is not left paused", url=self.url,
                                  retryable=True) from None
            raise

    def resume_quietly(self) -> bool:
        """``POST /resume`` once, with a short timeout; True when it answered 200."""
        try:
            self.copy(retries=1, timeout=min(self.timeout, 30.0), backoff=0.2).request("POST", "/resume")
            return True
        except ServerError:
            return False

    def wait_responsive(self, seconds: float) -> bool:
        """Poll ``GET /is_paused`` until the server answers it (a reload that outlived its request has
        then ended: the engine answers no utility call while the workers load), at most ``seconds``."""
        deadline = time.monotonic() + seconds
        quick = self.copy(retries=0, timeout=max(1.0, min(self.timeout, 10.0)))
        while True:
            try:
                quick.is_paused()
                return True
            except ServerError as exc:
                if exc.status is not None and exc.status != 503:
                    return True  # it answers (e.g. 404 on an older vLLM)
            if time.monotonic() >= deadline:
                return False
            time.sleep(PAUSE_POLL)

    def reload_weights(self, model_path: str, weight_version: str | None = None) -> bool:
        """Load ``model_path`` in place of the served weights: :meth:`pause`, ``/collective_rpc
        reload_weights``, ``/reset_prefix_cache`` (no cached prefix of the old weights is reused; its
        ``success`` false is an error), ``/update_weight_version`` ``weight_version`` (where the server
        has labels), ``/resume`` (also after a failure, but never while a reload may still run).

        Returns True when the server took the label (then ``weight_version`` is it, ``labelled``); False
        for a server without labels (the caller confirms by fingerprint). Raises :class:`DevModeError`
        where ``/pause`` and ``/collective_rpc`` answer 404, :class:`ReloadUncertain` where the reload
        got no answer in time (the server is resumed only once it answers again, its label set to
        glmpost's unconfirmed mark)."""
        self.weight_version, self.labelled = None, False
        paused = self.pause()
        resume = paused
        try:
            try:
                self.request("POST", "/collective_rpc", {"method": "reload_weights",
                                                         "kwargs": {"weights_path": str(model_path)}})
            except ServerError as exc:
                if exc.status == 404 and not paused:
                    raise DevModeError(f"the server {DEV_MODE_HINT}", url=self.url, status=404) from None
                if exc.status is not None:
                    if exc.status >= 500:
                        self._mark_unconfirmed()  # a failed reload may leave some tensors loaded
                    raise
                responsive = self.wait_responsive(self.pause_wait)
                if not responsive:
                    resume = False  # resuming a server that is still loading would sample from half the weights
                else:
                    self._mark_unconfirmed()
                raise ReloadUncertain(f"{exc}: reload_weights got no answer in time; "
                                      + ("the server answers again, with weights to be confirmed before any new reload"
                                         if responsive else f"the server did not answer within {self.pause_wait:g} s and "
                                         "is left paused"), url=self.url, retryable=True) from None
            self.reset_prefix_cache()
            return self.take_label(weight_version)
        finally:
            if resume:
                self.request("POST", "/resume")

    def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache``; vLLM 0.32 answers ``{"success": bool}`` (false while blocks are
        held): false is retried a few times, then an error. An older empty answer counts as done."""
        for attempt in range(4):
            answer = self.request("POST", "/reset_prefix_cache")
            if not isinstance(answer, dict) or answer.get("success") is not False:
                return
            time.sleep(self.backoff * 2 ** attempt)
        raise ServerError(f"POST {self.url}/reset_prefix_cache: the server answered success false (blocks still held)",
                          url=self.url)

    def take_label(self, weight_version: str | None) -> bool:
        """Set ``weight_version`` as the server's label and read it back (``/weight_info``); False where
        the server has no labels (404) or none was given."""
        if weight_version is None:
            return False
        try:
            self.set_label(weight_version)
        except ServerError as exc:
            if exc.status in (404, 405):
                return False
            raise
        if self.weight_label() != str(weight_version):
            raise ServerError(f"GET {self.url}/weight_info does not report the label {weight_version} just set",
                              url=self.url)
        self.weight_version, self.labelled = str(weight_version), True
        return True

    def _mark_unconfirmed(self) -> None:
        """Label the server unconfirmed (where it has labels): its tokens are then of unknown version."""
        try:
            self.set_label(UNCONFIRMED_LABEL)
        except ServerError:
            pass

    def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None, flush_cache: bool = True,
                                 abort_all_requests: bool = False) -> dict:
        """:meth:`reload_weights` answered as SGLang answers an update (``success``, ``message``, and
        ``weight_version`` where the server took the label; otherwise the version stays unconfirmed)."""
        try:
            labelled = self.reload_weights(model_path, weight_version)
        except DevModeError:
            raise
        except ServerError as exc:
            if exc.retryable:
                raise
            return {"success": False, "message": str(exc)}
        answer = {"success": True, "message": f"reloaded weights from {model_path}"}
        return {**answer, "weight_version": self.weight_version} if labelled else answer


def vllm_settings(info: dict) -> dict:
    """:meth:`VLLMClient.settings` from a ``/server_info?config_format=json`` answer."""
    config = info.get("vllm_config")
    model_config = config.get("model_config") if isinstance(config, dict) else None
    mode = model_config.get("logprobs_mode") if isinstance(model_config, dict) else None
    env = info.get("vllm_env") if isinstance(info.get("vllm_env"), dict) else {}
    invariant = env.get("VLLM_BATCH_INVARIANT")
    return {"logprobs_mode": mode, "log_prob_kind": LOGPROBS_MODES.get(mode),
            "enable_deterministic_inference": invariant is True or str(invariant).lower() in ("1", "true")}
