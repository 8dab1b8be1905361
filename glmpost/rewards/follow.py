"""``judge --follow IN --out OUT``: judge rollout shards as they land in spool ``IN`` and publish
each judged shard into spool ``OUT`` under the same name (:mod:`glmpost.spool.relay`)."""

from __future__ import annotations

from typing import Any

from glmpost.kernel.loading import load_tokenizer
from glmpost.npu import resolve_device
from glmpost.rewards.judging import STAGE, check_input
from glmpost.rewards.mixture import MODEL_SOURCES, RewardMixture, RewardStats, uses_domain_routing
from glmpost.rewards.verifiers import VerifierTable
from glmpost.spool.relay import RelayConfig, relay


def follow_judge(run, follow: RelayConfig) -> dict[str, Any]:
    """:func:`~glmpost.spool.relay.relay` with :meth:`JudgeRun.judge_shard <glmpost.rewards.judging.JudgeRun.judge_shard>`."""
    from tqdm import tqdm

    c = run.config
    tokenizer, revision = load_tokenizer(c.checkpoint)
    table = VerifierTable({**(c.domains or {}), **dict(c.verifiers)}, c.default_verifier)
    routing = table if uses_domain_routing(run.specs) else None
    needs_model = any(spec.source in MODEL_SOURCES for spec in run.specs)
    mixture = RewardMixture(run.specs, tokenizer=tokenizer, tokenizer_revision=revision, verifiers=table,
                            device=resolve_device(c.device) if needs_model else "cpu")
    totals = RewardStats(mixture.specs)
    progress = tqdm(desc="judge --follow", unit="rec", leave=False, disable=None)

    def judge(shard, target) -> dict[str, Any]:
        progress.total = (progress.total or 0) + check_input(shard, revision, routing)
        stats = run.judge_shard(shard, target, mixture, progress)
        totals.merge(stats)
        return stats.metrics()

    with progress:
        summary = relay(follow, out=c.out, revision=revision, stage=STAGE, options=run.options, process=judge)
    return {**summary, **{key.removeprefix("judge/"): value for key, value in totals.metrics().items()}}
