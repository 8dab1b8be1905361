"""Bring your own model: a checkpoint root made from a Hugging Face folder (``import-model``).

A plain ``save_pretrained`` folder already works as ``--checkpoint`` (it is policy version 0), but a
training stage publishes into a *root* (``v000001``, ``LATEST``, ...). The import makes that root:
``ROOT/v000000`` holds the folder's files — hard links where the file system allows them (no bytes
copied; a later version never writes into a published one, so the source is never changed), else
symbolic links or copies as asked — and a ``glmpost.json`` naming the source, ``LATEST`` names it.
Then ``--checkpoint ROOT --out ROOT`` trains version after version.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmpost.checkpoints import LATEST, MANIFEST, CheckpointError, CheckpointManifest, version_dir_name, write_manifest
from glmpost.config import ConfigError, setting, shared
from glmpost.kernel.loading import load_tokenizer
from glmpost.stage import MetricsWriter, log, write_stage_json

STAGE = "import-model"
LINKS = ("hard", "symbolic", "copy")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# What a glmpost output folder holds beside the model: the import writes its own.
NOT_IMPORTED = {MANIFEST, "stage.json", "metrics.jsonl", LATEST}


@dataclass
class ImportModelConfig:
    """How the folder's files get into the root."""

    overwrite: bool = shared("overwrite")
    link: str = setting("hard", "hard (hard links: no bytes copied; copies where the file system cannot link), "
                        "symbolic (links to the source's absolute paths: the source must stay where it is, on "
                        "every node) or copy.")

    def validate(self) -> None:
        if self.link not in LINKS:
            raise ConfigError("{link} {value!r}: expected hard, symbolic or copy", value=self.link)


def check_model_folder(source: Path) -> list[Path]:
    """The files of the Hugging Face folder ``source`` to import; a folder without a parseable
    ``config.json`` naming its ``model_type``, weights or tokenizer is refused in one line."""
    if not source.is_dir():
        raise CheckpointError(f"{source}: not a directory (a Hugging Face model folder: config.json, weights, tokenizer)")
    try:
        config = json.loads((source / "config.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{source}: no config.json (not a Hugging Face model folder)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{source}/config.json: unreadable ({exc})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{source}/config.json: no model_type (not a transformers model config)")
    files = sorted(p for p in source.iterdir() if p.is_file() and p.name not in NOT_IMPORTED)
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in files):
        raise CheckpointError(f"{source}: no weights (*.safetensors, *.bin) beside config.json")
    skipped = sorted(p.name for p in source.iterdir() if p.is_dir())
    if skipped:
        log(f"{source}: sub-folders not imported: {', '.join(skipped)}")
    return files


def place(source: Path, target: Path, link: str) -> str:
    """``target`` as a hard link, symbolic link or copy of ``source``; returns how it was placed (a
    hard link across file systems, or where they are not allowed, becomes a copy)."""
    if link == "hard":
        try:
            os.link(source, target)
            return "hard"
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                raise
    elif link == "symbolic":
        os.symlink(source.resolve(), target)
        return "symbolic"
    shutil.copy2(source, target)
    return "copy"


def import_model_run(source: Path, staging: Path, config: ImportModelConfig, options: dict[str, Any]) -> dict[str, Any]:
    """Write the root of ``source`` into ``staging`` (then moved into place by the command): the
    version 0 directory, its manifest and metrics, ``LATEST`` and ``stage.json``. Returns the summary."""
    config.validate()
    source = Path(source)
    files = check_model_folder(source)
    _, revision = load_tokenizer(source)
    version = staging / version_dir_name(0)
    version.mkdir()
    placed: dict[str, int] = {}
    nbytes = 0
    for path in files:
        how = place(path, version / path.name, config.link)
        placed[how] = placed.get(how, 0) + 1
        nbytes += path.stat().st_size
    if config.link == "hard" and placed.get("copy"):
        log(f"{source}: {placed['copy']} file(s) copied: the file system does not allow hard links from there to here")
    write_manifest(version, CheckpointManifest(policy_version=0, tokenizer_revision=revision, stage=STAGE,
                                               parent=str(source.resolve()), extra={"placed": placed}))
    with MetricsWriter(version / "metrics.jsonl") as metrics:
        metrics.write(**{"import/files": len(files), "import/bytes": nbytes,
                         **{f"import/{how}": count for how, count in sorted(placed.items())}})
    (staging / LATEST).write_text(version_dir_name(0) + "\n")
    write_stage_json(staging, STAGE, options, source=str(source.resolve()))
    return {"source": str(source), "policy_version": 0, "files": len(files), "bytes": nbytes, "placed": placed,
            "tokenizer_revision": revision}
