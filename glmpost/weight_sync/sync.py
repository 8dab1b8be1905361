"""Weight sync: a training checkpoint becomes a rollout checkpoint the servers switch to atomically.

Brief, 「稀疏与版本契约」: "权重同步包含训练分片 → 推理分片 → 量化 → 发送 → 原子切换 → 确认，不把
'传输完成'等同于'新策略已生效'". Each arrow is one step here:

1. **训练分片** (:func:`glmpost.weight_sync.convert.resolve_source`): a glmpost checkpoint (root → ``LATEST``, or a version
   directory), a plain Hugging Face directory, or a DeepSpeed ZeRO checkpoint written by
   ``engine.save_checkpoint`` (consolidated with ``deepspeed.utils.zero_to_fp32``; ``config.json``
   and the tokenizer come from ``base``).
2. **推理分片** (:func:`glmpost.weight_sync.convert.convert`): the tensors in on-disk Hugging Face names (transformers' own
   reverse weight conversion turns fused in-memory experts back into per-expert tensors), checked
   against the architecture (a missing tensor is an error naming it), written as safetensors shards
   of at most ``max_shard_bytes``.
3. **量化**: optional ``fp8-block`` / ``w4a16`` through THE quantizer
   (:func:`glmpost.quant.formats.encode_weight` = ``encode_layer(quantize_weight(w))``, the
   layer selection of :mod:`glmpost.quant.targets`), the same codes ``glmpost quantize`` writes;
   layers are quantized on one thread per core while the next tensors are read (``glmpost.weight_sync.convert._pipelined``).
4. **原子切换** (:func:`publish`): every file is written into a hidden staging directory of the
   rollout root, fsynced, renamed to ``vNNNNNN`` and only then is ``LATEST`` replaced atomically.
5. **发送 → 确认** (:func:`sync_server`): each server is told ``update_weights_from_disk`` with the
   published directory and ``weight_version`` (running requests aborted first: they answer with
   their partial output), and the sync counts only when the server then *reports* that version: a
   transfer that "succeeded" while the server still serves the old version is an error.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from glmpost.checkpoints import LATEST, CheckpointError, CheckpointRoot, resolve_checkpoint, version_dir_name
from glmpost.fsutil import fsync_dir
from glmpost.kernel.lora_versions import lora_bases
from glmpost.kernel.sglang_client import ServerError, SGLangClient
from glmpost.quant.formats import is_quantized_checkpoint, load_quantized_state, read_tensors
from glmpost.stage import log

STAGING_PREFIX = ".staging-"
PAUSE_ENV = "GLMPOST_SYNC_PAUSE_BEFORE_PUBLISH"


# ---------------------------------------------------------------------------------------- publish


def staging_dir(root: Path, version: int) -> Path:
    return Path(root) / f"{STAGING_PREFIX}{version_dir_name(version)}"


def clean_stale_staging(root: Path) -> list[str]:
    """Remove staging directories a killed sync left behind (call with the root's :func:`~glmpost.locks.output_lock` held)."""
    removed = []
    if Path(root).is_dir():
        for child in sorted(Path(root).iterdir()):
            if child.name.startswith(STAGING_PREFIX) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child.name)
    return removed


def publish(root: Path, staging: Path, version: int) -> Path:
    """Rename the complete, fsynced ``staging`` to ``root/vNNNNNN``, then switch ``LATEST`` to it.

    ``GLMPOST_SYNC_PAUSE_BEFORE_PUBLISH=SECONDS`` sleeps just before the rename (a test hook: a
    sync killed there must leave ``LATEST`` and every server on the old version)."""
    fsync_dir(staging)
    pause = os.environ.get(PAUSE_ENV)
    if pause:
        import sys

        sys.stderr.write(f"glmpost: {PAUSE_ENV}: pausing {pause}s before publishing {staging}\n")
        sys.stderr.flush()
        time.sleep(float(pause))
    return CheckpointRoot(root).publish(staging, version)


def prune(root: Path, keep: int, *, protect: set[int] = frozenset()) -> list[int]:
    """Delete all but the newest ``keep`` versions; never ``LATEST``, a version in ``protect`` (e.g.
    one a server still reports), nor the base of a LoRA version kept. Returns the removed versions."""
    if keep <= 0:
        return []
    ckpt = CheckpointRoot(root)
    versions = ckpt.versions()
    latest = ckpt.latest()
    keep_set = set(versions[-keep:]) | set(protect) | ({latest} if latest is not None else set())
    bases = lora_bases(ckpt.version_dir(v) for v in keep_set)  # an adapter is nothing without its base
    keep_set |= {v for v in versions if ckpt.version_dir(v).resolve() in bases}
    removed = []
    for version in versions:
        if version in keep_set:
            continue
        target = ckpt.version_dir(version)
        trash = Path(root) / f"{STAGING_PREFIX}prune-{version_dir_name(version)}"
        os.replace(target, trash)  # out of sight of readers first, then deleted
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(version)
    if removed:
        fsync_dir(Path(root))
    return removed


# ---------------------------------------------------------------------------------------- servers


@dataclass
class ServerResult:
    """What one server did: ``status`` is ``updated``, ``current`` (already on the version) or ``failed``."""

    url: str
    status: str
    version_before: str | None = None
    version_after: str | None = None
    attempts: int = 0
    seconds: float = 0.0
    error: str | None = None
    engine_release: str | None = None  # the server's release where it reports one (vLLM's GET /version)
    adapter: str | None = None  # a LoRA version: the name it is loaded under (glmpost.weight_sync.lora_sync)
    unloaded: list[str] | None = None  # the root's adapters unloaded from the server by this sync

    def to_json(self) -> dict[str, Any]:
        row = {"url": self.url, "status": self.status, "version_before": self.version_before,
               "version_after": self.version_after, "attempts": self.attempts, "seconds": round(self.seconds, 3),
               "error": self.error}
        extra = {"engine_release": self.engine_release, "adapter": self.adapter, "unloaded": self.unloaded}
        return {**row, **{key: value for key, value in extra.items() if value is not None}}


def weight_version_name(policy_version: int) -> str:
    """The ``weight_version`` string servers are given and must report: the policy version."""
    return str(policy_version)


def retried(result: ServerResult, retries: int, backoff: float) -> Iterator[int]:
    """A server sync's attempts, ``0 .. retries``: ``backoff * 2**k`` seconds of sleep before retry
    ``k + 1``, each counted in ``result.attempts`` (the caller breaks out when one settles it)."""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        result.attempts = attempt + 1
        yield attempt


def sync_server(url: str, model_path: Path, weight_version: str, *, retries: int = 3, backoff: float = 1.0,
                timeout: float = 600.0, skip_if_current: bool = False, api_key: str | None = None,
                admin_api_key: str | None = None, abort_in_flight: bool = True) -> ServerResult:
    """Tell one server to load ``model_path`` as ``weight_version`` and confirm it reports it.

    An attempt is: ``update_weights_from_disk`` (must answer ``success``), then
    ``get_weight_version`` (must equal ``weight_version``: "传输完成" is not "新策略已生效").
    ``abort_in_flight`` sends ``abort_all_requests``: SGLang's update otherwise waits for every
    running request (it takes the writer lock each ``/generate`` holds for reading); the aborted
    requests answer with their partial output, which ``rollout --engine sglang`` continues. A
    refused attempt is retried ``retries`` times, ``backoff * 2**k`` seconds apart; an update that
    got no answer is never sent again while the server is reachable (a second one would queue
    behind the first): the server's version is watched for ``timeout`` seconds instead.
    A quantized version onto a server launched in another format is refused before anything is
    sent (:func:`check_server_format`)."""

    client = SGLangClient(url, timeout=timeout, retries=0, backoff=backoff, api_key=api_key, admin_api_key=admin_api_key)
    result = ServerResult(url=client.url, status="failed")
    started = time.perf_counter()
    for _ in retried(result, retries, backoff):
        try:
            if result.version_before is None:
                result.version_before = client.get_weight_version()
                if skip_if_current and result.version_before == weight_version:
                    result.status, result.version_after, result.error = "current", weight_version, None
                    break
                problem = check_server_format(client, model_path)
                if problem is not None:
                    result.error = problem
                    break
            try:
                answer = client.update_weights_from_disk(str(model_path), weight_version=weight_version,
                                                         abort_all_requests=abort_in_flight)
            except ServerError as exc:
                if exc.status is not None:
                    raise
                result.version_after = _watch_version(client, weight_version, timeout, backoff)
                if result.version_after == weight_version:
                    result.status, result.error = "updated", None
                else:
                    result.error = (f"{exc}; the server still reports weight version {result.version_after!r}: the "
                                    "update may still be queued there, so it is not sent again")
                break
            if not answer.get("success"):
                result.error = f"update_weights_from_disk refused: {answer.get('message') or answer}"
                continue
            result.version_after = client.get_weight_version()
            if result.version_after != weight_version:
                result.error = (f"still reports weight version {result.version_after!r} after "
                                f"update_weights_from_disk to {weight_version!r}")
                continue
            result.status, result.error = "updated", None
            break
        except ServerError as exc:
            result.error = str(exc)
    result.seconds = time.perf_counter() - started
    return result


def _watch_version(client: SGLangClient, weight_version: str, timeout: float, backoff: float) -> str | None:
    """The server's weight version once it is ``weight_version``, or as it last reported within
    ``timeout`` seconds (raises ServerError when the server cannot be read at all: then nothing is
    running there and the update may be sent again)."""
    deadline = time.monotonic() + timeout
    version = client.get_weight_version()
    while version != weight_version and time.monotonic() < deadline:
        time.sleep(max(backoff, 0.05))
        version = client.get_weight_version()
    return version


# SGLang's launch flags that keep a checkpoint of another quant_method (ModelConfig ``_verify_quantization``
# ``compatible_quantization_methods``, python/sglang/srt/configs/model_config.py, sglang 0.5.23).
COMPATIBLE_QUANTIZATION = {"modelopt_fp8": ("modelopt",), "modelopt_fp4": ("modelopt", "fp8"),
                           "modelopt_mixed": ("modelopt",), "nvfp4_online": ("fp8", "modelopt_fp8"),
                           "petit_nvfp4": ("modelopt",),
                           "w8a8_int8": ("compressed-tensors", "compressed_tensors"),
                           "w8a8_fp8": ("compressed-tensors", "compressed_tensors"),
                           "auto-round-int8": ("compressed-tensors", "compressed_tensors")}


def served_quantization(client: Any) -> tuple[str | None, str | None]:
    """``(format, where)``: the quantization the server's model was LOADED in, and what it was read from
    (None when nothing tells: no readable checkpoint and no launch flag).

    SGLang resolves the format in ``ModelConfig._verify_quantization`` (python/sglang/srt/configs/
    model_config.py, sglang 0.5.23): the ``--quantization`` flag when given, else the ``quant_method``
    of the loaded checkpoint's ``quantization_config``. No route reports that resolved value:
    ``/server_info.quantization`` is the launch flag, which SGLang fills from the checkpoint only on
    some GPUs (arg_groups/overrides.py and model_overrides/glm4_moe.py: ``get_platform().is_sm100``),
    so an FP8 checkpoint launched elsewhere reads None there. What the server loaded is
    ``/model_info.model_path`` (http_server.py ``model_info``: moved by each weight update), so its
    ``config.json`` is read (a directory, or a hub id in the local Hugging Face cache) and resolved as
    SGLang does."""
    flag = (client.settings().get("quantization") or None)
    info = client.model_info()
    path = info.get("model_path") if isinstance(info, dict) else None
    config, directory = _served_config(path) if isinstance(path, str) and path else (None, None)
    if config is None:
        return flag, ("the launch flag (/server_info.quantization)" if flag else None)
    checkpoint = is_quantized_checkpoint(directory, config)
    return (flag or checkpoint), f"{path} (the checkpoint the server loaded)"


def _served_config(path: str) -> tuple[dict | None, Path | None]:
    """The ``config.json`` of the checkpoint a server loaded from ``path`` (a directory readable here,
    or a hub id found in the local Hugging Face cache; nothing is downloaded), or (None, None)."""
    candidate = Path(path) / "config.json"
    if not candidate.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
        except Exception:  # not a hub id (or no hub client): nothing to read here
            cached = None
        if not isinstance(cached, str):
            return None, None
        candidate = Path(cached)
    try:
        return json.loads(candidate.read_text()), candidate.parent
    except (OSError, ValueError):
        return None, None


def check_server_format(client: SGLangClient, model_path: Path) -> str | None:
    """Why ``model_path`` cannot go onto ``client``'s server, or None. SGLang's
    ``update_weights_from_disk`` streams tensors by name into the model it was launched with, with
    no config, tokenizer or quantization check (model_executor/model_runner.py): a quantized version
    needs a server that loaded that format, a float one a float server. What the server loaded is
    :func:`served_quantization` (its loaded checkpoint, not only the launch flag); when nothing tells,
    the version goes on and a line says the format was not checked. ``glmpost serve`` checks and
    dequantizes on its own."""
    info = client.model_info()
    if isinstance(info, dict) and info.get("engine") == "glmpost-serve":
        return None
    directory = resolve_checkpoint(model_path)
    ours = is_quantized_checkpoint(directory, json.loads((directory / "config.json").read_text()))
    theirs, where = served_quantization(client)
    if where is None:
        log(f"{client.url}: neither /model_info.model_path nor /server_info.quantization tells the format the server "
            f"loaded; {model_path} ({ours or 'float'}) goes on unchecked")
        return None
    if (ours or None) == (theirs or None) or (ours and ours in COMPATIBLE_QUANTIZATION.get(theirs or "", ())):
        return None
    loaded = f"{theirs}-quantized" if theirs else "float"
    wanted = f"a {ours} checkpoint" if ours else "a float checkpoint and no --quantization"
    return (f"{model_path} is {ours + '-quantized' if ours else 'not quantized'}, but the server loaded a {loaded} "
            f"model (read from {where}): SGLang loads tensors by name into the model it loaded without checking their "
            f"format; launch it with {wanted} (or sync with the --quantize it was launched for)")


def sync_servers(urls: list[str], model_path: Path, weight_version: str, *, one: Any = None,
                 **kwargs: Any) -> list[ServerResult]:
    """``one`` (default :func:`sync_server`) on every server at once (threads); results in the order of ``urls``."""
    if not urls:
        return []
    from concurrent.futures import ThreadPoolExecutor  # threads only when there are servers

    one = one or sync_server
    with ThreadPoolExecutor(max_workers=min(16, len(urls)), thread_name_prefix="sync") as pool:
        return list(pool.map(lambda u: one(u, model_path, weight_version, **kwargs), urls))


# ---------------------------------------------------------------------------------------- load


def load_rollout_state(version_dir: Path | str, dtype: Any = None) -> dict:
    """``{on-disk name: float tensor}`` of a rollout checkpoint: quantized layers dequantized by
    :func:`glmpost.quant.formats.load_quantized_state` (the same ``dequant`` as QAT), others as stored."""

    directory = resolve_checkpoint(version_dir)
    config = json.loads((directory / "config.json").read_text())
    if "quantization_config" in config:
        return load_quantized_state(directory, dtype)
    tensors = read_tensors(directory)
    if dtype is not None:
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    return tensors


def read_root_state(root: Path) -> tuple[int | None, list[int]]:
    """(``LATEST`` version or None, the complete versions) of a rollout root."""
    ckpt = CheckpointRoot(root)
    try:
        latest = ckpt.latest()
    except CheckpointError:
        latest = None
    return latest, ckpt.versions()


__all__ = [
    "LATEST",
    "ServerResult",
    "check_server_format",
    "clean_stale_staging",
    "load_rollout_state",
    "prune",
    "publish",
    "served_quantization",
    "staging_dir",
    "sync_server",
    "sync_servers",
    "weight_version_name",
]
