"""The HTTP side of ``glmpost serve``: SGLang's native routes over an :class:`~glmpost.server.engine.EngineServer`.

:class:`_Handler` maps each route (see :mod:`glmpost.server.engine` for the endpoints and their
shapes) to an engine call and answers JSON; a refused request is ``{"error": {"message", "code"}}``
with its 4xx status, an unexpected failure a 500, and no request takes the server down. Keys as
SGLang's ``utils/auth.py`` ``decide_request_auth`` (read at sgl-project/sglang 0ce3659, 2026): with an
``api_key`` every route but ``/health*``, ``/ready*`` and ``/metrics*`` wants ``Authorization: Bearer
KEY`` (or ``x-api-key: KEY``, which that release accepts too; ``hmac.compare_digest``); the control
routes (:data:`~glmpost.kernel.sglang_client.ADMIN_ROUTES`) want the ``admin_api_key`` when one is
set, and only it; without the right key: 401 ``{"error": "Unauthorized"}``. Keys are never logged
nor echoed.
:func:`make_http_server` builds the threading server, :func:`serve_until_signalled` runs it until
SIGTERM or SIGINT, and :func:`bound_address` says where it listens. :func:`serve_checkpoint` is one
``glmpost serve`` run (:class:`ServeConfig`, with its checks in :mod:`glmpost.server.serve_config`,
re-exported here): the engine, the listening server and the metrics lines.
"""

from __future__ import annotations

import hmac
import json
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional

from glmpost.config import ConfigError
from glmpost.kernel.sglang_client import ADMIN_ROUTES
from glmpost.npu import resolve_device
from glmpost.server.engine import EngineServer
from glmpost.server.parsing import RequestError
from glmpost.server.serve_config import SGLANG_LOG_PROB_KIND, ServeConfig, checked_settings
from glmpost.server.vllm_api import PlainText, VLLMApi, check_logprobs_mode, error_payload, guarded
from glmpost.stage import MetricsWriter, log

LISTEN_BACKLOG = 512
RETRY_AFTER_S = 1  # what a 503 asks a client to wait


class _Handler(BaseHTTPRequestHandler):
    server_version = "glmpost-serve"
    engine: EngineServer  # set on the subclass made by make_http_server
    quiet = True
    api_key: Optional[str] = None  # set on the subclass: every route but /health then wants it
    admin_api_key: Optional[str] = None  # set on the subclass: the control routes then want it, and only it
    max_body_bytes = 64 << 20  # set on the subclass
    vllm: Any = None  # set on the subclass with --api vllm: the vLLM routes (glmpost.server.vllm_api.VLLMApi)

    def log_message(self, format: str, *args: Any) -> None:
        if not self.quiet:
            super().log_message(format, *args)

    def _send(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        text = isinstance(payload, PlainText)  # vLLM answers its LoRA routes with a bare text
        body = b"" if payload is None else payload.encode() if text else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8" if text else "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _bare_500(self) -> None:
        """What SGLang's framework answers for an exception its route does not map."""
        body = b"Internal Server Error"
        self.send_response(500)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str, param: str | None = None) -> None:
        # A full queue or a stopping server: the client may come back (SGLang answers 503 the same way).
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
        payload = ({"error": {"message": message, "code": int(status)}} if self.vllm is None
                   else error_payload(status, message, param))
        self._send(status, payload, headers)

    def _body(self) -> Any:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise RequestError("Content-Length is not a number") from None
        if length < 0:  # refused before anything is read (a read of -N reads to the end of the stream)
            self.close_connection = True
            raise RequestError(f"Content-Length {length} is negative", 400)
        if length > self.max_body_bytes:  # refused before it is read
            self.close_connection = True
            raise RequestError(f"the request body has {length} bytes, more than the {self.max_body_bytes} this server "
                               "reads (--max-body-bytes)", 413)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw) if raw else {}
        except json.JSONDecodeError as exc:
            raise RequestError(f"the request body is not JSON ({exc})") from None

    def _authorized(self, path: str) -> bool:
        """SGLang's rule: probes (``/health*``, ``/ready*``, ``/metrics*``) always; a control route
        the admin key when one is set, else the API key; any other route the API key (none set:
        open). A key is ``Authorization: Bearer KEY`` or ``x-api-key: KEY``, compared in constant time.
        With ``--api vllm``, vLLM's: the API key on ``/v1``, ``/v2`` and ``/inference`` only, Bearer only."""
        if path.startswith(("/health", "/ready", "/metrics")) or (self.vllm is not None and not guarded(path)):
            return True
        expected = self.admin_api_key if self.admin_api_key is not None and path in ADMIN_ROUTES else self.api_key
        if expected is None:
            return True
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        offered = [token] if scheme.lower() == "bearer" else []
        offered += [self.headers.get("x-api-key") or ""] if self.vllm is None else []
        # Header values are latin-1 text; the key is printable ASCII (check_api_key).
        return any(hmac.compare_digest(o.strip().encode("latin-1", "replace"), expected.encode()) for o in offered if o)

    def _dispatch(self, method: str) -> None:
        path, _, query = self.path.partition("?")
        path = path.rstrip("/") or "/"
        try:
            if not self._authorized(path):
                self._send(401, {"error": "Unauthorized"})
            elif method == "GET" and path == "/health":
                self._send(200, None)
            elif self.vllm is not None:
                answer = self.vllm.route(method, path, dict(urllib.parse.parse_qsl(query)), self._body)
                if answer is None:
                    self._send(404, {"detail": "Not Found"})  # FastAPI's answer to a route vLLM does not have
                else:
                    self._send(*answer)
            elif method == "GET" and path in ("/get_weight_version", "/weight_version"):
                self._send(200, {"weight_version": self.engine.weight_version})
            elif method == "GET" and path in ("/model_info", "/get_model_info"):
                self._send(200, self.engine.model_info())
            elif method == "GET" and path in ("/server_info", "/get_server_info"):
                self._send(200, self.engine.server_info())
            elif method == "POST" and path == "/generate":
                self._send(200, self.engine.generate(self._body()))
            elif method == "POST" and path == "/update_weights_from_disk":
                status, answer = self.engine.update_weights_from_disk(self._body())
                self._send(status, answer)
            elif method == "POST" and path == "/abort_request":
                self.engine.abort_request(self._body())
                self._send(200, None)
            elif method == "POST" and path in ("/load_lora_adapter", "/unload_lora_adapter"):  # glmpost.server.adapters
                route = self.engine.load_lora_adapter if path == "/load_lora_adapter" else self.engine.unload_lora_adapter
                self._send(*route(self._body()))
            elif method == "GET" and path == "/v1/models":
                self._send(200, self.engine.model_list())
            elif path in ("/health", "/get_weight_version", "/model_info", "/server_info", "/get_server_info", "/generate",
                          "/update_weights_from_disk", "/abort_request", "/load_lora_adapter", "/unload_lora_adapter",
                          "/v1/models"):
                self._error(405, f"{method} is not allowed on {path}")
            else:
                self._error(404, f"no route {path}")
        except RequestError as exc:
            if exc.bare:
                log(f"{method} {path}: {exc} (answered HTTP 500, as SGLang does)")
                self._bare_500()
            elif exc.contract and self.vllm is None:  # SGLang's /generate contract check: {"error": TEXT}
                self._send(exc.status, {"error": str(exc)})
            else:
                self._error(exc.status, str(exc), getattr(exc, "param", None))
        except (BrokenPipeError, ConnectionResetError):
            log(f"{self.client_address[0]}:{self.client_address[1]} disconnected before its answer to {method} {path}")
        except Exception as exc:  # never let one request take the server down
            try:
                self._error(500, f"{type(exc).__name__}: {exc}")
            except OSError:
                pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")


class _Server(ThreadingHTTPServer):
    # Connections the kernel holds before they are accepted (socketserver's default is 5: a burst of
    # clients was reset); each accepted one gets a thread, and the engine's queue bounds the work.
    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that left before its request was read (reset, closed): one line, no traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log(f"{client_address[0]}:{client_address[1]} left before its request was read ({type(exc).__name__})")
            return
        super().handle_error(request, client_address)


def make_http_server(engine: EngineServer, host: str, port: int, *, quiet: bool = True, api_key: Optional[str] = None,
                     admin_api_key: Optional[str] = None, max_body_bytes: int = 64 << 20,
                     vllm: Optional[VLLMApi] = None) -> ThreadingHTTPServer:
    """A threading HTTP server whose handlers call ``engine`` (``port`` 0 picks a free port); with
    ``api_key`` every route but the probes wants it, with ``admin_api_key`` the control routes want
    that one (with ``vllm``, vLLM's routes instead of SGLang's, the key only on ``/v1``, ``/v2``,
    ``/inference``); a body over ``max_body_bytes`` is refused (413)."""
    handler = type("GlmpostServeHandler", (_Handler,), {"engine": engine, "quiet": quiet, "api_key": api_key or None,
                                                         "admin_api_key": admin_api_key or None,
                                                         "max_body_bytes": max_body_bytes, "vllm": vllm})
    return _Server((host, port), handler)


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
        engine.stop()  # queued work answered 503 at once, the batch running finishes; the loop still accepts
        server.shutdown()
        _answer_backlog(server)
        server.server_close()  # waits for every handler
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if on_tick is not None:
            on_tick(True)


def _answer_backlog(server: ThreadingHTTPServer, *, quiet_s: float = 0.2, limit_s: float = 5.0) -> None:
    """Connections the kernel took into the listen backlog after the serve loop stopped, handled
    (a stopped engine answers 503 with Retry-After) instead of reset by closing the socket: until none
    came for ``quiet_s`` seconds, for ``limit_s`` at most (a client that comes later is refused)."""
    server.socket.settimeout(quiet_s)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            request, address = server.socket.accept()
        except OSError:  # none came (a timeout), or the socket is gone
            return
        request.settimeout(None)
        server.process_request(request, address)


def bound_address(server: ThreadingHTTPServer) -> tuple[str, int]:
    host, port = server.server_address[:2]
    return (host if isinstance(host, str) else host.decode()), int(port)


class _MetricsLines:
    """The ``serve/*`` counters appended to ``metrics`` on every tick from :meth:`start` on: the
    engine's stats, uptime, weight version and generated tokens per second over the interval."""

    def __init__(self, path: Path):
        try:
            self.writer = MetricsWriter(path)
        except OSError as exc:
            raise ConfigError("{metrics} {path}: cannot open for appending ({reason})", path=path,
                              reason=exc.strerror or exc) from None
        self.path = path

    def start(self, engine: EngineServer) -> None:
        self.engine = engine
        self.started = self.last_time = time.monotonic()
        self.last_tokens = 0

    def write(self, final: bool) -> None:
        now, stats = time.monotonic(), dict(self.engine.stats)
        interval = max(now - self.last_time, 1e-9)
        try:
            self.writer.write(
                **{f"serve/{k}": (round(v, 6) if isinstance(v, float) else v) for k, v in stats.items()},
                **{"serve/uptime_s": round(now - self.started, 3), "serve/weight_version": self.engine.weight_version,
                   "serve/tokens_per_s": round((stats["generated_tokens"] - self.last_tokens) / interval, 3),
                   "serve/final": final},
            )
        except OSError as exc:  # a full disk must not take the server down
            log(f"--metrics {self.path}: cannot write ({exc.strerror or exc}); serving on")
        self.last_time, self.last_tokens = now, stats["generated_tokens"]

    def close(self) -> None:
        self.writer.close()


def serve_checkpoint(config: ServeConfig, *, on_listening: Callable[[str], None]) -> dict[str, Any]:
    """Serve ``config.checkpoint`` until SIGTERM or SIGINT (:func:`serve_until_signalled`), calling
    ``on_listening(url)`` once the server is ready; returns the engine's counters at stop."""
    api_key = checked_settings(config)
    metrics = _MetricsLines(config.metrics) if config.metrics is not None else None
    try:
        device = resolve_device(config.device)
        kind = check_logprobs_mode(config.logprobs_mode) if config.api == "vllm" else config.log_prob_kind
        engine = EngineServer(config.checkpoint, device=device, batch_size=config.batch_size,
                              deterministic_topk=config.deterministic_topk, attention=config.attention,
                              weight_version=config.weight_version,
                              batch_wait_s=config.batch_wait_ms / 1000.0, log_prob_kind=kind,
                              prefix_cache_batches=config.prefix_cache_batches, max_queued=config.max_queued,
                              enable_lora=config.enable_lora)
        try:
            if config.enable_return_routed_experts and engine._routing_layout() is None:
                raise ConfigError("{enable_return_routed_experts}: {path} is a dense model (no MoE router)", path=config.checkpoint)
            vllm = (VLLMApi(engine, logprobs_mode=config.logprobs_mode, max_logprobs=config.max_logprobs,
                            dev_mode=config.vllm_dev_mode, release=config.vllm_release,
                            return_routed_experts=config.enable_return_routed_experts, max_model_len=config.max_model_len)
                    if config.api == "vllm" else None)
            server = make_http_server(engine, config.host, config.port, quiet=not config.log_requests, api_key=api_key,
                                      admin_api_key=config.admin_api_key, max_body_bytes=config.max_body_bytes, vllm=vllm)
        except OSError as exc:
            raise ConfigError("{host} {address} {port} {number}: cannot listen ({reason})", address=config.host,
                              number=config.port, reason=exc.strerror or exc) from None
        host, port = bound_address(server)
        shown = f"[{host}]" if ":" in host else host

        def ready() -> None:
            log(f"serving {engine.loaded.version_dir} (weight_version {engine.weight_version}, tokenizer "
                f"{engine.loaded.revision}) on {device}, batch size {config.batch_size}, log-probs {engine.log_prob_kind}"
                + (f", vLLM API (--logprobs-mode {config.logprobs_mode})" if vllm is not None else "")
                + (", API key required" if api_key else ""))
            on_listening(f"http://{shown}:{port}")

        if metrics is not None:
            metrics.start(engine)
        serve_until_signalled(engine, server, on_ready=ready, on_tick=metrics.write if metrics else None,
                              tick_s=config.metrics_interval)
    finally:
        if metrics is not None:
            metrics.close()
    stats = engine.stats
    log(f"stopped after {stats['batches']} engine batches, {stats['sequences']} sequences, "
        f"{stats['generated_tokens']} generated tokens")
    return dict(stats)


__all__ = [
    "SGLANG_LOG_PROB_KIND",
    "ServeConfig",
    "bound_address",
    "make_http_server",
    "serve_checkpoint",
    "serve_until_signalled",
]
