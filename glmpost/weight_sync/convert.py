"""The first three steps of a weight sync: the training checkpoint, converted to the rollout
checkpoint's tensors, optionally quantized (see :mod:`glmpost.weight_sync.sync` for the whole sequence).

* :func:`resolve_source`: a glmpost checkpoint (root -> ``LATEST``, or a version directory), a plain
  Hugging Face directory, or a DeepSpeed ZeRO checkpoint written by ``engine.save_checkpoint``
  (consolidated with ``deepspeed.utils.zero_to_fp32``; ``config.json`` and the tokenizer come from
  ``base``).
* :func:`convert`: the tensors in on-disk Hugging Face names (transformers' own reverse weight
  conversion turns fused in-memory experts back into per-expert tensors), checked against the
  architecture (a missing tensor is an error naming it), optionally quantized through THE quantizer
  on one thread per core while the next tensors are read (:func:`_pipelined`), written by the one
  checkpoint writer (:mod:`glmpost.quant.writer`) as safetensors shards of at most
  ``max_shard_bytes``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmpost.checkpoints import (
    MANIFEST,
    TOKENIZER_FILES,
    CheckpointError,
    check_finite_weight,
    read_manifest,
    resolve_checkpoint,
)
from glmpost.config import ConfigError
from glmpost.errors import GlmpostError, UsageError
from glmpost.fsutil import fsync_path
from glmpost.kernel.lora_versions import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_lora_version, read_lora_base
from glmpost.models.skeleton import model_skeleton
from glmpost.quant.formats import default_format
from glmpost.quant.spec import make_spec
from glmpost.quant.writer import SafetensorsWriter, encode_tensor, layer_plan, write_config

SCHEMES = ("none", "fp8-block", "w4a16")
DTYPES = ("auto", "bfloat16", "float32")
_DS_STATES = "*mp_rank_*_model_states.pt"  # mp_rank_00_model_states.pt; ZeRO-3: zero_pp_rank_0_mp_rank_00_...
# Files of a base checkpoint that a rollout checkpoint needs besides its weights and config.json.
_AUX_FILES = (*TOKENIZER_FILES, "generation_config.json")


# ---------------------------------------------------------------------------------------- source


@dataclass
class TrainSource:
    """Where the weights come from.

    ``kind`` is ``"safetensors"`` (a Hugging Face/glmpost directory), ``"deepspeed"`` or ``"lora"`` (a
    LoRA version, synced as its adapter); ``base`` holds ``config.json`` and the tokenizer files (a LoRA
    version: itself, whose manifest names its base); ``revision`` identifies these exact weights.
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
    """The training checkpoint ``checkpoint`` names (see the module docstring, step 1); a refusal names
    the sync's config fields ``checkpoint`` and ``base``."""
    checkpoint = Path(checkpoint)
    if not checkpoint.exists():
        raise ConfigError("{checkpoint} {path} does not exist", path=checkpoint)
    if checkpoint.is_dir() and is_deepspeed_checkpoint(checkpoint):
        save_dir, tag = _deepspeed_tag(checkpoint)
        if base is None:  # glmpost's DeepSpeed backend saves into vNNNNNN/trainer_state/deepspeed
            base = next((p for p in save_dir.parents if (p / "config.json").is_file()), None)
            if base is None:
                raise ConfigError("{checkpoint} {path} is a DeepSpeed checkpoint: pass {base} CKPT for its config.json and tokenizer",
                                  path=checkpoint)
        base_dir = resolve_checkpoint(base)
        if not (base_dir / "config.json").is_file():
            raise ConfigError("{base} {path}: no config.json", path=base)
        manifest = read_manifest(base_dir) if (base_dir / MANIFEST).is_file() else None
        files = [f for f in (save_dir / tag).iterdir() if f.is_file()]
        revision = _digest([b"deepspeed", tag.encode(), *_file_facts(files, mtime=True)])
        return TrainSource(save_dir / tag, "deepspeed", base_dir, manifest.policy_version if manifest else 0,
                           manifest.step if manifest else 0, manifest.stage if manifest else None, revision, tag)
    if base is not None:
        raise ConfigError("{base} is only for a DeepSpeed checkpoint; {path} is not one", path=checkpoint)
    directory = resolve_checkpoint(checkpoint)
    if is_lora_version(directory):  # synced as its adapter (glmpost.weight_sync.lora_sync); its base checked here
        read_lora_base(directory)
        manifest = read_manifest(directory)
        files = [directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS]
        revision = _digest([(directory / MANIFEST).read_bytes(), *_file_facts(files, mtime=False)])
        return TrainSource(directory, "lora", directory, manifest.policy_version, manifest.step, manifest.stage, revision)
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


def _float_config(source: TrainSource, *, scheme: str, dtype: str) -> dict:
    """The source's ``config.json``, after checking the sync's ``quantize`` and ``dtype`` and that
    the source holds float (not already quantized) weights."""
    if scheme not in SCHEMES:
        raise ConfigError("{quantize} {value!r}: expected one of {known}", value=scheme, known=", ".join(SCHEMES))
    if dtype not in DTYPES:
        raise ConfigError("{dtype} {value!r}: expected one of {known}", value=dtype, known=", ".join(DTYPES))
    model_config = json.loads((source.base / "config.json").read_text())
    if "quantization_config" in model_config:
        method = model_config["quantization_config"].get("quant_method", "?")
        raise UsageError(f"checkpoint {source.base} is already quantized ({method}); sync its float training checkpoint")
    return model_config


def _check_shapes(source: TrainSource, shapes: dict, expected: dict) -> None:
    """The trainer's checkpoint must hold every weight the model loads, in its shape."""
    for name in sorted(expected):
        if name not in shapes:
            raise GlmpostError(f"checkpoint {source.path}: missing tensor {name} (shape {list(expected[name])})")
        if tuple(shapes[name]) != expected[name]:
            raise GlmpostError(f"checkpoint {source.path}: tensor {name} has shape {list(shapes[name])}, "
                               f"the architecture expects {list(expected[name])}")


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
    know (e.g. extra MTP layers) are passed through and listed in ``unexpected``. An unknown
    ``scheme`` or ``dtype`` is refused naming the sync's config fields ``quantize`` and ``dtype``.
    """
    import torch

    started = time.perf_counter()
    model_config = _float_config(source, scheme=scheme, dtype=dtype)
    spec = make_spec(scheme, group_size=group_size if scheme == "w4a16" else None)
    skeleton = model_skeleton(source.base)
    expected = expected_shapes(skeleton)
    shapes, tensors = _source_tensors(source, skeleton)
    _check_shapes(source, shapes, expected)
    result = ConvertResult(unexpected=sorted(set(shapes) - set(expected)))
    plan = layer_plan(skeleton, shapes, spec, targets="all")
    chosen = set(plan.chosen)
    cast = None if dtype == "auto" else getattr(torch, dtype)

    staging.mkdir(parents=True, exist_ok=True)
    writer = SafetensorsWriter(staging, max_bytes=max_shard_bytes)

    def encode(name: str, t) -> tuple:
        check_finite_weight(source.path, name, t, use="published")  # before anything is published
        if cast is not None and t.is_floating_point() and t.dtype != cast:
            t = t.to(cast)
        encoded, module, _ = encode_tensor(name, t, spec=spec, fmt=None, chosen=chosen)
        return encoded, module

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
    if cast is not None:
        model_config["dtype"] = dtype
        model_config.pop("torch_dtype", None)
    write_config(staging, model_config, spec=spec, fmt=default_format(scheme), plan=plan, weight_map=weight_map,
                 total_bytes=writer.total, index=len(names) > 1)
    for name in _AUX_FILES:
        if (source.base / name).is_file():
            shutil.copy2(source.base / name, staging / name)
            fsync_path(staging / name)
    result.quantized_layers.sort()
    result.seconds = time.perf_counter() - started
    return result
