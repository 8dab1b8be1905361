"""Weight sync to vLLM servers (``sync-weights --engine vllm``): send → atomic switch → label → confirm.

Send and switch: ``POST /pause?mode=wait&wait_for_inflight_requests=true`` (in-flight requests
finish on the old weights; both spellings, for the releases before ``mode``), ``POST
/collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": VERSION_DIR}}`` (each worker's
``reload_weights``: ``model_runner.reload_weights(weights_path, is_checkpoint_format=True)``, as read
at vLLM 9aaf83e, ``vllm/v1/worker/gpu_worker.py``; vLLM-Ascend's worker has it too), ``POST
/reset_prefix_cache``, ``POST /update_weight_version {"new_version": VERSION}`` (still paused), ``POST
/resume`` (:meth:`~glmpost.kernel.vllm_client.VLLMClient.reload_weights`;
the routes as read in upstream vLLM at 09cb327 / 0100a21, ``vllm/entrypoints/serve/{rpc,dev/rlhf}/
api_router.py``; a vLLM older than ``/pause`` (2025-11) is reloaded without it). These routes exist
only with ``VLLM_SERVER_DEV_MODE=1`` and are not behind ``--api-key``; a server without it (``/pause``
and ``/collective_rpc`` both 404) fails in one line naming the variable, not retried.

Confirm: a server with labels (vLLM 0.27.1 on: ``/update_weight_version``, ``GET /weight_info``)
counts as switched when ``/weight_info`` reports the version just set. A server without them is
confirmed only when its fingerprint (its
prompt log-probs of a fixed sequence) matches the published version's, and is nearer to it than to
the previous ``LATEST``'s (:func:`glmpost.kernel.fingerprint.confirm_server`; the tolerance and why
are there). The version is glmpost's: it is what the records of ``rollout --engine vllm`` are
stamped with once the rollout confirms the same label or fingerprint.

Timeouts: a ``/pause`` without an answer is followed by ``/resume`` (the server is not left paused).
A ``reload_weights`` without an answer is not resumed while it may still load; once the server
answers again its label is glmpost's unconfirmed mark, it is resumed, and the next attempt first
confirms by fingerprint which weights it holds: the reload is not sent twice when it took effect.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from glmpost.kernel.fingerprint import Fingerprint, confirm_server
from glmpost.kernel.sglang_client import ServerError
from glmpost.kernel.vllm_client import DevModeError, ReloadUncertain, VLLMClient
from glmpost.weight_sync.sync import ServerResult, retried, sync_servers

__all__ = ["sync_vllm_server", "sync_vllm_servers"]


def sync_vllm_server(url: str, model_path: Path, weight_version: str, *, expected: Fingerprint,
                     previous: Optional[Fingerprint] = None, tolerance: float, retries: int = 3, backoff: float = 1.0,
                     timeout: float = 600.0, skip_if_current: bool = False, api_key: str | None = None) -> ServerResult:
    """Reload one vLLM server from ``model_path`` as ``weight_version`` and confirm it: by the label it
    reports where it has labels, else by its fingerprint being ``expected``'s.

    ``skip_if_current``: a server already on the version (its label, else its fingerprint) is left as
    it is (``current``). A failed attempt is retried ``retries`` times, ``backoff * 2**k`` seconds
    apart; after a reload that got no answer in time the next attempt confirms before reloading.
    ``version_before``: the server's label (None where it has none)."""
    client = VLLMClient(url, timeout=timeout, retries=0, backoff=backoff, api_key=api_key)
    result = ServerResult(url=client.url, status="failed")
    started = time.perf_counter()
    try:
        result.engine_release = client.release()
        result.version_before = client.weight_label()
    except ServerError:
        pass
    uncertain = False  # the last attempt's reload may have taken effect
    for attempt in retried(result, retries, backoff):
        try:
            if (skip_if_current and attempt == 0) or uncertain:
                if _serves(client, weight_version, expected, tolerance=tolerance, previous=previous, label=not uncertain):
                    if uncertain:
                        client.take_label(weight_version)  # its weights are the version's: the label follows
                    result.status = "updated" if uncertain else "current"
                    result.version_after, result.error = weight_version, None
                    break
                uncertain = False
            if client.reload_weights(str(model_path), weight_version):
                result.status, result.version_after, result.error = "updated", weight_version, None
                break
            ok, words = confirm_server(client, expected, tolerance=tolerance, previous=previous)
            if not ok:
                result.error = f"after reload_weights its prompt log-probs do not match {model_path} ({words})"
                continue
            result.status, result.version_after, result.error = "updated", weight_version, None
            break
        except DevModeError as exc:
            result.error = str(exc)
            break  # no retry makes the routes appear
        except ReloadUncertain as exc:
            result.error, uncertain = str(exc), True
        except ServerError as exc:
            result.error = str(exc)
    result.seconds = time.perf_counter() - started
    return result


def _serves(client: VLLMClient, weight_version: str, expected: Fingerprint, *, tolerance: float,
            previous: Optional[Fingerprint], label: bool) -> bool:
    """Whether the server serves the version: its label says so (``label``, where it has one set),
    else its fingerprint matches."""
    if label and client.read_label():
        return client.weight_version == weight_version
    return confirm_server(client, expected, tolerance=tolerance, previous=previous)[0]


def sync_vllm_servers(urls: list[str], model_path: Path, weight_version: str, **kwargs: Any) -> list[ServerResult]:
    """:func:`sync_vllm_server` on every server at once (threads); results in the order of ``urls``."""
    return sync_servers(urls, model_path, weight_version, one=sync_vllm_server, **kwargs)
