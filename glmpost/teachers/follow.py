"""``score-teacher --follow IN --out OUT``: score student rollouts with their teachers as they land in
spool ``IN`` and publish each scored shard into spool ``OUT`` under the same name
(:mod:`glmpost.spool.relay`), so ``rollout | score-teacher | opd-merge`` runs asynchronously."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glmpost.config import ConfigError
from glmpost.spool.relay import RelayConfig, relay
from glmpost.spool.spool import spool_revision
from glmpost.teachers.run import STAGE, load_teachers, unique_teachers


def follow_score_teacher(run, follow: RelayConfig) -> dict[str, Any]:
    """:func:`~glmpost.spool.relay.relay` with :meth:`ScoreTeacherRun.score_shard
    <glmpost.teachers.run.ScoreTeacherRun.score_shard>`; the teachers load with the first shard."""
    from tqdm import tqdm

    c = run.config
    if c.engine != "local":
        raise ConfigError("{follow} scores with the local engine; drop {engine} sglang (or run score-teacher per shard set)")
    revision = spool_revision(Path(follow.follow))
    loaded: list[bool] = []
    progress = tqdm(desc="score-teacher --follow", unit="rec", leave=False, disable=None)

    def score(shard: Path, target: Path) -> dict[str, Any]:
        run.check([shard])  # routes, vocabularies and token ranges, before anything is written
        if not loaded:
            load_teachers(unique_teachers(run.teachers), c.device, c.attention)
            loaded.append(True)
        progress.total = (progress.total or 0) + len(run.plan[shard])
        stats = run.score_shard(shard, target, None, progress)
        run._add(stats)
        return stats["metrics"]

    with progress:
        summary = relay(follow, out=Path(c.out), revision=revision, stage=STAGE, options=run.options, process=score)
    return {**summary, **run.totals}
