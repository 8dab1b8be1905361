"""The settings of a stage that consumes a spool (``--follow IN`` and its companions), declared once
for every consumer: ``judge`` and ``score-teacher`` (:func:`glmpost.drivers.follow_shards`) and the
trainers (:func:`glmpost.rl.follow.follow_spool`, whose ``FollowConfig`` holds them as a section)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from glmpost.config import setting
from glmpost.spool.spool import DEFAULT_LEASE_S


@dataclass
class FollowSettings:
    """Where a stage takes its shards from as they land, and how it holds them."""

    follow: Optional[Path] = setting(
        None, "Take the shards of this spool as they land and publish the results into the spool --out (asynchronous "
        "RL; formats/SPEC.md §12) instead of processing the input shards once.")
    consumer: Optional[str] = setting(None, "This stage's name in the input spool (default: one derived from --out, "
                                      "stable across restarts; give each concurrent instance its own).")
    poll_s: float = setting(1.0, "Seconds between looks at the input spool while it is empty.", min=0.01)
    lease_s: float = setting(DEFAULT_LEASE_S, "Seconds a claim stays this stage's without a renewal (renewed every third "
                             "of it).", min=0.1)
    idle_timeout: Optional[float] = setting(None, "Stop after this many seconds without a new shard (default: wait for ever).", min=0.0)


def default_consumer(prefix: str, out: Path) -> str:
    """The consumer name of a stage writing ``out`` when ``--consumer`` is not given: stable across
    restarts (the same ``out``), different for stages writing elsewhere."""
    return f"{prefix}-" + hashlib.blake2b(str(Path(out).resolve()).encode(), digest_size=5).hexdigest()
