"""Adapter-only weight sync (issue 45): a LoRA version published into the rollout root as it is and
loaded on every server under a versioned name; and the root's adapters unloaded after a full version.

**Publish** (:func:`copy_lora_version`): the LoRA version directory is copied file by file into the
staging directory (the adapter as PEFT wrote it, the tokenizer copy, the manifest naming the base by
path and weights hash), then renamed to ``vNNNNNN`` and ``LATEST`` switched as for a full version;
the base is never copied. The bytes a server reads are the adapter's (``adapter_config.json`` and
``adapter_model.safetensors``): ``bytes_out``.

**Switch** (:func:`sync_lora_server`), on each server, SGLang's or vLLM's adapter routes
(:mod:`glmpost.kernel.lora_routes`):

1. *the base*: the server's base model (no adapter named) scored on the fingerprint sequence
   (:mod:`glmpost.kernel.fingerprint`) must be the adapter's base's fingerprint within
   ``fingerprint_tolerance``; otherwise the server is refused in one line naming the model it was
   launched with (vLLM's ``/v1/models`` root, SGLang's ``/model_info`` model path) and the adapter's
   base. The served path alone cannot tell: vLLM keeps its launch name across ``reload_weights``,
   and a base copied elsewhere has another path and the same weights.
2. *load* the version directory as ``ROOTNAME-vNNNNNN`` (:func:`~glmpost.kernel.lora_routes.adapter_name`);
   a server that loads no adapter at run time is refused in one line saying how to launch it.
3. *confirm*: the fingerprint under that name must be the version's (its base with the adapter,
   computed here in float32) and nearer to it than to the previous ``LATEST``'s; otherwise the name
   is unloaded again and the server reported failed.
4. *unload* the root's other adapters (the previous version's, and any older one left): each engine
   unloads one only after the requests in flight that name it have finished (the semantics are in
   :mod:`glmpost.kernel.lora_routes`); a rollout whose next request names an unloaded adapter moves to
   the newest one of the root that its server holds (:mod:`glmpost.rollout.lora_servers`).

A full version synced after LoRA ones (:func:`unload_root_adapters`) unloads the root's adapters
from each server it switched: they were trained on the base it replaced.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Optional

from glmpost.kernel.fingerprint import Fingerprint, checkpoint_fingerprint, confirm_server
from glmpost.kernel.lora_routes import LoraDisabled, adapter_name, root_adapters
from glmpost.kernel.lora_versions import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_lora_base
from glmpost.kernel.sglang_client import ServerError, SGLangClient
from glmpost.kernel.vllm_client import VLLMClient
from glmpost.stage import log
from glmpost.weight_sync.convert import ConvertResult, TrainSource
from glmpost.weight_sync.sync import ServerResult, retried, sync_servers

__all__ = ["adapter_bytes", "copy_lora_version", "sync_lora_server", "sync_lora_servers", "unload_root_adapters"]

_NOT_COPIED = ("stage.json",)  # written anew for the published version


def adapter_bytes(version_dir: Path) -> int:
    """The bytes of the adapter's own files: what a server reads when it loads the version."""
    return sum((Path(version_dir) / name).stat().st_size for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS))


def copy_lora_version(source: TrainSource, staging: Path) -> ConvertResult:
    """Copy the LoRA version ``source.path`` (its files, not its folders: a trainer's state stays
    behind) into ``staging``, each file fsynced by the publish that follows; the summary."""
    started = time.perf_counter()
    staging.mkdir(parents=True, exist_ok=True)
    files = []
    for path in sorted(Path(source.path).iterdir()):
        if path.is_file() and path.name not in _NOT_COPIED:
            shutil.copy2(path, staging / path.name)  # times kept: kept fingerprints and hashes stay valid
            files.append(path.name)
    size = adapter_bytes(staging)
    return ConvertResult(tensors=0, bytes_in=size, bytes_out=size, files=files, seconds=time.perf_counter() - started)


def _client(url: str, engine: str, **settings: Any) -> SGLangClient:
    return (VLLMClient if engine == "vllm" else SGLangClient)(url, retries=0, **settings)


def _release(client: SGLangClient) -> Optional[str]:
    """A vLLM server's release (stage.json records it), None for others or when it does not say."""
    try:
        return client.release() if isinstance(client, VLLMClient) else None
    except ServerError:
        return None


def _base_problem(client: SGLangClient, base: Fingerprint, tolerance: float, version_dir: Path) -> Optional[str]:
    """Why the server's base model is not the one ``version_dir`` adapts (step 1), or None."""
    ok, words = confirm_server(client, base, tolerance=tolerance)
    if ok:
        return None
    try:
        launched = client.model_info().get("model_path")
    except ServerError:
        launched = "unknown"
    return (f"serves another base model than the LoRA version {version_dir} adapts ({words} against its base "
            f"{read_lora_base(version_dir)}; the server's model: {launched}): switch it to that base first "
            "(sync-weights of the base), or train the adapter on the base it serves")


def sync_lora_server(url: str, version_dir: Path, policy_version: int, *, engine: str, expected: Fingerprint,
                     base: Fingerprint, previous: Optional[Fingerprint], tolerance: float, retries: int = 3,
                     backoff: float = 1.0, timeout: float = 600.0, skip_if_current: bool = False,
                     api_key: str | None = None, admin_api_key: str | None = None) -> ServerResult:
    """Load the LoRA version ``version_dir`` on one server and unload the root's other adapters (the
    steps in the module docstring). ``version_before``: the newest version of the root the server
    held as an adapter (None: none); ``current`` when it already held this one (``skip_if_current``)."""
    client = _client(url, engine, timeout=timeout, backoff=backoff, api_key=api_key, admin_api_key=admin_api_key)
    name, root = adapter_name(version_dir), Path(version_dir).resolve().parent.name
    result = ServerResult(url=client.url, status="failed", adapter=name, engine_release=_release(client))
    started = time.perf_counter()
    for _ in retried(result, retries, backoff):
        try:
            held = client.lora_adapters()
            ours = root_adapters(held, root)
            result.version_before = str(max(ours)) if ours else None
            if held.get(name, str(version_dir)) != str(version_dir):
                result.error = f"its adapter {name} is another folder ({held[name]}); unload it there first"
                break
            if name not in held:
                result.error = _base_problem(client, base, tolerance, version_dir)
                if result.error is not None:
                    break
                client.load_lora_adapter(name, version_dir)
            result.error = _confirm_adapter(client, name, policy_version, expected, previous, tolerance, version_dir)
            if result.error is not None:
                break
            result.unloaded = [old for _, old in sorted(ours.items()) if old != name and client.unload_lora_adapter(old)]
            result.status = "current" if name in held and skip_if_current else "updated"
            result.version_after = str(policy_version)
            break
        except LoraDisabled as exc:
            result.error = str(exc)
            break  # no retry makes the server load adapters
        except ServerError as exc:
            result.error = str(exc)
    result.seconds = time.perf_counter() - started
    return result


def _confirm_adapter(client: SGLangClient, name: str, policy_version: int, expected: Fingerprint,
                     previous: Optional[Fingerprint], tolerance: float, version_dir: Path) -> Optional[str]:
    """Step 3: None when the server's log-probs under ``name`` are the version's; otherwise the
    adapter is unloaded again and the reason returned."""
    client.adapter = (name, policy_version)
    try:
        ok, words = confirm_server(client, expected, tolerance=tolerance, previous=previous)
    finally:
        client.adapter = None
    if ok:
        return None
    client.unload_lora_adapter(name)
    return f"under the adapter {name} its prompt log-probs are not {version_dir}'s ({words}); unloaded it again"


def sync_lora_servers(urls: list[str], version_dir: Path, policy_version: int, *, previous: Optional[Path],
                      **kwargs: Any) -> list[ServerResult]:
    """:func:`sync_lora_server` on every server at once, the fingerprints computed once here (the
    version's, its base's, and ``previous``'s: the version ``LATEST`` named before)."""
    expected = checkpoint_fingerprint(version_dir)
    base = checkpoint_fingerprint(read_lora_base(version_dir))
    old = checkpoint_fingerprint(previous) if previous is not None and Path(previous) != Path(version_dir) else None

    def one(url: str, path: Path, weight_version: str, **rest: Any) -> ServerResult:
        return sync_lora_server(url, path, int(weight_version), expected=expected, base=base, previous=old, **rest)

    return sync_servers(urls, version_dir, str(policy_version), one=one, **kwargs)


def unload_root_adapters(results: list[ServerResult], root: Path, *, engine: str, **settings: Any) -> None:
    """After a full version: unload the root's adapters from every server that now serves it (their
    base was replaced), each result's ``unloaded`` saying which; a server that cannot list or unload
    adapters keeps them, with a line in the log."""
    for result in results:
        if result.status == "failed":
            continue
        client = _client(result.url, engine, **settings)
        try:
            names = sorted(root_adapters(client.lora_adapters(), Path(root).resolve().name).values())
            result.unloaded = [name for name in names if client.unload_lora_adapter(name)] or None
        except ServerError as exc:
            log(f"{result.url}: its adapters of {root} were not unloaded after the full version ({exc})")
