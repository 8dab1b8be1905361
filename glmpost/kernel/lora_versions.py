"""LoRA version directories: an adapter as PEFT writes it, naming the full version it adapts.

A *LoRA version directory* holds

* ``adapter_config.json`` and ``adapter_model.safetensors`` exactly as PEFT's ``save_pretrained``
  writes them (with its ``README.md``): ``PeftModel.from_pretrained(base, directory)`` loads it as is,
  and so do vLLM's ``/v1/load_lora_adapter`` and SGLang's ``/load_lora_adapter``;
* a byte copy of the base's tokenizer files and ``generation_config.json`` (a few MiB at most, never
  weights): the tokenizer it was trained with, read by :func:`glmpost.kernel.loading.load_tokenizer`
  like any version's, and the one a server finds in an adapter folder;
* ``glmpost.json``, the manifest of every version, whose ``lora_base`` names the base: ``path`` (the
  base *version directory*, absolute; never a root, whose ``LATEST`` moves) and ``hash``
  (:func:`base_weights_hash`). The base's weights are never copied.

A version whose base is missing, or whose base's weights hash differs from the recorded one, is
refused in one line naming both directories (:func:`read_lora_base`); so is a base that is itself a
LoRA version. In a checkpoint root a LoRA version is a version like any other (``LATEST``,
:func:`~glmpost.checkpoints.resolve_checkpoint`, resume, locks), and ``sync-weights --keep`` never
prunes a version that a kept LoRA version names as its base (:func:`lora_bases`).

**The base hash** is ``sha256:`` and the hex SHA-256 of, for ``config.json`` and then every weight file
(``*.safetensors``, ``*.bin``) in name order, the file's name, a NUL, its bytes and a NUL: the weights'
content, whatever their path or time stamps, so a base copied to another file system still matches
and one rewritten in place (another training step, a quantization) does not. The manifest has no
identity of the weights to reuse (its policy version and tokenizer revision stay the same under
``--overwrite``). Hashing reads every byte, so the result is kept beside the weights in
``glmpost-weights-hash.json`` with each file's name, size and modification time, and in memory:
a later check of unchanged files costs a ``stat`` per file; changed time stamps (a copy) hash again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

from glmpost.checkpoints import (
    MANIFEST,
    TOKENIZER_FILES,
    CheckpointError,
    CheckpointManifest,
    read_manifest,
    resolve_checkpoint,
    tokenizer_revision,
    write_manifest,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
HASH_SIDECAR = "glmpost-weights-hash.json"
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
_CHUNK = 1 << 24
_HASHES: dict[tuple[str, str], str] = {}  # (base directory, its files' identity) -> hash, for this process

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "HASH_SIDECAR", "base_weights_hash", "is_lora_version", "lora_bases",
           "model_dir", "read_lora_base", "write_lora_version"]


def is_lora_version(directory: Path | str) -> bool:
    """Whether ``directory`` holds a PEFT adapter (``adapter_config.json``): a LoRA version, whose
    :func:`read_lora_base` either names its base or says why it cannot be used."""
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def _hashed_files(directory: Path) -> list[Path]:
    weights = sorted({p for pattern in _WEIGHT_PATTERNS for p in directory.glob(pattern)}, key=lambda p: p.name)
    if not weights:
        raise CheckpointError(f"{directory}: no weights (*.safetensors, *.bin) to adapt")
    return [directory / "config.json", *weights]


def base_weights_hash(directory: Path | str) -> str:
    """The content hash of a full version's ``config.json`` and weights (module docstring)."""
    directory = Path(directory)
    files = _hashed_files(directory)
    try:
        identity = json.dumps([[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files])
    except OSError as exc:
        raise CheckpointError(f"{directory}: unreadable ({exc})") from None
    key = (str(directory.resolve()), identity)
    if key in _HASHES:
        return _HASHES[key]
    sidecar = directory / HASH_SIDECAR
    try:
        kept = json.loads(sidecar.read_text())
        found = kept["hash"] if json.dumps(kept["files"]) == identity else None
    except (OSError, ValueError, KeyError, TypeError):
        found = None
    if found is None:
        found = _hash_files(files)
        try:  # kept for the next reader; a read-only base is hashed again next time
            tmp = sidecar.with_name(f".{HASH_SIDECAR}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"hash": found, "files": json.loads(identity),
                                       "what": "sha256 over config.json and the weight files (glmpost.kernel.lora_versions)"}))
            os.replace(tmp, sidecar)
        except OSError:
            pass
    _HASHES[key] = found
    return found


def _hash_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        try:
            with open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
        except OSError as exc:
            raise CheckpointError(f"{path}: unreadable ({exc})") from None
        digest.update(b"\0")
    return "sha256:" + digest.hexdigest()


def _full_version(base: Path | str, *, what: str) -> Path:
    """The version directory ``base`` names (a root's ``LATEST`` one), refused unless it holds a full
    model (``config.json``), not an adapter."""
    directory = resolve_checkpoint(base)
    if is_lora_version(directory):
        raise CheckpointError(f"{what}: its base {directory} is itself a LoRA version; a base must be a full version")
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{what}: its base {directory} has no config.json (not a full version)")
    return directory


def write_lora_version(directory: Path | str, model: Any, *, base: Path | str, manifest: CheckpointManifest) -> CheckpointManifest:
    """Write a LoRA version into ``directory`` (a root's staging directory, or anywhere): ``model``'s
    adapter as PEFT saves it (``model``: a PEFT model of ``base``'s weights, one LoRA adapter, no
    dropout), the base's tokenizer files, and ``manifest`` with its ``lora_base`` filled in. Returns
    the manifest written (publish it with :meth:`~glmpost.checkpoints.CheckpointRoot.publish` or
    :meth:`~glmpost.checkpoints.NextVersion.publish`). ``manifest.tokenizer_revision`` must be the base's."""
    directory = Path(directory)
    base_dir = _full_version(base, what=f"LoRA version {directory}")
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or len(configs) != 1:
        raise CheckpointError(f"LoRA version {directory}: expected a PEFT model with one adapter, got {type(model).__name__}")
    (config,) = configs.values()
    if type(config).__name__ != "LoraConfig" or config.lora_dropout:
        raise CheckpointError(f"LoRA version {directory}: a {type(config).__name__} with dropout {getattr(config, 'lora_dropout', None)}; "
                              "only LoRA with dropout 0 (the rollout applies none)")
    revision = tokenizer_revision(base_dir)
    if manifest.tokenizer_revision != revision:
        raise CheckpointError(f"LoRA version {directory}: manifest tokenizer revision {manifest.tokenizer_revision} "
                              f"differs from its base {base_dir}'s {revision}")
    directory.mkdir(parents=True, exist_ok=True)
    named = config.base_model_name_or_path
    config.base_model_name_or_path = str(base_dir.resolve())  # informative: PEFT, vLLM and SGLang are given the base
    try:
        model.save_pretrained(str(directory), safe_serialization=True)
    finally:
        config.base_model_name_or_path = named
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (base_dir / name).is_file():
            shutil.copy2(base_dir / name, directory / name)
    written = dataclasses.replace(manifest, lora_base={"path": str(base_dir.resolve()), "hash": base_weights_hash(base_dir)})
    write_manifest(directory, written)
    return written


def read_lora_base(directory: Path | str) -> Path:
    """The base version directory of the LoRA version ``directory``, checked: it exists, is a full
    version, and its weights hash is the one recorded. Refused in one line naming both directories."""
    directory = Path(directory)
    try:
        recorded = read_manifest(directory).lora_base
    except CheckpointError as exc:
        raise CheckpointError(f"LoRA version {directory}: {exc}") from None
    if not isinstance(recorded, dict) or not recorded.get("path") or not recorded.get("hash"):
        raise CheckpointError(f"{directory}: holds {ADAPTER_CONFIG} but its {MANIFEST} names no lora_base (path and hash)")
    base = Path(recorded["path"])
    base = base if base.is_absolute() else directory / base
    if not (base / "config.json").is_file() and not (base / MANIFEST).is_file():
        raise CheckpointError(f"LoRA version {directory}: its base {base} is missing")
    base = _full_version(base, what=f"LoRA version {directory}")
    found = base_weights_hash(base)
    if found != recorded["hash"]:
        raise CheckpointError(f"LoRA version {directory}: its base {base} changed (weights {found[:23]}, "
                              f"the adapter was trained on {recorded['hash'][:23]})")
    return base


def model_dir(version_dir: Path | str) -> Path:
    """Where the model's ``config.json`` and weights are: the base's (checked) for a LoRA version,
    ``version_dir`` itself otherwise."""
    return read_lora_base(version_dir) if is_lora_version(version_dir) else Path(version_dir)


def lora_bases(version_dirs: Iterable[Path | str]) -> set[Path]:
    """The resolved base directories that the LoRA versions among ``version_dirs`` name (unreadable
    manifests skipped): what pruning must keep."""
    found = set()
    for directory in version_dirs:
        if not is_lora_version(directory):
            continue
        try:
            recorded = read_manifest(Path(directory)).lora_base or {}
        except CheckpointError:
            continue
        if recorded.get("path"):
            base = Path(recorded["path"])
            found.add((base if base.is_absolute() else Path(directory) / base).resolve())
    return found
