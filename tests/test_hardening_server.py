"""Hardening, the server under load (issue 30): ``glmpost serve`` accepts hundreds of concurrent
connections (its listen backlog held 5 before: a burst of 50 clients was reset), answers a full
queue with 503 and Retry-After, refuses an oversized body (413) before reading it, and logs a client
that went away in one line."""

from __future__ import annotations

import http.client
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest
from serve_process import start_server, stop_server

from glmpost.server.engine import EngineServer
from glmpost.server.parsing import RequestError

CLIENTS = 300
REQUEST = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    proc, url = start_server(tiny_checkpoint)
    yield proc, urlsplit(url)
    stop_server(proc)


def _get_health(address) -> int:
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=300)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status
    finally:
        connection.close()


def test_hundreds_of_concurrent_clients_are_all_answered(served):
    _, address = served
    barrier = threading.Barrier(CLIENTS)

    def client(_) -> int:
        barrier.wait()  # every client connects at once
        return _get_health(address)

    with ThreadPoolExecutor(CLIENTS) as pool:
        statuses = list(pool.map(client, range(CLIENTS)))  # a reset connection would raise here
    assert statuses == [200] * CLIENTS


def test_a_body_over_the_limit_is_refused_before_it_is_read_and_a_vanished_client_is_one_line(tiny_checkpoint):
    proc, url = start_server(tiny_checkpoint, "--max-body-bytes", "1000")
    address = urlsplit(url)
    try:
        with socket.create_connection((address.hostname, address.port)) as sock:
            # Claims a body of 10 GB and sends none of it: the answer comes at once.
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 10000000000\r\n\r\n")
            answer = sock.makefile("rb").read()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 413") or head.startswith(b"HTTP/1.1 413")
        assert "10000000000 bytes, more than the 1000" in json.loads(body)["error"]["message"]
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
        connection.request("POST", "/generate", body=json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}))
        assert connection.getresponse().status == 200  # a body under the limit is served
        connection.close()
    finally:
        stop_server(proc)
    stderr = proc.stderr.read()
    assert "Traceback" not in stderr


def test_a_full_queue_answers_503_at_once(tiny_checkpoint):
    engine = EngineServer(tiny_checkpoint, max_queued=2)  # its worker is not started: nothing leaves the queue
    waiting = [threading.Thread(target=lambda: _submit_quietly(engine), daemon=True) for _ in range(2)]
    for thread in waiting:
        thread.start()
    while engine.queued < 2:
        threading.Event().wait(0.01)
    with pytest.raises(RequestError) as refused:
        engine.generate(REQUEST)
    assert refused.value.status == 503 and "2 requests are waiting for the engine" in str(refused.value)
    engine.stop()  # the waiting ones are answered 503 too
    for thread in waiting:
        thread.join(timeout=60)
        assert not thread.is_alive()


def _submit_quietly(engine: EngineServer) -> None:
    try:
        engine.generate(REQUEST)
    except RequestError:
        pass
