"""``judge --follow IN --out OUT``: judge rollout shards as they land in spool ``IN`` and publish
each judged shard into spool ``OUT`` under the same name (formats/SPEC.md §12), so ``rollout |
judge | train-grpo`` runs asynchronously, stage by stage, as it does in turn.

Per shard: claim it in ``IN`` (oldest first), judge it into ``OUT`` (atomically: a judged shard
appears whole or not at all), then commit it in ``IN``. The judged shard's name is the commit
record: a restart that finds a claimed shard already in ``OUT`` commits it without judging it again.
SIGTERM / SIGINT stop after the shard in progress; ``--idle-timeout`` after that long without one.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

from glmpost.checkpoints import load_tokenizer
from glmpost.config import setting
from glmpost.formats import ShardReader
from glmpost.formats.spool import DEFAULT_LEASE_S, Spool, lease_kept
from glmpost.stage import MetricsWriter, log, stop_on_signals, write_stage_json


@dataclass
class JudgeFollowConfig:
    """The options ``judge --follow`` adds."""

    follow: Optional[Path] = setting(
        None, "Judge the shards of this spool as they land and publish them into the spool --out (asynchronous RL; "
        "formats/SPEC.md §12) instead of judging INPUTS once.")
    consumer: Optional[str] = setting(None, "This judge's name in the input spool (default: one derived from --out, stable across restarts).")
    poll_s: float = setting(1.0, "Seconds between looks at the input spool while it is empty.", min=0.01)
    lease_s: float = setting(DEFAULT_LEASE_S, "Seconds a claim stays this judge's without a renewal.", min=0.1)
    idle_timeout: Optional[float] = setting(None, "Stop after this many seconds without a new shard (default: wait for ever).", min=0.0)


def follow_judge(run, follow: JudgeFollowConfig) -> dict[str, Any]:
    """Run the follow loop (module doc) for :class:`~glmpost.rewards.judging.JudgeRun` ``run``."""
    from glmpost.npu import resolve_device
    from glmpost.rewards.judging import STAGE, check_input
    from glmpost.rewards.mixture import MODEL_SOURCES, RewardMixture, RewardStats, uses_domain_routing
    from glmpost.rewards.verifiers import VerifierTable

    c = run.config
    _, revision = load_tokenizer(c.checkpoint)
    source, target = Spool(follow.follow, tokenizer_revision=revision), Spool(c.out, tokenizer_revision=revision)
    consumer = follow.consumer or "judge-" + hashlib.blake2b(str(target.path.resolve()).encode(), digest_size=5).hexdigest()
    table = VerifierTable({**(c.domains or {}), **dict(c.verifiers)}, c.default_verifier)
    routing = table if uses_domain_routing(run.specs) else None
    needs_model = any(spec.source in MODEL_SOURCES for spec in run.specs)
    tokenizer, _ = load_tokenizer(c.checkpoint)
    mixture = RewardMixture(run.specs, tokenizer=tokenizer, tokenizer_revision=revision, verifiers=table,
                            device=resolve_device(c.device) if needs_model else "cpu")
    home = target.path / "producers" / consumer
    home.mkdir(parents=True, exist_ok=True)
    write_stage_json(home, STAGE, run.options, tokenizer_revision=revision, spool=str(source.path))
    judged, totals, last_new = 0, RewardStats(mixture.specs), time.monotonic()
    progress = tqdm(desc="judge --follow", unit="rec", leave=False, disable=None)
    with stop_on_signals() as stop, lease_kept(source, consumer, follow.lease_s), MetricsWriter(home / "metrics.jsonl") as metrics, progress:
        try:
            while stop["signal"] is None:
                shards = source.claimed(consumer) or source.claim(consumer, limit=1, lease_s=follow.lease_s)
                if not shards:
                    if follow.idle_timeout is not None and time.monotonic() - last_new > follow.idle_timeout:
                        stop["signal"] = "idle"
                        break
                    time.sleep(follow.poll_s)
                    continue
                last_new = time.monotonic()
                for shard in shards:
                    if shard.name not in target.names():  # else judged before a crash: only the commit is left
                        progress.total = (progress.total or 0) + check_input(shard, revision, routing)
                        stats = run.judge_shard(shard, target.publish_path(shard.name), mixture, progress)
                        metrics.write(shard=shard.name, input=str(source.path), **stats.metrics())
                        totals.merge(stats)
                        judged += 1
                    source.commit(consumer, [shard], version=-1, ids={shard.name: [r["id"] for r in ShardReader(shard)]})
                    if stop["signal"] is not None:
                        break
        finally:
            source.release(consumer)
    log(f"{target.path}: {judged} shard(s) judged from {source.path}")
    return {"out": str(target.path), "spool": str(source.path), "consumer": consumer, "shards": judged,
            "stopped_by": stop["signal"], **{key.removeprefix("judge/"): value for key, value in totals.metrics().items()}}
