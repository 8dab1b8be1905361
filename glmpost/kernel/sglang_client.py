"""An HTTP client for SGLang's native API, as served by SGLang itself and by ``glmpost serve``.

Only the endpoints glmpost uses (DESIGN.md §6: "in-process torch engine, also served over HTTP by
``glmpost serve`` with SGLang's native API"; same client at scale):

* ``POST /generate``: token ids in, token ids and log-probs out (TITO: no text round trip).
* ``POST /update_weights_from_disk``, ``GET /get_weight_version`` (``/model_info`` where a newer
  SGLang answers 404 there), ``GET /model_info``, ``GET /health``.
* ``GET /server_info`` (``/get_server_info`` where an older SGLang answers 404 there): the server's
  settings (SGLang's server args, e.g. ``enable_deterministic_inference``), read once per client
  (:meth:`SGLangClient.settings`).

Response shapes follow SGLang (python/sglang/srt/managers/tokenizer_manager.py
``detokenize_logprob_tokens`` / ``convert_logprob_style``; scheduler ``_process_input_token_logprobs``;
entrypoints/http_server.py ``update_weights_from_disk``): a log-prob entry is a list
``[logprob, token_id, text_or_None]``; ``input_token_logprobs`` starts at ``logprob_start_len`` and its
first entry's logprob is ``None``; ``finish_reason`` is ``{"type": "stop", "matched": id}``,
``{"type": "length", "length": n}`` or ``{"type": "abort", "message": ...}``.

An ``api_key`` is sent as ``Authorization: Bearer KEY`` (SGLang's ``--api-key``) and never appears in
a message; an ``admin_api_key`` (SGLang's ``--admin-api-key``, 2026-01, #15908) goes instead with the
control routes (:data:`ADMIN_ROUTES`), which then take only that key (SGLang's ``utils/auth.py``
``decide_request_auth``: ``ADMIN_OPTIONAL`` routes want the admin key when one is set, else the API
key; the other routes want the API key). Failures: connection errors, timeouts and HTTP 5xx are retried ``retries`` times with
exponential backoff (``backoff * 2**attempt`` seconds); HTTP 4xx is not retried (a 401 says whether
a key was sent). A request that finally fails
raises :class:`ServerError` (a :class:`~glmpost.errors.GlmpostError`, so a CLI prints one line).
:class:`SGLangPool` spreads requests over several servers with bounded concurrency and fails over to
the next server when one is unreachable.

This module holds :class:`SGLangClient`'s endpoints; the requests, keys, retries and
:class:`ServerError` are :mod:`glmpost.kernel.sglang_transport`'s (re-exported here).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from glmpost.kernel.lora_routes import LoraRoutes
from glmpost.kernel.sglang_transport import (
    ADMIN_ROUTES,
    SGLangTransport,
    ServerError,
    check_api_key,
    parse_server_urls,
    without_api_key,
)

__all__ = ["ADMIN_ROUTES", "SGLangClient", "ServerError", "check_api_key", "fresh_rid", "parse_server_urls",
           "without_api_key"]


class SGLangClient(LoraRoutes, SGLangTransport):
    """One SGLang (or ``glmpost serve``) server; its LoRA adapters: :class:`~glmpost.kernel.lora_routes.LoraRoutes`.

    Args:
        url: base URL, e.g. ``http://127.0.0.1:30000``.
        timeout: seconds to wait for one HTTP answer (a long generation must fit in it).
        retries: extra attempts after a connection error, timeout or 5xx (0 = try once).
        backoff: seconds before the first retry; doubled before each further one.
        api_key: sent as ``Authorization: Bearer KEY`` with every request (None: no header).
        admin_api_key: sent instead of ``api_key`` with the control routes (:data:`ADMIN_ROUTES`).
    """

    def __init__(self, url: str, *, timeout: float = 600.0, retries: int = 3, backoff: float = 0.5,
                 api_key: str | None = None, admin_api_key: str | None = None):
        self.url = parse_server_urls(url)[0]
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.api_key = check_api_key(api_key)
        self.admin_api_key = check_api_key(admin_api_key, "admin_api_key")
        self._settings: dict | None = None

    def copy(self, **changes: Any) -> "SGLangClient":
        """The same server and keys with other ``timeout`` / ``retries`` / ``backoff``."""
        settings = {"timeout": self.timeout, "retries": self.retries, "backoff": self.backoff, **changes}
        clone = type(self)(self.url, api_key=self.api_key, admin_api_key=self.admin_api_key, **settings)
        clone.adapter, clone.on_adapter_gone = self.adapter, self.on_adapter_gone
        return clone

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r})"

    # ------------------------------------------------------------------ endpoints

    def health(self) -> dict:
        """``GET /health``: ``{}`` when the server is up (SGLang answers an empty 200); raises ServerError."""
        answer = self.request("GET", "/health")
        return answer if isinstance(answer, dict) else {}

    def model_info(self) -> dict:
        """``GET /model_info`` (``/get_model_info`` on older SGLang).

        SGLang's keys include ``model_path``, ``tokenizer_path``, ``is_generation`` and
        ``weight_version``; ``glmpost serve`` adds ``tokenizer_revision``, ``policy_version``,
        ``architectures``, ``vocab_size`` and ``engine``.
        """
        try:
            return self.request("GET", "/model_info")
        except ServerError as exc:
            if exc.status != 404:
                raise
            return self.request("GET", "/get_model_info")

    def server_info(self) -> dict:
        """``GET /server_info`` (SGLang's current name), ``/get_server_info`` where that answers 404.

        SGLang answers its server args (``enable_deterministic_inference``, ``random_seed``, ...), the
        scheduler info, ``internal_states`` and ``version``; ``glmpost serve`` answers its model info,
        counters (``stats``), ``enable_deterministic_inference`` (true), ``version`` and
        ``log_prob_kind``."""
        try:
            answer = self.request("GET", "/server_info")
        except ServerError as exc:
            if exc.status != 404:
                raise
            answer = self.request("GET", "/get_server_info")
        return answer if isinstance(answer, dict) else {}

    def settings(self) -> dict:
        """:meth:`server_info` as read the first time (a server's settings do not change while it runs);
        ``{}`` for a server that has neither route (both 404). Raises ServerError otherwise."""
        if self._settings is None:
            try:
                self._settings = self.server_info()
            except ServerError as exc:
                if exc.status != 404:
                    raise
                self._settings = {}
        return self._settings

    def get_weight_version(self) -> str | None:
        """The server's ``weight_version`` (None if it has none): ``GET /get_weight_version``, or
        ``/model_info``'s ``weight_version`` where a newer SGLang retired that endpoint (404)."""
        try:
            answer = self.request("GET", "/get_weight_version")
        except ServerError as exc:
            if exc.status != 404:
                raise
            answer = self.model_info()
        version = answer.get("weight_version") if isinstance(answer, dict) else None
        return None if version is None else str(version)

    def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None, flush_cache: bool = True,
                                 abort_all_requests: bool = False) -> dict:
        """``POST /update_weights_from_disk``: load ``model_path`` in place of the current weights.

        Returns SGLang's answer ``{"success": bool, "message": str, "num_paused_requests": int}``
        (``glmpost serve`` adds ``weight_version``) — also when the server refuses the update
        (HTTP 400, ``success`` false, old weights kept). Raises ServerError when no answer comes.
        """
        body: dict[str, Any] = {"model_path": str(model_path), "flush_cache": flush_cache,
                                "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        answer = self.request("POST", "/update_weights_from_disk", body, ok_statuses=(400,))
        if not isinstance(answer, dict) or "success" not in answer:
            raise ServerError(f"POST {self.url}/update_weights_from_disk: unexpected answer {answer!r}", url=self.url)
        return answer

    def generate(self, input_ids: Sequence[int] | Sequence[Sequence[int]], sampling_params: dict | Sequence[dict], *,
                 return_logprob: bool = True, logprob_start_len: int = -1, top_logprobs_num: int = 0,
                 **fields: Any) -> dict | list[dict]:
        """``POST /generate`` with token ids (one prompt, or a batch as a list of lists).

        ``sampling_params`` as SGLang takes them: ``max_new_tokens``, ``temperature``, ``top_p``,
        ``top_k`` (-1 or 0 = off), ``stop_token_ids``, ``sampling_seed`` (per-sequence seed),
        ``ignore_eos``. Returns for one prompt (a list of these for a batch)::

            {"text": str, "output_ids": [int, ...],
             "meta_info": {"id": str, "finish_reason": {"type": "stop", "matched": id} | {"type": "length", "length": n},
                           "prompt_tokens": P, "completion_tokens": T, "cached_tokens": int, "weight_version": str|None,
                           # with return_logprob:
                           "output_token_logprobs": [[logprob, token_id, None], ...],           # T entries
                           "input_token_logprobs": [[None, id, None], [logprob, id, None], ...],  # P - start entries
                           # with top_logprobs_num = k > 0: per position a list of k [logprob, id, None]
                           "output_top_logprobs": [[[lp, id, None], ...], ...], "input_top_logprobs": [None, [...], ...]}}

        ``logprob_start_len`` -1 asks for no input log-probs (``input_token_logprobs`` empty). Further
        ``fields`` (``return_text_in_logprobs``, ...) go into the body as they are. With ``rid`` (a
        string, or one per sequence of a batch) a request that times out or loses its connection is
        aborted on the server (``/abort_request``) before it is sent again, so the server never
        generates the same sequences twice; the resend carries fresh ids (:func:`fresh_rid`): SGLang
        refuses an id it still holds with HTTP 400 ``Duplicate request ID detected: RID``, and it
        holds an aborted request's id until the scheduler has answered the abort
        (managers/tokenizer_manager.py ``_init_req_state``, sglang 0.5.23). A client with an
        ``adapter`` names it as ``lora_path`` (:meth:`~glmpost.kernel.lora_routes.LoraRoutes.with_adapter`).
        """
        first = self.adapter

        def send(name: str | None) -> Any:
            extra = {**fields, "lora_path": name} if name else fields
            rid = extra.get("rid")
            if first is not None and name != first[0] and rid is not None:  # a resend naming another adapter
                extra = {**extra, "rid": fresh_rid(rid) if isinstance(rid, str) else [fresh_rid(r) for r in rid]}
            return self._generate(input_ids, sampling_params, return_logprob, logprob_start_len, top_logprobs_num, extra)

        return self.with_adapter(send)

    def _generate(self, input_ids: Any, sampling_params: Any, return_logprob: bool, logprob_start_len: int,
                  top_logprobs_num: int, fields: dict) -> Any:
        """:meth:`generate`'s one request (with its aborts and resends under fresh ids)."""
        body = {"input_ids": [list(map(int, x)) for x in input_ids] if _is_batch(input_ids) else list(map(int, input_ids)),
                "sampling_params": sampling_params, "return_logprob": return_logprob,
                "logprob_start_len": logprob_start_len, "top_logprobs_num": top_logprobs_num, **fields}
        if fields.get("rid") is None:
            return self.request("POST", "/generate", body)
        sent = {"rid": fields["rid"]}

        def abort_then_rename(_: ServerError) -> dict:
            rid = sent["rid"]
            self.abort_quietly([rid] if isinstance(rid, str) else list(rid))
            sent["rid"] = fresh_rid(rid) if isinstance(rid, str) else [fresh_rid(r) for r in rid]
            return {**body, "rid": sent["rid"]}

        return self.request("POST", "/generate", body, before_retry=abort_then_rename)

    def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> Any:
        """``POST /abort_request``: stop request ``rid`` (or every request, ``abort_all``); SGLang answers
        the aborted requests themselves with ``finish_reason`` ``abort`` and their partial output."""
        body: dict[str, Any] = {"abort_all": abort_all}
        if rid is not None:
            body["rid"] = rid
        return self.request("POST", "/abort_request", body)

    def abort_quietly(self, rids: Sequence[str]) -> None:
        """Abort ``rids`` once each where the server answers (if not, the retry fails on its own)."""
        once = self.copy(retries=0, timeout=min(self.timeout, 30.0))
        for rid in rids:
            try:
                once.abort_request(rid)
            except ServerError:
                return

    def score(self, input_ids: Sequence[int], logprob_start_len: int, top_logprobs_num: int = 0) -> dict:
        """Log-probs of the given tokens ``input_ids[logprob_start_len:]``, each under its own prefix.

        A prefill-only ``/generate`` (``max_new_tokens`` 0, temperature 1: the model's own
        distribution) asking for input log-probs from ``logprob_start_len - 1``, whose first
        (``None``) entry SGLang leaves empty, so ``logprob_start_len`` must be >= 1. Returns::

            {"token_log_probs": [float, ...],        # len(input_ids) - logprob_start_len entries
             "top_ids": [[int] * k, ...],            # only with top_logprobs_num = k > 0, same length
             "top_log_probs": [[float] * k, ...],
             "weight_version": str | None}

        Entry ``i`` is ``log p(input_ids[start + i] | input_ids[:start + i])``; the top-k lists are the
        ``k`` most likely tokens at that same position.
        """
        if not 1 <= logprob_start_len <= len(input_ids):
            raise ValueError(f"logprob_start_len must be in [1, {len(input_ids)}], got {logprob_start_len}")
        answer = self.generate(input_ids, {"max_new_tokens": 0, "temperature": 1.0}, return_logprob=True,
                               logprob_start_len=logprob_start_len - 1, top_logprobs_num=top_logprobs_num)
        meta = answer["meta_info"]
        entries = meta.get("input_token_logprobs") or []
        want = len(input_ids) - logprob_start_len
        if len(entries) != want + 1:
            raise ServerError(f"POST {self.url}/generate: {len(entries)} input log-probs for a request that needs {want + 1}",
                              url=self.url)
        result: dict[str, Any] = {"token_log_probs": [float(e[0]) for e in entries[1:]],
                                  "weight_version": meta.get("weight_version")}
        if top_logprobs_num > 0:
            tops = (meta.get("input_top_logprobs") or [])[1:]
            if len(tops) != want:
                raise ServerError(f"POST {self.url}/generate: {len(tops)} input top-k rows, expected {want}", url=self.url)
            result["top_ids"] = [[int(e[1]) for e in row] for row in tops]
            result["top_log_probs"] = [[float(e[0]) for e in row] for row in tops]
        return result


def fresh_rid(rid: str) -> str:
    """``rid`` renamed for a resend: ``BASE~resend-XXXXXXXX`` (``BASE`` the id first sent, the suffix
    new each time), so no resend reuses an id the server may still hold."""
    return f"{rid.partition('~resend-')[0]}~resend-{uuid.uuid4().hex[:8]}"


def _is_batch(input_ids: Any) -> bool:
    return len(input_ids) > 0 and isinstance(input_ids[0], (list, tuple))
