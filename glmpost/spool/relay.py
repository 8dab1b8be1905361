"""A stage between two spools (``judge --follow IN --out OUT``, ``score-teacher --follow IN --out
OUT``): take each shard of ``IN`` as it lands, publish what the stage makes of it into ``OUT`` under
the same name, then commit it in ``IN`` (formats/SPEC.md §12). So ``rollout | judge | train-grpo``
and ``rollout | score-teacher | opd-merge`` run asynchronously, stage by stage, as they do in turn.

The output shard's name is the commit record: a restart that finds a claimed shard already in
``OUT`` commits it without processing it again. SIGTERM / SIGINT stop after the shard in progress;
``--idle-timeout`` after that long without one. Metrics and stage.json go to
``OUT/producers/CONSUMER/``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from glmpost.config import setting
from glmpost.formats import ShardReader
from glmpost.spool.spool import DEFAULT_LEASE_S, Spool, lease_kept
from glmpost.stage import MetricsWriter, log, stop_on_signals, write_stage_json


@dataclass
class RelayConfig:
    """The options a stage between two spools adds."""

    follow: Optional[Path] = setting(
        None, "Take the shards of this spool as they land and publish the results into the spool --out (asynchronous "
        "RL; formats/SPEC.md §12) instead of processing the input shards once.")
    consumer: Optional[str] = setting(None, "This stage's name in the input spool (default: one derived from --out, "
                                      "stable across restarts; give each concurrent instance its own).")
    poll_s: float = setting(1.0, "Seconds between looks at the input spool while it is empty.", min=0.01)
    lease_s: float = setting(DEFAULT_LEASE_S, "Seconds a claim stays this stage's without a renewal.", min=0.1)
    idle_timeout: Optional[float] = setting(None, "Stop after this many seconds without a new shard (default: wait for ever).", min=0.0)


RELAY_OPTIONS = ("follow", "consumer", "poll_s", "lease_s", "idle_timeout")


def relay_line(summary: dict[str, Any], verb: str) -> str:
    """The human line of a relay run (``verb``: what the stage did to each shard)."""
    return f"{summary['out']}: {summary['shards']} shard(s) {verb} from {summary['spool']}, stopped by {summary['stopped_by']}"


def relay(config: RelayConfig, *, out: Path, revision: str, stage: str, options: dict[str, Any],
          process: Callable[[Path, Path], dict[str, Any]]) -> dict[str, Any]:
    """Run the loop (module doc): ``process(input shard, output path)`` writes the output shard
    (atomically) and returns its metrics."""
    source, target = Spool(config.follow, tokenizer_revision=revision), Spool(out, tokenizer_revision=revision)
    consumer = config.consumer or f"{stage}-" + hashlib.blake2b(str(target.path.resolve()).encode(), digest_size=5).hexdigest()
    home = target.path / "producers" / consumer
    home.mkdir(parents=True, exist_ok=True)
    write_stage_json(home, stage, options, tokenizer_revision=revision, spool=str(source.path))
    done, last_new = 0, time.monotonic()
    with stop_on_signals() as stop, lease_kept(source, consumer, config.lease_s), MetricsWriter(home / "metrics.jsonl") as metrics:
        try:
            while stop["signal"] is None:
                shards = source.claimed(consumer) or source.claim(consumer, limit=1, lease_s=config.lease_s)
                if not shards:
                    if config.idle_timeout is not None and time.monotonic() - last_new > config.idle_timeout:
                        stop["signal"] = "idle"
                        break
                    time.sleep(config.poll_s)
                    continue
                last_new = time.monotonic()
                for shard in shards:
                    if shard.name not in target.names():  # else made before a crash: only the commit is left
                        metrics.write(shard=shard.name, input=str(source.path), **process(shard, target.publish_path(shard.name)))
                        done += 1
                    source.commit(consumer, [shard], version=-1, ids={shard.name: [r["id"] for r in ShardReader(shard)]})
                    if stop["signal"] is not None:
                        break
        finally:
            source.release(consumer)
    log(f"{target.path}: {done} shard(s) from {source.path}")
    return {"out": str(target.path), "spool": str(source.path), "consumer": consumer, "shards": done, "stopped_by": stop["signal"]}
