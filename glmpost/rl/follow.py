"""A trainer in follow mode: consume a spool as trajectories land, train an update per batch of
them, publish a version every ``--publish-every`` updates, commit each batch exactly once (brief,
the asynchronous loop: "允许系统异步前进，同时只让仍然可信的 token 产生梯度", "sync every K steps";
formats/SPEC.md §12).

The trainer stays in memory (:class:`~glmpost.rl.persistent.PersistentRun`), set up once from the
output root's newest version (the initial ``--checkpoint`` before the first). Each round: finish
any commit a crash interrupted (:meth:`~glmpost.spool.spool.Spool.reconcile` from the published
manifests, also for a shard claimed again after its lease was reaped), take this trainer's claims
not yet trained and claim ready shards, oldest first, until they hold ``follow_records`` records;
train one update on them, leaving out every record the ledger says was trained. Every
``publish_every`` updates the weights become the next version, whose manifest lists the shards and
ids of its updates (the commit record); then they are ledgered and moved to ``done/``. Staleness
and DIS are the update's own (``--max-staleness``, ``--max-version-lag``, ``--trust-mask``),
counted in published versions. A batch with nothing left to train (all stale, all trained before)
is committed as dropped (version -1) so it is not retried forever; its records' lengths and
rewards are in the metrics.

A background thread renews the lease; SIGTERM / SIGINT stop after the update in progress,
publishing the updates since the last version, and return unused claims to ``ready/``;
``--max-steps``, ``--max-versions`` and ``--idle-timeout`` stop it the same way. A crash loses the
updates since the last version (their claims return after the lease; a restart trains them again).
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

from glmpost.checkpoints import CheckpointError, CheckpointRoot, NextVersion, read_manifest, resolve_checkpoint
from glmpost.config import setting
from glmpost.errors import UsageError
from glmpost.formats import ShardReader
from glmpost.kernel.loading import load_tokenizer
from glmpost.rl.batches import trained_records
from glmpost.rl.critic import CriticVersions
from glmpost.rl.persistent import PersistentRun, newest_parent
from glmpost.rl.run import load_for_training
from glmpost.rl.updates import NothingToTrain, grpo_batch, grpo_trainer, opd_batch, opd_trainer, sao_batch, sao_trainer
from glmpost.spool.spool import DEFAULT_LEASE_S, Spool, lease_kept
from glmpost.stage import MetricsWriter, log, stop_on_signals


@dataclass
class FollowConfig:
    """The follow-mode options a training stage adds (``--follow SPOOL`` and its companions)."""

    follow: Optional[Path] = setting(
        None, "Consume shards from this spool as they land (asynchronous RL) instead of INPUTS: one version per "
        "--follow-records records, each batch committed exactly once (formats/SPEC.md §12).")
    consumer: Optional[str] = setting(None, "This trainer's name in the spool (default: one derived from --out, stable across restarts).")
    follow_records: int = setting(64, "Records per published version in --follow mode (whole shards are claimed until this many).", min=1)
    poll_s: float = setting(1.0, "Seconds between looks at the spool while waiting for shards.", min=0.01)
    lease_s: float = setting(DEFAULT_LEASE_S, "Seconds a claim stays this trainer's without a renewal (renewed every third of it).", min=0.1)
    publish_every: int = setting(1, "Publish a version every N updates (an update per --follow-records records); the trainer "
                                 "keeps its weights and optimizer state in memory between them.", min=1)
    max_steps: Optional[int] = setting(None, "Stop after this many updates, publishing the ones since the last version "
                                       "(default: run until stopped).", min=1)
    max_versions: Optional[int] = setting(None, "Stop after publishing this many versions (default: run until stopped).", min=1)
    idle_timeout: Optional[float] = setting(None, "Stop after this many seconds without a new shard (default: wait for ever).", min=0.0)


def default_consumer(out: Path) -> str:
    return "trainer-" + hashlib.blake2b(str(Path(out).resolve()).encode(), digest_size=5).hexdigest()


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


def _shard_ids(paths: list[Path]) -> dict[str, list[str]]:
    return {path.name: [record["id"] for record in ShardReader(path)] for path in paths}


class FollowTrainer(Protocol):
    """What :func:`follow_spool` drives: updates in memory, versions on disk."""

    def train(self, shards: list[Path], skip_ids: frozenset) -> dict[str, Any]:
        """One update on ``shards`` without the records ``skip_ids`` names: its ``records``,
        ``trained_records``, ``version_lags`` and step ``metrics``; raises
        :class:`~glmpost.rl.updates.NothingToTrain` when every record was excluded."""

    def publish(self, manifest_extra: dict[str, Any]) -> int:
        """Publish the updates since the last version as the next one; returns its number."""


def follow_spool(config: FollowConfig, *, out: Path, tokenizer_revision: str, trainer: FollowTrainer) -> dict[str, Any]:
    """Run the follow loop (module doc); returns the run's summary."""

    spool = Spool(config.follow, tokenizer_revision=tokenizer_revision)
    spool.bind_consumer_root(out)
    consumer = config.consumer or default_consumer(out)
    out.mkdir(parents=True, exist_ok=True)
    started, waited, last_new = time.monotonic(), 0.0, time.monotonic()
    versions, dropped, stale_dropped, steps = [], 0, 0, 0
    pending: dict[str, list[str]] = {}  # shard name -> ids, trained since the last version
    pending_claims: list[Path] = []
    pending_lags, pending_counts = Counter(), Counter()
    manifests: dict[int, dict] = {}  # the commit records read so far

    def publish() -> None:
        extra = {"spool": {"path": str(spool.path.resolve()), "consumer": consumer, "shards": dict(pending)},
                 "records": pending_counts["records"], "trained_records": pending_counts["trained_records"],
                 "version_lags": dict(pending_lags)}
        version = trainer.publish(extra)
        spool.commit(consumer, pending_claims, version=version, ids=pending)
        versions.append(version)
        depth = spool.depth()
        metrics.write(**{"follow/policy_version": version, "follow/updates": pending_counts["updates"],
                         **{f"follow/version_lag/{lag}": n for lag, n in sorted(pending_lags.items(), key=lambda kv: int(kv[0]))},
                         "follow/records": pending_counts["records"], "follow/trained_records": pending_counts["trained_records"],
                         "follow/shards": len(pending_claims), "follow/queue_ready": depth.ready,
                         "follow/queue_claimed": depth.claimed, "follow/dropped_records": dropped,
                         "follow/stale_dropped": stale_dropped,
                         "follow/idle_fraction": round(waited / max(time.monotonic() - started, 1e-9), 4)})
        log(f"{spool.path}: v{version} from {pending_counts['updates']} update(s) on {len(pending_claims)} shard(s), "
            f"{pending_counts['trained_records']} records trained; queue {depth.ready} ready")
        pending.clear()
        pending_claims.clear()
        pending_lags.clear()
        pending_counts.clear()

    def finished() -> bool:
        return ((config.max_versions is not None and len(versions) >= config.max_versions)
                or (config.max_steps is not None and steps >= config.max_steps))

    with stop_on_signals() as stop, lease_kept(spool, consumer, config.lease_s), MetricsWriter(out / "metrics.jsonl") as metrics:
        try:
            done_before = spool.reconcile(consumer, committed_shards(out, spool, manifests))
            if done_before:
                log(f"{spool.path}: finished {done_before} commit(s) an interrupted run left")
            while stop["signal"] is None and not finished():
                # A shard a published version already trained (its commit interrupted, then its
                # claim reaped and claimed again) is committed, not trained again.
                committed = committed_shards(out, spool, manifests)
                spool.reconcile(consumer, committed)
                claims, ids = [], {}
                for shard in spool.claimed(consumer):  # held from before a restart, or pending
                    if shard.name not in pending and sum(map(len, ids.values())) < config.follow_records:
                        claims.append(shard)
                        ids.update(_shard_ids([shard]))
                while sum(map(len, ids.values())) < config.follow_records and stop["signal"] is None:
                    new = spool.claim(consumer, limit=1, lease_s=config.lease_s)
                    if new and spool.reconcile(consumer, committed):
                        new = [shard for shard in new if shard.name not in committed]
                    if new:
                        last_new = time.monotonic()
                        ids.update(_shard_ids(new))
                        claims += new
                        continue
                    if config.idle_timeout is not None and time.monotonic() - last_new > config.idle_timeout:
                        stop["signal"] = "idle"
                        break
                    time.sleep(config.poll_s)
                    waited += config.poll_s
                if stop["signal"] is not None:
                    break
                trained = (spool.consumed_ids() | {i for _, shard_ids in committed.values() for i in shard_ids}
                           | {i for shard_ids in pending.values() for i in shard_ids})
                try:
                    update = trainer.train(claims, frozenset(trained))
                except NothingToTrain as exc:
                    log(f"{spool.path}: {len(claims)} shard(s) dropped: {exc}")
                    spool.commit(consumer, claims, version=-1, ids=ids)
                    dropped += sum(map(len, ids.values()))
                    stale_dropped += int(exc.metrics.get("train/stale_dropped", 0))
                    metrics.write(**{"follow/dropped_shards": len(claims), "follow/dropped_records": dropped,
                                     **{key.replace("train/", "follow/"): value for key, value in exc.metrics.items()}})
                    continue
                steps += 1
                pending.update(ids)
                pending_claims.extend(claims)
                pending_lags.update({str(lag): n for lag, n in update["version_lags"].items()})
                pending_counts.update(updates=1, records=update["records"], trained_records=update["trained_records"])
                stale_dropped += int(update["metrics"].get("train/stale_dropped", 0))
                log(f"{spool.path}: update {steps} on {len(claims)} shard(s), {update['trained_records']} records trained "
                    f"({pending_counts['updates']} since the last version)")
                if pending_counts["updates"] >= config.publish_every or finished():
                    publish()
            if pending:  # a clean stop: the updates since the last version are published, not lost
                publish()
        finally:
            released = spool.release(consumer)  # claims not published: back to ready/ for anyone
            if released:
                log(f"{spool.path}: returned {released} unpublished claim(s) to ready/")
    return {"out": str(out), "spool": str(spool.path), "consumer": consumer, "versions": versions,
            "policy_version": versions[-1] if versions else None, "updates": steps, "dropped_records": dropped,
            "stale_dropped": stale_dropped, "stopped_by": stop["signal"] or ("max_steps" if config.max_steps is not None
                                                                             and steps >= config.max_steps else "max_versions"),
            "idle_fraction": round(waited / max(time.monotonic() - started, 1e-9), 4)}


def follow_line(summary: dict[str, Any]) -> str:
    """The human line of a trainer's follow run."""
    return (f"{summary['out']}: {len(summary['versions'])} version(s) from {summary['updates']} update(s) on {summary['spool']} "
            f"(now v{summary['policy_version']}), {summary['dropped_records']} records dropped "
            f"({summary['stale_dropped']} stale), stopped by {summary['stopped_by']}")


class _PersistentFollower:
    """A :class:`FollowTrainer` over a :class:`~glmpost.rl.persistent.PersistentRun`:
    ``make_batch(inputs, parent_version, skip_ids)`` makes an update's :class:`~glmpost.rl.updates.UpdateBatch`."""

    def __init__(self, run, make_batch, *, revision: str, stage_options: dict[str, Any]):
        self.run, self.make_batch, self.revision, self.stage_options = run, make_batch, revision, stage_options
        self.batches: list[dict] = []  # the stage.json facts of each update since the last version

    def train(self, shards: list[Path], skip_ids: frozenset) -> dict[str, Any]:
        batch = self.make_batch([str(s) for s in shards], self.run.parent_version, skip_ids)
        steps = self.run.train(batch.examples, batch.step_metrics)
        self.batches.append(batch.stage_extra)
        return {"records": batch.records, "trained_records": trained_records(batch.examples), "version_lags": batch.summary["version_lags"],
                "metrics": {**batch.step_metrics, **(steps[-1] if steps else {})}}

    def publish(self, manifest_extra: dict[str, Any]) -> int:
        version = self.run.publish(tokenizer_revision=self.revision, stage_options=self.stage_options,
                                   manifest_extra=manifest_extra,
                                   stage_extra={"version_lags": manifest_extra.get("version_lags", {}), "batches": self.batches})
        self.batches = []
        return version


def _training_follow(follow: FollowConfig, *, checkpoint: Path, out: Path, options, stage: str, config, build, make_batch,
                     revision: str, stage_options: dict[str, Any], companion=None) -> dict[str, Any]:
    """:func:`follow_spool` with a trainer kept in memory (``build`` makes it, ``make_batch`` each update's examples)."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--follow trains in one process for now: every rank would claim its own shards; "
                         "run it without torchrun / deepspeed")
    run = PersistentRun(Path(checkpoint), Path(out), options, stage=stage, config=config, build=build, companion=companion)
    try:
        return follow_spool(follow, out=Path(out), tokenizer_revision=revision,
                            trainer=_PersistentFollower(run, make_batch, revision=revision, stage_options=stage_options))
    finally:
        run.close()


def grpo_follow(follow: FollowConfig, *, checkpoint: Path, out: Path, options, config, temperature: float | None,
                ref_checkpoint: Path | None, stage_options: dict[str, Any]) -> dict[str, Any]:
    """``train-grpo --follow``: a :func:`~glmpost.rl.updates.grpo_batch` update per batch; the KL
    reference (``kl_coef`` > 0) is ``ref_checkpoint``, else the version the run started from."""

    tokenizer, revision = load_tokenizer(checkpoint)
    reference_dir = resolve_checkpoint(ref_checkpoint or checkpoint)
    build = grpo_trainer(config, pad_token_id=tokenizer.pad_token_id,
                         reference=lambda session: load_for_training(reference_dir, session, options, trained=False))
    return _training_follow(follow, checkpoint=checkpoint, out=out, options=options, stage="train-grpo", config=config,
                            build=build, revision=revision, stage_options=stage_options,
                            make_batch=lambda inputs, parent_version, skip: grpo_batch(
                                inputs, config, parent_version=parent_version, revision=revision, temperature=temperature,
                                skip_ids=skip))


def opd_follow(follow: FollowConfig, *, checkpoint: Path, out: Path, options, config,
               stage_options: dict[str, Any]) -> dict[str, Any]:
    """``opd-merge --follow``: a :func:`~glmpost.rl.updates.opd_batch` update per batch (group size
    1: an update per ``follow_records`` scored trajectories)."""

    tokenizer, revision = load_tokenizer(checkpoint)
    return _training_follow(follow, checkpoint=checkpoint, out=out, options=options, stage="opd-merge", config=config,
                            build=opd_trainer(config, pad_token_id=tokenizer.pad_token_id), revision=revision,
                            stage_options=stage_options,
                            make_batch=lambda inputs, parent_version, skip: opd_batch(
                                inputs, config, parent_version=parent_version, revision=revision, skip_ids=skip))


def sao_follow(follow: FollowConfig, *, checkpoint: Path, out: Path, critic_root: Path, init_critic: bool, options, config,
               stage_options: dict[str, Any]) -> dict[str, Any]:
    """``train-sao --follow``: a :func:`~glmpost.rl.updates.sao_batch` update per batch (group size 1),
    the critic kept in memory beside the policy and published with each version under ``critic_root``."""

    CriticVersions.finish_interrupted(critic_root, out)
    plan = NextVersion.plan(newest_parent(Path(out), Path(checkpoint)), out)
    tokenizer, revision = load_tokenizer(plan.parent)
    critic = CriticVersions(critic_root, policy=plan.parent, version=plan.version, groups=config.critic_groups(),
                            optimizer=config.critic_optimizer(), init=init_critic, seed=config.seed)
    return _training_follow(follow, checkpoint=checkpoint, out=out, options=options, stage="train-sao", config=config,
                            build=sao_trainer(config, critic, pad_token_id=tokenizer.pad_token_id, options=options),
                            revision=revision, stage_options=stage_options, companion=critic,
                            make_batch=lambda inputs, parent_version, skip: sao_batch(
                                inputs, config, parent_version=parent_version, revision=revision, skip_ids=skip))
