"""How a benchmark hands over its figures: the report as JSON on stdout and, with ``--out``, in a file."""

from __future__ import annotations

import json
from pathlib import Path


def emit(report: dict, out: Path | None) -> None:
    """Print ``report`` as indented JSON; also write it to ``out`` (its folder created) when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
