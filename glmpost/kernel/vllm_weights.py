"""The weight routes of a vLLM server (dev mode), as :class:`VLLMWeights`, the part of
:class:`~glmpost.kernel.vllm_client.VLLMClient` that pauses the server, reloads its weights in place,
labels them and reads the label back.

Routes as read in vLLM's source (upstream ``vllm-project/vllm``; ``/collective_rpc`` and the RL routes
at 09cb327 / 0100a21, ``vllm/entrypoints/serve/{rpc/api_router.py,dev/rlhf/api_router.py}``):

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

``weight_version``: a server with ``/weight_info`` reports the label glmpost set after its reload
(``"default"``, never set, counts as none); one without it (no dev mode, or older than the label
routes) has only what glmpost confirmed itself by a fingerprint (:mod:`glmpost.kernel.fingerprint`),
None until then: answers never claim more.
"""

from __future__ import annotations

import time

from glmpost.kernel.sglang_client import ServerError
from glmpost.kernel.vllm_protocol import DEFAULT_LABEL, UNCONFIRMED_LABEL

PAUSE_POLL = 0.25  # seconds between two /is_paused
DEV_MODE_HINT = ("answers 404 on /pause and /collective_rpc: vLLM serves its weight-reload routes only in dev mode; "
                 "start it with VLLM_SERVER_DEV_MODE=1 (and keep it on loopback or a private network: those routes "
                 "take no API key)")

__all__ = ["DevModeError", "ReloadUncertain", "VLLMWeights"]


class DevModeError(ServerError):
    """A vLLM server without ``VLLM_SERVER_DEV_MODE=1``: no reload routes (retrying cannot help)."""


class ReloadUncertain(ServerError):
    """``reload_weights`` got no answer in time; the server finished it later, with which weights is
    unknown: confirm them before any new reload (:func:`glmpost.weight_sync.vllm_sync.sync_vllm_server`)."""


class VLLMWeights:
    """The weight routes of :class:`~glmpost.kernel.vllm_client.VLLMClient`, mixed in before
    :class:`~glmpost.kernel.sglang_client.SGLangClient`, whose ``request`` and ``copy`` they use, with
    the client's ``weight_version``, ``labelled``, ``has_labels`` and ``pause_wait``."""

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
