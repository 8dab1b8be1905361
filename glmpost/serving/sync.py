"""Weight sync: a training checkpoint becomes a rollout checkpoint the servers switch to atomically.

Brief, 「稀疏与版本契约」: "权重同步包含训练分片 → 推理分片 → 量化 → 发送 → 原子切换 → 确认，不把
'传输完成'等同于'新策略已生效'". Each arrow is one step here:

1. **训练分片** (:func:`resolve_source`): a glmpost checkpoint (root → ``LATEST``, or a version
   directory), a plain Hugging Face directory, or a DeepSpeed ZeRO checkpoint written by
   ``engine.save_checkpoint`` (consolidated with ``deepspeed.utils.zero_to_fp32``; ``config.json``
   and the tokenizer come from ``base``).
2. **推理分片** (:func:`convert`): the tensors in on-disk Hugging Face names (transformers' own
   reverse weight conversion turns fused in-memory experts back into per-expert tensors), checked
   against the architecture (a missing tensor is an error naming it), written as safetensors shards
   of at most ``max_shard_bytes``.
3. **量化**: optional ``fp8-block`` / ``w4a16`` through THE quantizer
   (:func:`glmpost.quant.formats.encode_weight` = ``encode_layer(quantize_weight(w))``, the
   layer selection of :mod:`glmpost.quant.targets`), the same codes ``glmpost quantize`` writes;
   layers are quantized on one thread per core while the next tensors are read (:func:`_pipelined`).
4. **原子切换** (:func:`publish`): every file is written into a hidden staging directory of the
   rollout root, fsynced, renamed to ``vNNNNNN`` and only then is ``LATEST`` replaced atomically.
5. **发送 → 确认** (:func:`sync_server`): each server is told ``update_weights_from_disk`` with the
   published directory and ``weight_version``, and the sync counts only when the server then
   *reports* that version: a transfer that "succeeded" while the server still serves the old
   version is an error.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmpost.checkpoints import (
    LATEST,
    MANIFEST,
    TOKENIZER_FILES,
    CheckpointError,
    CheckpointRoot,
    model_skeleton,
    read_manifest,
    resolve_checkpoint,
    version_dir_name,
)
from glmpost.errors import GlmpostError, UsageError
from glmpost.fsutil import fsync_dir, fsync_path

SCHEMES = ("none", "fp8-block", "w4a16")
DTYPES = ("auto", "bfloat16", "float32")
STAGING_PREFIX = ".staging-"
LOCK_FILE = ".sync-weights.lock"
PAUSE_ENV = "GLMPOST_SYNC_PAUSE_BEFORE_PUBLISH"
_DS_STATES = "*mp_rank_*_model_states.pt"  # mp_rank_00_model_states.pt; ZeRO-3: zero_pp_rank_0_mp_rank_00_...
# Files of a base checkpoint that a rollout checkpoint needs besides its weights and config.json.
_AUX_FILES = (*TOKENIZER_FILES, "generation_config.json")


# ---------------------------------------------------------------------------------------- source


@dataclass
class TrainSource:
    """Where the weights come from.

    ``kind`` is ``"safetensors"`` (a Hugging Face/glmpost directory) or ``"deepspeed"``; ``base``
    holds ``config.json`` and the tokenizer files; ``revision`` identifies these exact weights.
    """

    path: Path
    kind: str
    base: Path
    policy_version: int
    step: int
    stage: str | None
    revision: str
    deepspeed_tag: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "kind": self.kind, "base": str(self.base), "policy_version": self.policy_version,
                "step": self.step, "stage": self.stage, "revision": self.revision, "deepspeed_tag": self.deepspeed_tag}


def is_deepspeed_checkpoint(path: Path) -> bool:
    """A directory ``engine.save_checkpoint`` wrote (``latest`` + ``TAG/*mp_rank_00_model_states.pt``), or its tag dir."""
    path = Path(path)  # not by the name 'latest' alone: a glmpost root's LATEST is the same name on macOS
    return any(path.glob(_DS_STATES)) or any(path.glob(f"*/{_DS_STATES}"))


def _deepspeed_tag(path: Path) -> tuple[Path, str]:
    """(the save directory, the tag) of a DeepSpeed checkpoint named by its save dir or tag dir."""
    if any(path.glob(_DS_STATES)):
        return path.parent, path.name
    latest = path / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if not (path / tag).is_dir():
            raise CheckpointError(f"{latest}: names tag {tag!r}, which is not a directory of {path}")
        return path, tag
    tags = sorted({p.parent.name for p in path.glob(f"*/{_DS_STATES}")})
    if len(tags) != 1:
        raise CheckpointError(f"DeepSpeed checkpoint {path}: no 'latest' file and {len(tags)} tags ({', '.join(tags)}); name the tag directory")
    return path, tags[0]


def _digest(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part + b"\0")
    return "sha256:" + h.hexdigest()[:16]


def _file_facts(files: list[Path], *, mtime: bool) -> list[bytes]:
    facts = []
    for f in sorted(files):
        st = f.stat()
        facts.append(f"{f.name}:{st.st_size}".encode() + (f":{st.st_mtime_ns}".encode() if mtime else b""))
    return facts


def resolve_source(checkpoint: Path | str, base: Path | str | None = None) -> TrainSource:
    """The training checkpoint ``checkpoint`` names (see the module docstring, step 1)."""
    checkpoint = Path(checkpoint)
    if not checkpoint.exists():
        raise UsageError(f"--checkpoint {checkpoint} does not exist")
    if checkpoint.is_dir() and is_deepspeed_checkpoint(checkpoint):
        save_dir, tag = _deepspeed_tag(checkpoint)
        if base is None:  # glmpost's DeepSpeed backend saves into vNNNNNN/trainer_state/deepspeed
            base = next((p for p in save_dir.parents if (p / "config.json").is_file()), None)
            if base is None:
                raise UsageError(f"--checkpoint {checkpoint} is a DeepSpeed checkpoint: pass --base CKPT for its config.json and tokenizer")
        base_dir = resolve_checkpoint(base)
        if not (base_dir / "config.json").is_file():
            raise UsageError(f"--base {base}: no config.json")
        manifest = read_manifest(base_dir) if (base_dir / MANIFEST).is_file() else None
        files = [f for f in (save_dir / tag).iterdir() if f.is_file()]
        revision = _digest([b"deepspeed", tag.encode(), *_file_facts(files, mtime=True)])
        return TrainSource(save_dir / tag, "deepspeed", base_dir, manifest.policy_version if manifest else 0,
                           manifest.step if manifest else 0, manifest.stage if manifest else None, revision, tag)
    if base is not None:
        raise UsageError(f"--base is only for a DeepSpeed checkpoint; {checkpoint} is not one")
    directory = resolve_checkpoint(checkpoint)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise GlmpostError(f"checkpoint {directory}: no config.json")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise GlmpostError(f"checkpoint {directory}: no *.safetensors weight files")
    if (directory / MANIFEST).is_file():
        manifest = read_manifest(directory)
        revision = _digest([(directory / MANIFEST).read_bytes(), *_file_facts(files, mtime=False)])
        return TrainSource(directory, "safetensors", directory, manifest.policy_version, manifest.step, manifest.stage, revision)
    return TrainSource(directory, "safetensors", directory, 0, 0, None, _digest(_file_facts(files, mtime=True)))


# ---------------------------------------------------------------------------------------- convert


def to_disk_names(skeleton, state: dict) -> dict:
    """In-memory parameter names (fused experts) -> on-disk Hugging Face names, by transformers' own
    reverse weight conversion (what ``save_pretrained`` applies)."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(skeleton, dict(state)))


def expected_shapes(skeleton) -> dict[str, tuple[int, ...]]:
    """On-disk name -> shape of every tensor the architecture loads (tied copies left out)."""
    state = skeleton.state_dict()
    if getattr(skeleton.config, "tie_word_embeddings", False):
        tied = getattr(skeleton, "_tied_weights_keys", None) or {}
        for name in (tied if isinstance(tied, (dict, list, tuple, set)) else []):
            state.pop(name, None)
    return {k: tuple(v.shape) for k, v in to_disk_names(skeleton, state).items()}


@dataclass
class ConvertResult:
    tensors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    files: list[str] = field(default_factory=list)
    quantized_layers: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class _ShardWriter:
    """Accumulates output tensors and writes ``model-XXXXX-of-YYYYY.safetensors`` shards (fsynced)."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory = directory
        self.max_bytes = max_bytes
        self.pending: dict[str, Any] = {}
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        path = self.directory / f".shard-{len(self.written):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        os.chmod(path, 0o666 & ~_umask())  # safetensors writes 0600; servers may run as another user
        fsync_path(path)
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> tuple[list[str], dict[str, str] | None]:
        """Final names (``model.safetensors`` when one shard) and the index's weight map."""
        self.flush()
        n = len(self.written)
        names, weight_map = [], {}
        for i, (path, keys) in enumerate(self.written):
            name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(path, self.directory / name)
            names.append(name)
            weight_map.update({k: name for k in keys})
        return names, (weight_map if n > 1 else None)


def _source_tensors(source: TrainSource, skeleton) -> tuple[dict[str, tuple[int, ...]], Iterator[tuple[str, Any]]]:
    """(on-disk name -> shape of every input tensor, an iterator over ``(name, tensor)``)."""
    if source.kind == "deepspeed":
        state = _consolidate_deepspeed(source)
        disk = to_disk_names(skeleton, state)
        return {k: tuple(v.shape) for k, v in disk.items()}, iter(disk.items())
    from safetensors import SafetensorError, safe_open

    files = sorted(source.path.glob("*.safetensors"))
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), "pt") as sf:
                for key in sf.keys():
                    shapes[key] = tuple(sf.get_slice(key).get_shape())
        except (SafetensorError, OSError) as exc:  # a truncated or foreign file
            raise GlmpostError(f"{f}: not a readable safetensors file ({exc})") from None

    def read() -> Iterator[tuple[str, Any]]:
        for f in files:
            with safe_open(str(f), "pt") as sf:
                for key in sf.keys():
                    yield key, sf.get_tensor(key)

    return shapes, read()


def _consolidate_deepspeed(source: TrainSource) -> dict:
    """fp32 weights of a ZeRO stage 1/2/3 checkpoint (``zero_to_fp32``), in-memory names."""
    import contextlib
    import sys

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        with contextlib.redirect_stdout(sys.stderr):  # zero_to_fp32 prints its progress
            state = get_fp32_state_dict_from_zero_checkpoint(str(source.path.parent), tag=source.deepspeed_tag)
    except (FileNotFoundError, ValueError, KeyError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise GlmpostError(f"DeepSpeed checkpoint {source.path}: cannot consolidate ({first})") from None
    return {k: (v.contiguous() if hasattr(v, "contiguous") else v) for k, v in state.items()}


def _pipelined(items: Iterator[tuple[str, Any]], fn: Callable[[str, Any], Any], window: int = 4) -> Iterator[tuple[str, Any, Any]]:
    """``(name, tensor, fn(name, tensor))`` in input order, ``fn`` running on a pool of one thread
    per core while the caller reads the next tensors and writes finished ones (torch ops release
    the GIL). torch's own intra-op threads are set to 1 meanwhile: on shared cores OpenMP's
    barrier-per-op parallelism stalls whenever one core is busy elsewhere, while independent
    tensors on independent threads simply queue. At most ``window`` tensors are in flight."""
    import collections
    from concurrent.futures import ThreadPoolExecutor

    import torch

    workers = max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
                         torch.get_num_threads()))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pending: collections.deque = collections.deque()
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sync-quant") as pool:
            for name, t in items:
                pending.append((name, t, pool.submit(fn, name, t)))
                while len(pending) >= max(window, workers + 1):
                    name0, t0, fut = pending.popleft()
                    yield name0, t0, fut.result()
            while pending:
                name0, t0, fut = pending.popleft()
                yield name0, t0, fut.result()
    finally:
        for _, _, fut in pending:
            fut.cancel()
        torch.set_num_threads(threads)


def convert(
    source: TrainSource,
    staging: Path,
    *,
    scheme: str = "none",
    group_size: int | None = None,
    dtype: str = "auto",
    max_shard_bytes: int = 4 << 30,
    progress: Callable[[int], None] | None = None,
) -> ConvertResult:
    """Write the rollout checkpoint's weights, ``config.json`` and tokenizer files into ``staging``.

    Every input tensor is checked against the architecture before anything is written: a missing
    tensor or a wrong shape is a :class:`GlmpostError` naming it. Tensors the architecture does not
    know (e.g. extra MTP layers) are passed through and listed in ``unexpected``.
    """
    import torch

    from glmpost.quant.core import check_shape
    from glmpost.quant.formats import encode_weight, quantization_config
    from glmpost.quant.spec import make_spec
    from glmpost.quant.targets import candidates_from_model, select_targets

    started = time.perf_counter()
    if scheme not in SCHEMES:
        raise UsageError(f"--quantize {scheme!r}: expected one of {', '.join(SCHEMES)}")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    spec = make_spec(scheme, group_size=group_size if scheme == "w4a16" else None)
    model_config = json.loads((source.base / "config.json").read_text())
    if "quantization_config" in model_config:
        method = model_config["quantization_config"].get("quant_method", "?")
        raise UsageError(f"checkpoint {source.base} is already quantized ({method}); sync its float training checkpoint")
    skeleton = model_skeleton(source.base)
    expected = expected_shapes(skeleton)
    shapes, tensors = _source_tensors(source, skeleton)
    for name in sorted(expected):  # the trainer's checkpoint must hold every weight the model loads
        if name not in shapes:
            raise GlmpostError(f"checkpoint {source.path}: missing tensor {name} (shape {list(expected[name])})")
        if tuple(shapes[name]) != expected[name]:
            raise GlmpostError(f"checkpoint {source.path}: tensor {name} has shape {list(shapes[name])}, "
                               f"the architecture expects {list(expected[name])}")
    result = ConvertResult(unexpected=sorted(set(shapes) - set(expected)))

    chosen: set[str] = set()
    ignore: list[str] = []
    if scheme != "none":
        candidates = candidates_from_model(skeleton, shapes)
        chosen = set(select_targets(candidates, targets="all"))
        for module in sorted(chosen):  # every shape error before anything is written
            check_shape(shapes[f"{module}.weight"], spec, module)
        ignore = sorted({c.module for c in candidates if c.kind in ("linear", "expert")} - chosen)
    cast = None if dtype == "auto" else getattr(torch, dtype)

    staging.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(staging, max_shard_bytes)

    def encode(name: str, t) -> dict:
        if cast is not None and t.is_floating_point() and t.dtype != cast:
            t = t.to(cast)
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module in chosen:
            return encode_weight(module, t, spec), module
        return {name: t}, None

    for _name, t, (encoded, module) in _pipelined(tensors, encode):
        result.bytes_in += t.numel() * t.element_size()
        for out_name, value in encoded.items():
            writer.add(out_name, value)
        if module is not None:
            result.quantized_layers.append(module)
        result.tensors += 1
        if progress is not None:
            progress(1)
    names, weight_map = writer.finish()
    result.files = names
    result.bytes_out = writer.total
    if weight_map is not None:
        _write_json_fsynced(staging / "model.safetensors.index.json",
                            {"metadata": {"total_size": writer.total}, "weight_map": weight_map})
    if cast is not None:
        model_config["dtype"] = dtype
        model_config.pop("torch_dtype", None)
    if scheme != "none":
        model_config["quantization_config"] = quantization_config(spec, "fp8" if scheme == "fp8-block" else "compressed-tensors", ignore)
    _write_json_fsynced(staging / "config.json", model_config)
    for name in _AUX_FILES:
        if (source.base / name).is_file():
            shutil.copy2(source.base / name, staging / name)
            fsync_path(staging / name)
    result.quantized_layers.sort()
    result.seconds = time.perf_counter() - started
    return result


def _write_json_fsynced(path: Path, payload: Any) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------- publish


@contextmanager
def root_lock(root: Path) -> Iterator[None]:
    """Exclusive lock of a rollout root for one sync (released by the kernel if the process dies)."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise GlmpostError(f"--out {root}: another sync-weights is writing into it ({LOCK_FILE} is locked)") from None
        yield
    finally:
        os.close(fd)


def staging_dir(root: Path, version: int) -> Path:
    return Path(root) / f"{STAGING_PREFIX}{version_dir_name(version)}"


def clean_stale_staging(root: Path) -> list[str]:
    """Remove staging directories a killed sync left behind (call with :func:`root_lock` held)."""
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
    """Delete all but the newest ``keep`` versions; never ``LATEST`` nor a version in ``protect``
    (e.g. one a server still reports). Returns the removed versions."""
    if keep <= 0:
        return []
    ckpt = CheckpointRoot(root)
    versions = ckpt.versions()
    latest = ckpt.latest()
    keep_set = set(versions[-keep:]) | set(protect) | ({latest} if latest is not None else set())
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

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "status": self.status, "version_before": self.version_before,
                "version_after": self.version_after, "attempts": self.attempts, "seconds": round(self.seconds, 3),
                "error": self.error}


def weight_version_name(policy_version: int) -> str:
    """The ``weight_version`` string servers are given and must report: the policy version."""
    return str(policy_version)


def sync_server(url: str, model_path: Path, weight_version: str, *, retries: int = 3, backoff: float = 1.0,
                timeout: float = 600.0, skip_if_current: bool = False) -> ServerResult:
    """Tell one server to load ``model_path`` as ``weight_version`` and confirm it reports it.

    An attempt is: ``update_weights_from_disk`` (must answer ``success``), then
    ``get_weight_version`` (must equal ``weight_version``: "传输完成" is not "新策略已生效").
    A failed attempt is retried ``retries`` times, ``backoff * 2**k`` seconds apart."""
    from glmpost.serving.sglang_client import ServerError, SGLangClient

    client = SGLangClient(url, timeout=timeout, retries=0, backoff=backoff)
    result = ServerResult(url=client.url, status="failed")
    started = time.perf_counter()
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        result.attempts = attempt + 1
        try:
            if result.version_before is None:
                result.version_before = client.get_weight_version()
                if skip_if_current and result.version_before == weight_version:
                    result.status, result.version_after, result.error = "current", weight_version, None
                    break
            answer = client.update_weights_from_disk(str(model_path), weight_version=weight_version)
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


def sync_servers(urls: list[str], model_path: Path, weight_version: str, **kwargs: Any) -> list[ServerResult]:
    """:func:`sync_server` on every server at once (threads); results in the order of ``urls``."""
    if not urls:
        return []
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(16, len(urls)), thread_name_prefix="sync") as pool:
        return list(pool.map(lambda u: sync_server(u, model_path, weight_version, **kwargs), urls))


# ---------------------------------------------------------------------------------------- load


def load_rollout_state(version_dir: Path | str, dtype: Any = None) -> dict:
    """``{on-disk name: float tensor}`` of a rollout checkpoint: quantized layers dequantized by
    :func:`glmpost.quant.formats.load_quantized_state` (the same ``dequant`` as QAT), others as stored."""
    from glmpost.quant.formats import load_quantized_state, read_tensors

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
    "SCHEMES",
    "ServerResult",
    "TrainSource",
    "clean_stale_staging",
    "convert",
    "load_rollout_state",
    "prune",
    "publish",
    "resolve_source",
    "root_lock",
    "staging_dir",
    "sync_server",
    "sync_servers",
    "weight_version_name",
]
