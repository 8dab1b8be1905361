"""A trainer in follow mode: consume a spool as trajectories land, train an update per batch of
them, publish a version every ``--publish-every`` updates, commit each batch exactly once (brief,
the asynchronous loop: "允许系统异步前进，同时只让仍然可信的 token 产生梯度", "sync every K steps";
formats/SPEC.md §12).

The trainer stays in memory (a :class:`~glmpost.rl.follow_session.FollowSession`), set up once from
the output root's newest version (the initial ``--checkpoint`` before the first). Each round: finish
any commit a crash interrupted (:meth:`~glmpost.spool.spool.Spool.reconcile` from the published
manifests, also for a shard claimed again after its lease was reaped), take this trainer's claims
not yet trained and claim ready shards, oldest first, until they hold ``follow_records`` records
(the claim loop every spool consumer shares, :class:`~glmpost.spool.claims.Claims`);
train one update on them, leaving out every record the ledger says was trained. Every
``publish_every`` updates the weights become the next version, whose manifest lists the shards and
ids of its updates (the commit record); then they are ledgered and moved to ``done/``. Staleness
and DIS are the update's own (``--max-staleness``, ``--max-version-lag``, ``--trust-mask``),
counted in published versions. A batch with nothing left to train (all stale, all trained before)
is committed as dropped (version -1) so it is not retried forever; its records' lengths and
rewards are in the metrics.

A background thread renews the lease. The run ends with its input: when every producer of the
spool has closed its stream and no shard is left (formats/SPEC.md §12, end of stream), the last
records are trained as one smaller batch and the updates since the last version published.
SIGTERM / SIGINT stop after the update in progress, publishing the updates since the last version,
and return unused claims to ``ready/``; ``--max-steps``, ``--max-versions`` and ``--idle-timeout``
(a safety net, not the way a run ends) stop it the same way. A crash loses the
updates since the last version (their claims return after the lease; a restart trains them again).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from glmpost.checkpoints import CheckpointError, CheckpointRoot, read_manifest
from glmpost.config import section, setting
from glmpost.formats import ShardReader
from glmpost.rl.admission import NothingToTrain
from glmpost.spool.claims import Claims, Stop
from glmpost.spool.settings import FollowSettings, default_consumer
from glmpost.spool.spool import Spool
from glmpost.stage import MetricsWriter, log


@dataclass
class FollowConfig:
    """The follow-mode options a training stage adds: the spool it consumes (the settings every
    consumer shares) and how its updates become versions."""

    source: FollowSettings = section(FollowSettings, help={"follow": (
        "Consume shards from this spool as they land (asynchronous RL) instead of INPUTS: one version per "
        "--follow-records records, each batch committed exactly once (formats/SPEC.md §12).")})
    follow_records: int = setting(64, "Records per published version in --follow mode (whole shards are claimed until this many).", min=1)
    publish_every: int = setting(1, "Publish a version every N updates (an update per --follow-records records); the trainer "
                                 "keeps its weights and optimizer state in memory between them.", min=1)
    max_steps: Optional[int] = setting(None, "Stop after this many updates, publishing the ones since the last version "
                                       "(default: run until stopped).", min=1)
    max_versions: Optional[int] = setting(None, "Stop after publishing this many versions (default: run until stopped).", min=1)


def committed_shards(root: Path, spool: Spool, read: dict[int, dict] | None = None) -> dict[str, tuple[int, list[str]]]:
    """``{shard name: (version, ids)}`` of every version under ``root`` whose manifest commits
    shards of ``spool`` (its ``extra.spool``). ``read`` keeps each version's commit record between
    calls (a published version never changes), so a long run reads each manifest once."""

    read = {} if read is None else read
    found: dict[str, tuple[int, list[str]]] = {}
    checkpoints = CheckpointRoot(root)
    for version in checkpoints.versions():
        if version not in read:
            try:
                read[version] = read_manifest(checkpoints.version_dir(version)).extra.get("spool") or {}
            except CheckpointError:
                continue
        extra = read[version]
        if Path(extra.get("path", "")).resolve() == spool.path.resolve():
            for name, ids in extra.get("shards", {}).items():
                found[name] = (version, list(ids))
    return found


def _shard_ids(path: Path) -> list[str]:
    return [record["id"] for record in ShardReader(path)]


class FollowTrainer(Protocol):
    """What :func:`follow_spool` drives: updates in memory, versions on disk
    (:class:`~glmpost.rl.follow_session.FollowSession`)."""

    def train(self, shards: list[Path], skip_ids: frozenset) -> dict[str, Any]:
        """One update on ``shards`` without the records ``skip_ids`` names: its ``records``,
        ``trained_records``, ``version_lags`` and step ``metrics``; raises
        :class:`~glmpost.rl.admission.NothingToTrain` when every record was excluded."""

    def publish(self, manifest_extra: dict[str, Any]) -> int:
        """Publish the updates since the last version as the next one; returns its number."""


class FollowLoop:
    """The state of one :func:`follow_spool` run: the spool and this trainer's claims in it, the
    updates since the last version and the run's totals."""

    def __init__(self, config: FollowConfig, *, out: Path, tokenizer_revision: str, trainer: FollowTrainer):
        source = config.source
        self.config, self.out, self.trainer = config, out, trainer
        self.spool = Spool(source.follow, tokenizer_revision=tokenizer_revision)
        self.spool.bind_consumer_root(out)
        self.consumer = source.consumer or default_consumer("trainer", out)
        out.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.claims = Claims(self.spool, self.consumer, source, stage="trainer")
        self.versions: list[int] = []
        self.dropped = self.stale_dropped = self.steps = 0
        self.pending: dict[str, list[str]] = {}  # shard name -> ids, trained since the last version
        self.pending_claims: list[Path] = []
        self.pending_lags, self.pending_counts = Counter(), Counter()
        self.manifests: dict[int, dict] = {}  # the commit records read so far
        self.metrics: MetricsWriter | None = None

    def idle_fraction(self) -> float:
        return round(self.claims.waited / max(time.monotonic() - self.started, 1e-9), 4)

    def ran_out(self) -> Stop | None:
        """``max_steps`` updates trained, or ``max_versions`` versions published."""
        config = self.config
        if config.max_steps is not None and self.steps >= config.max_steps:
            return Stop.MAX_STEPS
        if config.max_versions is not None and len(self.versions) >= config.max_versions:
            return Stop.MAX_VERSIONS
        return None

    def committed(self) -> dict[str, tuple[int, list[str]]]:
        """The shards the published versions trained; a commit a crash interrupted (also of a shard
        claimed again after its lease was reaped) is finished, never trained again."""
        committed = committed_shards(self.out, self.spool, self.manifests)
        self.spool.reconcile(self.consumer, committed)
        return committed

    def run(self) -> Stop:
        """Train an update per batch of claimed shards until the claims stop short (a smaller last
        batch at the end of the stream) or the run ran out; the updates since the last version are
        then published, not lost. Returns why it stopped."""
        done_before = self.spool.reconcile(self.consumer, committed_shards(self.out, self.spool, self.manifests))
        if done_before:
            log(f"{self.spool.path}: finished {done_before} commit(s) an interrupted run left")
        while (stop := self.claims.signalled or self.ran_out()) is None:
            committed, ids = self.committed(), {}

            def records(shard: Path) -> int:  # a claim's size; its ids are the commit record
                ids[shard.name] = _shard_ids(shard)
                return len(ids[shard.name])

            claimed = self.claims.claim(self.config.follow_records, size=records, skip=self.pending,
                                        keep=self._uncommitted(committed))
            if claimed.shards and claimed.stop in (None, Stop.END_OF_STREAM):  # the stream's last records: a smaller batch
                self.train(claimed.shards, ids, committed)
            if claimed.stop is not None:
                stop = claimed.stop
                break
        if self.pending:
            self.publish()
        return stop

    def _uncommitted(self, committed: dict) -> Callable[[list[Path]], list[Path]]:
        """``keep`` of a claim: new claims whose commit a crash interrupted are finished and left out."""
        def keep(new: list[Path]) -> list[Path]:
            if not self.spool.reconcile(self.consumer, committed):
                return new
            return [shard for shard in new if shard.name not in committed]

        return keep

    def train(self, claims: list[Path], ids: dict[str, list[str]], committed: dict) -> None:
        """One update on ``claims`` without any record trained before; a batch with nothing left is
        committed as dropped (version -1)."""
        spool = self.spool
        trained = (spool.consumed_ids() | {i for _, shard_ids in committed.values() for i in shard_ids}
                   | {i for shard_ids in self.pending.values() for i in shard_ids})
        try:
            update = self.trainer.train(claims, frozenset(trained))
        except NothingToTrain as exc:
            log(f"{spool.path}: {len(claims)} shard(s) dropped: {exc}")
            spool.commit(self.consumer, claims, version=-1, ids=ids)
            self.dropped += sum(map(len, ids.values()))
            self.stale_dropped += int(exc.metrics.get("train/stale_dropped", 0))
            self.metrics.write(**{"follow/dropped_shards": len(claims), "follow/dropped_records": self.dropped,
                                  **{key.replace("train/", "follow/"): value for key, value in exc.metrics.items()}})
            return
        self.steps += 1
        self.pending.update(ids)
        self.pending_claims.extend(claims)
        self.pending_lags.update({str(lag): n for lag, n in update["version_lags"].items()})
        self.pending_counts.update(updates=1, records=update["records"], trained_records=update["trained_records"])
        self.stale_dropped += int(update["metrics"].get("train/stale_dropped", 0))
        log(f"{spool.path}: update {self.steps} on {len(claims)} shard(s), {update['trained_records']} records trained "
            f"({self.pending_counts['updates']} since the last version)")
        if self.pending_counts["updates"] >= self.config.publish_every or self.ran_out() is not None:
            self.publish()

    def publish(self) -> None:
        """The updates since the last version as the next one, its manifest the commit record; then
        their shards are committed."""
        spool, counts, lags = self.spool, self.pending_counts, self.pending_lags
        extra = {"spool": {"path": str(spool.path.resolve()), "consumer": self.consumer, "shards": dict(self.pending)},
                 "records": counts["records"], "trained_records": counts["trained_records"], "version_lags": dict(lags)}
        version = self.trainer.publish(extra)
        spool.commit(self.consumer, self.pending_claims, version=version, ids=self.pending)
        self.versions.append(version)
        depth = spool.depth()
        self.metrics.write(**{"follow/policy_version": version, "follow/updates": counts["updates"],
                              **{f"follow/version_lag/{lag}": n for lag, n in sorted(lags.items(), key=lambda kv: (kv[0] == "unknown", 0 if kv[0] == "unknown" else int(kv[0])))},
                              "follow/records": counts["records"], "follow/trained_records": counts["trained_records"],
                              "follow/shards": len(self.pending_claims), "follow/queue_ready": depth.ready,
                              "follow/queue_claimed": depth.claimed, "follow/dropped_records": self.dropped,
                              "follow/stale_dropped": self.stale_dropped, "follow/idle_fraction": self.idle_fraction()})
        log(f"{spool.path}: v{version} from {counts['updates']} update(s) on {len(self.pending_claims)} shard(s), "
            f"{counts['trained_records']} records trained; queue {depth.ready} ready")
        self.pending.clear()
        self.pending_claims.clear()
        lags.clear()
        counts.clear()

    def summary(self, stopped: Stop) -> dict[str, Any]:
        return {"out": str(self.out), "spool": str(self.spool.path), "consumer": self.consumer, "versions": self.versions,
                "policy_version": self.versions[-1] if self.versions else None, "updates": self.steps,
                "dropped_records": self.dropped, "stale_dropped": self.stale_dropped, "stopped_by": stopped.value,
                "idle_fraction": self.idle_fraction()}


def follow_spool(config: FollowConfig, *, out: Path, tokenizer_revision: str, trainer: FollowTrainer) -> dict[str, Any]:
    """Run the follow loop (module doc) with ``trainer``; returns the run's summary."""
    loop = FollowLoop(config, out=out, tokenizer_revision=tokenizer_revision, trainer=trainer)
    with loop.claims, MetricsWriter(out / "metrics.jsonl") as loop.metrics:
        stopped = loop.run()
    return loop.summary(stopped)


def follow_line(summary: dict[str, Any]) -> str:
    """The human line of a trainer's follow run."""
    return (f"{summary['out']}: {len(summary['versions'])} version(s) from {summary['updates']} update(s) on {summary['spool']} "
            f"(now v{summary['policy_version']}), {summary['dropped_records']} records dropped "
            f"({summary['stale_dropped']} stale), stopped by {summary['stopped_by']}")
