"""The checkpoint a rollout samples from: its version directory, the policy version its records are
stamped with, and its tokenizer (what every engine of :mod:`glmpost.rollout.engines` opens on)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmpost.checkpoints import CheckpointError, read_manifest, resolve_checkpoint
from glmpost.kernel.loading import load_tokenizer
from glmpost.stage import log

__all__ = ["PolicyCheckpoint"]


@dataclass
class PolicyCheckpoint:
    """The checkpoint sampled from: its version directory, policy version and tokenizer."""

    version_dir: Path
    policy_version: int
    tokenizer: Any
    revision: str

    @classmethod
    def open(cls, checkpoint: Path) -> "PolicyCheckpoint":
        """Resolve a root or version directory; one without a manifest is stamped policy version 0."""
        version_dir = resolve_checkpoint(checkpoint)
        try:
            policy_version = read_manifest(version_dir).policy_version
        except CheckpointError:
            log(f"{version_dir} has no glmpost.json; stamping policy version 0")
            policy_version = 0
        tokenizer, revision = load_tokenizer(version_dir)
        return cls(version_dir, policy_version, tokenizer, revision)
