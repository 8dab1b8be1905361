"""What every stage's output shares, on the library side: ``stage.json`` (the effective options an
output was made with), crash-safe JSON files, and logs on stderr (stdout carries results)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from glmpost import __version__
from glmpost.fsutil import write_text_atomic


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON to a temporary name, fsync, rename: readers never see half a file."""
    write_text_atomic(Path(path), json.dumps(payload, indent=2, sort_keys=True) + "\n")


def write_stage_json(out_dir: Path, stage: str, options: dict[str, Any], **extra: Any) -> None:
    payload = {"stage": stage, "glmpost_version": __version__, "options": options, **extra}
    write_json_atomic(Path(out_dir) / "stage.json", payload)


def log(message: str) -> None:
    """Progress and logs go to stderr; stdout is for results."""
    sys.stderr.write(f"glmpost: {message}\n")
