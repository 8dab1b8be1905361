"""Checkpoints, policy versions and tokenizer revisions (DESIGN.md §4).

A *version directory* is a Hugging Face directory (``config.json``, ``*.safetensors``, tokenizer
files) plus ``glmpost.json``, the manifest: policy version, parent, producing stage and step,
tokenizer revision. A *checkpoint root* holds ``v000000/``, ``v000001/``, ... and a ``LATEST`` file
naming the current version, replaced atomically (write a temporary file, fsync, rename), so a reader
never sees a half-published version. Everything that takes a checkpoint accepts either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmpost.errors import GlmpostError
from glmpost.fsutil import fsync_dir, make_readable, write_text_atomic

MANIFEST = "glmpost.json"
LATEST = "LATEST"
MANIFEST_FORMAT = "glmpost-checkpoint"
_VERSION_DIR = re.compile(r"^v(\d{6,})$")

# Files whose bytes define how text becomes token ids (and back) and how chats are rendered.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


class CheckpointError(GlmpostError):
    """A checkpoint path that cannot be used, with the reason."""


def check_finite_weight(where: Any, name: str, tensor: Any, *, use: str = "sampled or trained from") -> None:
    """Refuse a weight ``name`` of the checkpoint ``where`` holding NaN or infinite values (a diverged
    run wrote it, or the file was damaged): a :class:`CheckpointError` naming it, saying what this
    checkpoint cannot be (``use``). Looked at in slices, so the check holds no more than a slice's
    mask beside the weights. Every path that loads or publishes weights calls it (loading,
    sync-weights, quantize), before anything samples, trains or is published."""
    if not tensor.is_floating_point():
        return
    flat = tensor.detach().reshape(-1)
    for start in range(0, flat.numel(), 1 << 24):
        part = flat[start:start + (1 << 24)]
        if not bool(part.isfinite().all()):
            bad = int((~part.isfinite()).sum())
            raise CheckpointError(f"{where}: weight {name} holds {bad}+ NaN or infinite value(s); this checkpoint "
                                  f"cannot be {use} (a diverged run, or a damaged file)")


@dataclass
class CheckpointManifest:
    """``glmpost.json``: where a checkpoint version comes from."""

    policy_version: int
    tokenizer_revision: str
    stage: str
    step: int = 0
    parent: str | None = None
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    extra: dict[str, Any] = field(default_factory=dict)
    format: str = MANIFEST_FORMAT
    # A LoRA version's base: {"path": its version directory, "hash": its weights' content hash}
    # (glmpost.kernel.lora_versions); None, and absent from the JSON, for a full version.
    lora_base: dict[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        payload = dataclasses.asdict(self)
        if payload["lora_base"] is None:
            del payload["lora_base"]
        return payload

    @classmethod
    def from_json(cls, payload: dict[str, Any], *, where: Path) -> CheckpointManifest:
        if payload.get("format") != MANIFEST_FORMAT:
            raise CheckpointError(f"{where}: not a glmpost checkpoint manifest (format {payload.get('format')!r})")
        known = {f.name for f in dataclasses.fields(cls)}
        missing = [n for n in ("policy_version", "tokenizer_revision", "stage") if n not in payload]
        if missing:
            raise CheckpointError(f"{where}: manifest is missing {', '.join(missing)}")
        return cls(**{k: v for k, v in payload.items() if k in known})


def version_dir_name(version: int) -> str:
    return f"v{version:06d}"


def tokenizer_revision(directory: Path) -> str:
    """Digest of the tokenizer files and chat template in ``directory``: ``sha256:<16 hex>``.

    Two checkpoints with the same revision turn the same text into the same token ids and render
    chats identically; stages refuse records whose revision differs from their checkpoint's.
    """
    directory = Path(directory)
    digest = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        path = directory / name
        if path.is_file():
            found = True
            digest.update(name.encode() + b"\0")
            digest.update(path.read_bytes())
            digest.update(b"\0")
    if not found:
        raise CheckpointError(f"{directory}: no tokenizer files (tokenizer.json, tokenizer_config.json, ...)")
    return "sha256:" + digest.hexdigest()[:16]


def write_manifest(directory: Path, manifest: CheckpointManifest) -> None:
    write_text_atomic(Path(directory) / MANIFEST, json.dumps(manifest.to_json(), indent=2, sort_keys=True) + "\n")


def read_manifest(directory: Path) -> CheckpointManifest:
    path = Path(directory) / MANIFEST
    try:
        payload = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no {MANIFEST} (not a glmpost checkpoint version)") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from None
    return CheckpointManifest.from_json(payload, where=path)


def resolve_checkpoint(path: Path | str) -> Path:
    """The version directory ``path`` names: itself, or a root's ``LATEST`` version."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if (path / MANIFEST).is_file() or (path / "config.json").is_file():
        return path
    if (path / LATEST).is_file():
        return CheckpointRoot(path).latest_dir()
    if (path / "adapter_config.json").is_file():
        raise CheckpointError(f"checkpoint {path}: a PEFT adapter without {MANIFEST}; a LoRA version names its base "
                              "there (glmpost.kernel.lora_versions.write_lora_version)")
    raise CheckpointError(f"checkpoint {path}: neither a version directory (config.json, {MANIFEST}) nor a root ({LATEST})")


def model_folder_problem(path: Path | str) -> str | None:
    """Why ``path`` cannot be a checkpoint root a stage publishes versions into, or None: a model
    folder (a version directory, a Hugging Face folder) loads as itself, so versions written into it
    would never be loaded and the next run would find its work done."""
    path = Path(path)
    for name in (MANIFEST, "config.json"):
        if (path / name).is_file():
            return (f"holds {name}: it is a model folder, not a checkpoint root (it loads as itself, never as the "
                    f"versions published into it); make a root of it with `glmpost import-model {path} --out ROOT` "
                    "and train with `--checkpoint ROOT --out ROOT`, or publish into another directory")
    return None


class CheckpointRoot:
    """A directory of policy versions ``v000000/ ...`` and the ``LATEST`` pointer."""

    def __init__(self, path: Path | str):
        self.path = Path(path)

    def versions(self) -> list[int]:
        if not self.path.is_dir():
            return []
        found = []
        for child in self.path.iterdir():
            match = _VERSION_DIR.match(child.name)
            if match and child.is_dir() and (child / MANIFEST).is_file():
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        pointer = self.path / LATEST
        if not pointer.is_file():
            return None
        name = pointer.read_text().strip()
        match = _VERSION_DIR.match(name)
        if not match:
            raise CheckpointError(f"{pointer}: names {name!r}, not a version directory like v000003")
        if not (self.path / name / MANIFEST).is_file():
            raise CheckpointError(f"{pointer}: names {name}, which has no {MANIFEST}")
        return int(match.group(1))

    def latest_dir(self) -> Path:
        version = self.latest()
        if version is None:
            raise CheckpointError(f"checkpoint root {self.path} has no {LATEST}")
        return self.version_dir(version)

    def version_dir(self, version: int) -> Path:
        return self.path / version_dir_name(version)

    def next_version(self) -> int:
        versions = self.versions()
        return versions[-1] + 1 if versions else 0

    def set_latest(self, version: int) -> None:
        """Point ``LATEST`` at ``version``; readers see the old or the new pointer, never a mix."""
        if not (self.version_dir(version) / MANIFEST).is_file():
            raise CheckpointError(f"{self.version_dir(version)} is not a complete version (no {MANIFEST})")
        write_text_atomic(self.path / LATEST, version_dir_name(version) + "\n")

    def publish(self, staged: Path, version: int, *, move_latest: bool = True, replace: bool = False) -> Path:
        """Move a fully written version directory into the root, then switch ``LATEST`` to it. A
        published version is never overwritten unless ``replace`` (a stage's ``--overwrite``): the
        old one is then moved aside, the new one in, and the old one removed."""
        staged = Path(staged)
        manifest = read_manifest(staged)
        if manifest.policy_version != version:
            raise CheckpointError(f"{staged}: manifest says policy version {manifest.policy_version}, publishing {version}")
        target = self.version_dir(version)
        replaced = None
        if target.exists():
            if not replace:
                raise CheckpointError(f"{target} already exists; policy versions are never overwritten")
            replaced = self.path / f".replaced-{target.name}-{time.time_ns()}"
            os.replace(target, replaced)
        self.path.mkdir(parents=True, exist_ok=True)
        make_readable(staged)
        os.replace(staged, target)
        fsync_dir(self.path)
        if move_latest:
            self.set_latest(version)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        return target

    def repair_latest(self) -> tuple[str | None, int] | None:
        """Point ``LATEST`` at the newest complete version when it names an older one, none, or one
        this root does not hold complete (a crash between moving a version in and moving
        ``LATEST``); returns ``(what it named, the version it names now)`` when it moved. Only a
        writer holding the root's lock calls it."""
        versions = self.versions()
        if not versions:
            return None
        pointer = self.path / LATEST
        named = pointer.read_text().strip() if pointer.is_file() else None
        try:
            before = self.latest()
        except CheckpointError:
            before = None
        if before is not None and before >= versions[-1]:
            return None
        self.set_latest(versions[-1])
        return named, versions[-1]







@dataclass
class NextVersion:
    """Where a training stage publishes: ``root/v(N+1)`` for a parent at policy version ``N``.

    Work is built in ``staging`` (a hidden sibling in the root, where a resumable run keeps its
    state) and moved into place by :meth:`publish` with the parent's tokenizer files.
    """

    parent: Path
    parent_version: int
    root: CheckpointRoot
    version: int

    @classmethod
    def plan(cls, checkpoint: Path | str, out: Path | str) -> NextVersion:
        parent = resolve_checkpoint(checkpoint)
        try:
            parent_version = read_manifest(parent).policy_version
        except CheckpointError:  # a plain Hugging Face directory is policy version 0
            parent_version = 0
        return cls(parent, parent_version, CheckpointRoot(out), parent_version + 1)

    @property
    def target(self) -> Path:
        return self.root.version_dir(self.version)

    @property
    def staging(self) -> Path:
        return self.root.path / f".staging-{version_dir_name(self.version)}"

    def publish(self, manifest: CheckpointManifest, *, replace: bool = False) -> Path:
        """Copy the parent's tokenizer files into staging, write the manifest, move it in, move LATEST
        (``replace``: over a published version, :meth:`CheckpointRoot.publish`)."""
        for name in (*TOKENIZER_FILES, "generation_config.json"):
            if (self.parent / name).is_file() and not (self.staging / name).exists():
                shutil.copy2(self.parent / name, self.staging / name)
        write_manifest(self.staging, manifest)
        return self.root.publish(self.staging, self.version, replace=replace)
