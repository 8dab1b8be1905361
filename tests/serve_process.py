"""A real ``glmpost serve`` subprocess on 127.0.0.1 for the tests (``--port 0``: it prints the
address it bound once it is ready)."""

from __future__ import annotations

import signal
import subprocess
import sys


def start_server(checkpoint, *extra) -> tuple[subprocess.Popen, str]:
    """Start ``glmpost serve --checkpoint CHECKPOINT --port 0 --device cpu EXTRA...``; returns
    ``(process, url)`` once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "glmpost.commands.app", "serve", "--checkpoint", str(checkpoint), "--port", "0",
         "--device", "cpu", *map(str, extra)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()  # blocks until the server is ready (or exits)
    if "listening on" not in line:
        proc.kill()
        raise AssertionError(f"serve did not start: {line!r} {proc.stderr.read()}")
    return proc, line.strip().rsplit(" ", 1)[-1]


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (a clean shutdown), SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
