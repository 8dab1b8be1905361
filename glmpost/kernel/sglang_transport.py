"""The transport under :class:`~glmpost.kernel.sglang_client.SGLangClient`: one JSON request with
retries and keys (:class:`SGLangTransport`, a mixin), the error it raises (:class:`ServerError`), and
the URL and API-key helpers (:func:`parse_server_urls`, :func:`check_api_key`, :func:`without_api_key`,
:data:`ADMIN_ROUTES`). See :mod:`glmpost.kernel.sglang_client` for the retry and key rules.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from glmpost.config import ConfigError
from glmpost.errors import GlmpostError

__all__ = ["ADMIN_ROUTES", "SGLangTransport", "ServerError", "check_api_key", "parse_server_urls", "without_api_key"]

class ServerError(GlmpostError):
    """A request to a server that finally failed.

    Attributes:
        url: the server's base URL.
        status: the HTTP status, or None when no HTTP answer came (connection refused, timeout).
        retryable: True for connection errors, timeouts and 5xx (another server may succeed).
    """

    def __init__(self, message: str, *, url: str, status: int | None = None, retryable: bool = False):
        super().__init__(message)
        self.url = url
        self.status = status
        self.retryable = retryable


def parse_server_urls(value: str | Sequence[str]) -> list[str]:
    """``"http://a:1,http://b:2"`` (or a list) -> normalised base URLs without a trailing slash.

    A bare ``host:port`` gets ``http://``. Raises ValueError for an empty list.
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    urls = []
    for item in items:
        item = item.strip().rstrip("/")
        if not item:
            continue
        if "://" not in item:
            item = "http://" + item
        urls.append(item)
    if not urls:
        raise ValueError("no server URL given")
    return urls


def check_api_key(key: str | None, field: str = "api_key") -> str | None:
    """``key`` when it can go in an HTTP header (printable ASCII, no spaces), None for none or "".

    Raises :class:`~glmpost.config.ConfigError` naming the setting ``field`` that holds it (every
    config that holds a key calls it so) and never repeating the key."""
    if key is None or key == "":
        return None
    if not all("!" <= ch <= "~" for ch in key):
        raise ConfigError("{%s}: an API key must be printable ASCII without spaces" % field)
    return key


def without_api_key(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` without ``api_key`` and ``admin_api_key``: what stage.json, shard headers and logs may record."""
    return {name: value for name, value in options.items() if name not in ("api_key", "admin_api_key")}


# SGLang's ADMIN_OPTIONAL routes (entrypoints/http_server.py ``@auth_level``) that glmpost calls.
ADMIN_ROUTES = frozenset({"/update_weights_from_disk", "/abort_request", "/flush_cache", "/pause_generation",
                          "/continue_generation", "/update_weight_version", "/load_lora_adapter", "/unload_lora_adapter"})

_RETRYABLE_EXCEPTIONS = (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError,
                         http.client.HTTPException, OSError)


class SGLangTransport:
    """The HTTP requests of :class:`~glmpost.kernel.sglang_client.SGLangClient`, which sets ``url``,
    ``timeout``, ``retries``, ``backoff``, ``api_key`` and ``admin_api_key``."""

    url: str
    timeout: float
    retries: int
    backoff: float
    api_key: str | None
    admin_api_key: str | None

    def request(self, method: str, path: str, body: Any = None, *, ok_statuses: Iterable[int] = (),
                before_retry: Callable[[ServerError], Any] | None = None, text: bool = False) -> Any:
        """One JSON request with retries; returns the decoded JSON answer (None for an empty body).

        ``ok_statuses`` are non-2xx statuses whose JSON body is returned instead of raising (SGLang
        answers a refused weight update with HTTP 400 and ``{"success": false, ...}``).
        ``before_retry(error)`` runs before each retry of a request that got no answer (a timeout or
        a dropped connection: the server may still be working on it), e.g. to abort it there first;
        when it returns a body, that body is sent from then on (a resend under fresh request ids).
        ``text``: an answer that is no JSON is returned as its text (vLLM answers its LoRA routes so).
        """
        ok = set(ok_statuses)
        data = None if body is None else json.dumps(body).encode()
        last: ServerError | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
                if before_retry is not None and last is not None and last.status is None:
                    resend = before_retry(last)
                    if resend is not None:
                        data = json.dumps(resend).encode()
            try:
                return self._once(method, path, data, ok, text)
            except ServerError as exc:
                last = exc
                if not exc.retryable:
                    raise
        assert last is not None
        raise ServerError(f"{last} (after {self.retries + 1} attempts)", url=self.url, status=last.status, retryable=True)

    def _headers(self, data: bytes | None, path: str) -> dict[str, str]:
        """JSON, and the key the route takes: the admin key on a control route when one is given, else the API key."""
        headers = {"Content-Type": "application/json"} if data is not None else {}
        admin = self.admin_api_key is not None and path.split("?", 1)[0] in ADMIN_ROUTES
        key = self.admin_api_key if admin else self.api_key
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _refused_key(self, path: str) -> str:
        """What an HTTP 401 on ``path`` means, naming the key that was (or was not) sent."""
        admin = path.split("?", 1)[0] in ADMIN_ROUTES
        if admin and self.admin_api_key is not None:
            return "the server refused the admin API key"
        if admin:
            return ("the server refused the API key on a control route (a server launched with --admin-api-key takes "
                    "only that key there: pass admin_api_key)" if self.api_key is not None
                    else "the server wants a key on this control route and none was given (api_key, or admin_api_key "
                    "for a server launched with --admin-api-key)")
        return "the server refused the API key" if self.api_key is not None else "the server wants an API key and none was given"

    def _once(self, method: str, path: str, data: bytes | None, ok: set[int], text: bool = False) -> Any:
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=self._headers(data, path))
        where = f"{method} {self.url}{path}"
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as response:
                return _decode(response.read(), where, self.url, text)
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            if exc.code in ok:
                return _decode(raw, where, self.url)
            detail = _error_detail(raw) or exc.reason
            if exc.code in (401, 403):
                detail = f"{detail}: {self._refused_key(path)}"
            raise ServerError(f"{where}: HTTP {exc.code}: {detail}", url=self.url, status=exc.code,
                              retryable=exc.code >= 500) from None
        except _RETRYABLE_EXCEPTIONS as exc:
            reason = getattr(exc, "reason", None) or exc
            raise ServerError(f"{where}: {str(reason) or type(reason).__name__}", url=self.url,
                              retryable=True) from None


def _decode(raw: bytes, where: str, url: str, as_text: bool = False) -> Any:
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        if as_text:
            return raw.decode(errors="replace")
        text = raw[:200].decode(errors="replace").strip()
        raise ServerError(f"{where}: answer is not JSON: {text!r}", url=url) from None


def _error_detail(raw: bytes) -> str:
    try:
        payload = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw[:200].decode(errors="replace").strip()
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        for key in ("message", "detail", "error", "error_message"):  # error_message: SGLang's LoRA routes
            if key in payload:
                return _short_key_list(str(payload[key]))
    return str(payload)[:200]


def _short_key_list(detail: str) -> str:
    """SGLang 0.5.23's 400 for an unknown key (``{"error": "unknown field `X`, expected one of `a`,
    `b`, ..."}``, api/v1/api_types.py ``_unknown_field``) with its list of every valid key counted,
    not repeated: ``unknown field `X` (not one of the server's N keys)``."""
    head, sep, listed = detail.partition(", expected one of ")
    if not sep or not head.startswith("unknown field `"):
        return detail
    return f"{head} (not one of the server's {listed.count('`') // 2} keys)"
