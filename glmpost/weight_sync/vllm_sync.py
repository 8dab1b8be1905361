"""Weight sync to vLLM servers (``sync-weights --engine vllm``): send → atomic switch → confirm, where
vLLM has no weight version to confirm with.

Send and switch: ``POST /pause?mode=wait`` (in-flight requests finish on the old weights), ``POST
/collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": VERSION_DIR}}`` (each worker's
``reload_weights``: ``model_runner.reload_weights(weights_path, is_checkpoint_format=True)``, as read
at vLLM 9aaf83e, ``vllm/v1/worker/gpu_worker.py``; vLLM-Ascend's worker has it too), ``POST
/reset_prefix_cache``, ``POST /resume`` (:meth:`~glmpost.kernel.vllm_client.VLLMClient.reload_weights`;
the routes as read in upstream vLLM at 09cb327 / 0100a21, ``vllm/entrypoints/serve/{rpc,dev/rlhf}/
api_router.py``; a vLLM older than ``/pause`` (2025-11) is reloaded without it). These routes exist
only with ``VLLM_SERVER_DEV_MODE=1`` and are not behind ``--api-key``.

Confirm: vLLM reports no version, so the switch counts only when the server's fingerprint (its
prompt log-probs of a fixed sequence) matches the published version's, and is nearer to it than to
the previous ``LATEST``'s (:func:`glmpost.kernel.fingerprint.confirm_server`; the tolerance and why
are there). The version is glmpost's: it is what the records of ``rollout --engine vllm`` are
stamped with once the rollout confirms the same fingerprint.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from glmpost.kernel.fingerprint import Fingerprint, confirm_server
from glmpost.kernel.sglang_client import ServerError
from glmpost.kernel.vllm_client import VLLMClient
from glmpost.weight_sync.sync import ServerResult, sync_servers

__all__ = ["sync_vllm_server", "sync_vllm_servers"]


def sync_vllm_server(url: str, model_path: Path, weight_version: str, *, expected: Fingerprint,
                     previous: Optional[Fingerprint] = None, tolerance: float, retries: int = 3, backoff: float = 1.0,
                     timeout: float = 600.0, skip_if_current: bool = False, api_key: str | None = None) -> ServerResult:
    """Reload one vLLM server from ``model_path`` and confirm its fingerprint is ``expected``'s.

    ``skip_if_current``: a server whose fingerprint already matches is left as it is (``current``).
    A failed attempt is retried ``retries`` times, ``backoff * 2**k`` seconds apart. ``version_before``
    is None: vLLM reports none."""
    client = VLLMClient(url, timeout=timeout, retries=0, backoff=backoff, api_key=api_key)
    result = ServerResult(url=client.url, status="failed")
    started = time.perf_counter()
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        result.attempts = attempt + 1
        try:
            if skip_if_current and attempt == 0:
                ok, _ = confirm_server(client, expected, tolerance=tolerance, previous=previous)
                if ok:
                    result.status, result.version_after, result.error = "current", weight_version, None
                    break
            client.reload_weights(str(model_path))
            ok, words = confirm_server(client, expected, tolerance=tolerance, previous=previous)
            if not ok:
                result.error = f"after reload_weights its prompt log-probs do not match {model_path} ({words})"
                continue
            result.status, result.version_after, result.error = "updated", weight_version, None
            break
        except ServerError as exc:
            result.error = str(exc)
    result.seconds = time.perf_counter() - started
    return result


def sync_vllm_servers(urls: list[str], model_path: Path, weight_version: str, **kwargs: Any) -> list[ServerResult]:
    """:func:`sync_vllm_server` on every server at once (threads); results in the order of ``urls``."""
    return sync_servers(urls, model_path, weight_version, one=sync_vllm_server, **kwargs)
