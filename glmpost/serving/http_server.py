"""The HTTP side of ``glmpost serve``: SGLang's native routes over an :class:`~glmpost.serving.server.EngineServer`.

:class:`_Handler` maps each route (see :mod:`glmpost.serving.server` for the endpoints and their
shapes) to an engine call and answers JSON; a refused request is ``{"error": {"message", "code"}}``
with its 4xx status, an unexpected failure a 500, and no request takes the server down.
:func:`make_http_server` builds the threading server, :func:`serve_until_signalled` runs it until
SIGTERM or SIGINT, and :func:`bound_address` says where it listens.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from glmpost.serving.parsing import RequestError
from glmpost.serving.server import EngineServer


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
    "bound_address",
    "make_http_server",
    "serve_until_signalled",
]
