"""A trainer in follow mode: consume a spool as trajectories land, train an update per batch of
them, publish a version every ``--publish-every`` updates, commit each batch exactly once (brief,
the asynchronous loop: "允许系统异步前进，同时只让仍然可信的 token 产生梯度", "sync every K steps";
formats/SPEC.md §12).

The trainer stays in memory (a :class:`~glmpost.rl.run.TrainingRun` kept open), set up once from the
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

A background thread renews the lease. The run ends with its input: when every producer of the
spool has closed its stream and no shard is left (formats/SPEC.md §12, end of stream), the last
records are trained as one smaller batch and the updates since the last version published.
SIGTERM / SIGINT stop after the update in progress, publishing the updates since the last version,
and return unused claims to ``ready/``; ``--max-steps``, ``--max-versions`` and ``--idle-timeout``
(a safety net, not the way a run ends) stop it the same way. A crash loses the
updates since the last version (their claims return after the lease; a restart trains them again).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

from glmpost.checkpoints import CheckpointError, CheckpointRoot, read_manifest, resolve_checkpoint
from glmpost.config import ConfigError, section, setting
from glmpost.formats import ShardReader
from glmpost.kernel.loading import load_tokenizer
from glmpost.locks import output_lock
from glmpost.rl.batches import trained_records
from glmpost.rl.critic import CriticVersions
from glmpost.rl.jobs import TrainingJob, too_few_examples
from glmpost.rl.run import RunOptions, TrainingRun
from glmpost.rl.updates import NothingToTrain, grpo_batch, grpo_trainer, opd_batch, opd_trainer, sao_batch, sao_trainer
from glmpost.spool.settings import FollowSettings, default_consumer
from glmpost.spool.spool import Spool, lease_kept
from glmpost.stage import MetricsWriter, log, stop_on_signals


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


class _FollowLoop:
    """The state of one :func:`follow_spool` run: the spool, this trainer's name in it, the updates
    since the last version and the run's totals."""

    def __init__(self, config: FollowConfig, *, out: Path, tokenizer_revision: str, trainer: FollowTrainer):
        source = config.source
        self.config, self.source, self.out, self.trainer = config, source, out, trainer
        self.spool = Spool(source.follow, tokenizer_revision=tokenizer_revision)
        self.spool.bind_consumer_root(out)
        self.consumer = source.consumer or default_consumer("trainer", out)
        out.mkdir(parents=True, exist_ok=True)
        self.started, self.waited, self.last_new = time.monotonic(), 0.0, time.monotonic()
        self.versions: list[int] = []
        self.dropped = self.stale_dropped = self.steps = 0
        self.pending: dict[str, list[str]] = {}  # shard name -> ids, trained since the last version
        self.pending_claims: list[Path] = []
        self.pending_lags, self.pending_counts = Counter(), Counter()
        self.manifests: dict[int, dict] = {}  # the commit records read so far
        self.metrics: MetricsWriter | None = None

    def idle_fraction(self) -> float:
        return round(self.waited / max(time.monotonic() - self.started, 1e-9), 4)

    def finished(self) -> bool:
        config = self.config
        return ((config.max_versions is not None and len(self.versions) >= config.max_versions)
                or (config.max_steps is not None and self.steps >= config.max_steps))

    def committed(self) -> dict[str, tuple[int, list[str]]]:
        """The shards the published versions trained; a commit a crash interrupted (also of a shard
        claimed again after its lease was reaped) is finished, never trained again."""
        committed = committed_shards(self.out, self.spool, self.manifests)
        self.spool.reconcile(self.consumer, committed)
        return committed

    def claim_batch(self, committed: dict, stop: dict) -> tuple[list[Path], dict[str, list[str]]]:
        """This trainer's claims not yet trained, then ready shards, oldest first, until they hold
        ``follow_records`` records (fewer when stopped or idle: ``stop["signal"]`` says)."""
        spool, want, lease_s = self.spool, self.config.follow_records, self.source.lease_s
        claims, ids = [], {}
        for shard in spool.claimed(self.consumer):  # held from before a restart, or pending
            if shard.name not in self.pending and sum(map(len, ids.values())) < want:
                claims.append(shard)
                ids.update(_shard_ids([shard]))
        while sum(map(len, ids.values())) < want and stop["signal"] is None:
            new = spool.claim(self.consumer, limit=1, lease_s=lease_s)
            if new and spool.reconcile(self.consumer, committed):
                new = [shard for shard in new if shard.name not in committed]
            if new:
                self.last_new = time.monotonic()
                ids.update(_shard_ids(new))
                claims += new
                continue
            if spool.ended(self.consumer):
                stop["signal"] = "end_of_stream"
                break
            if self.source.idle_timeout is not None and time.monotonic() - self.last_new > self.source.idle_timeout:
                stop["signal"] = "idle"
                break
            time.sleep(self.source.poll_s)
            self.waited += self.source.poll_s
        return claims, ids

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
        if self.pending_counts["updates"] >= self.config.publish_every or self.finished():
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

    def run(self, stop: dict) -> None:
        done_before = self.spool.reconcile(self.consumer, committed_shards(self.out, self.spool, self.manifests))
        if done_before:
            log(f"{self.spool.path}: finished {done_before} commit(s) an interrupted run left")
        while stop["signal"] is None and not self.finished():
            committed = self.committed()
            claims, ids = self.claim_batch(committed, stop)
            if stop["signal"] == "end_of_stream" and claims:  # the stream's last records: a smaller batch
                self.train(claims, ids, committed)
            if stop["signal"] is not None:
                break
            self.train(claims, ids, committed)
        if self.pending:  # a clean stop: the updates since the last version are published, not lost
            self.publish()

    def summary(self, stopped_by: str | None) -> dict[str, Any]:
        config = self.config
        ran_out = "max_steps" if config.max_steps is not None and self.steps >= config.max_steps else "max_versions"
        return {"out": str(self.out), "spool": str(self.spool.path), "consumer": self.consumer, "versions": self.versions,
                "policy_version": self.versions[-1] if self.versions else None, "updates": self.steps,
                "dropped_records": self.dropped, "stale_dropped": self.stale_dropped, "stopped_by": stopped_by or ran_out,
                "idle_fraction": self.idle_fraction()}


def follow_spool(config: FollowConfig, *, out: Path, tokenizer_revision: str, trainer: FollowTrainer) -> dict[str, Any]:
    """Run the follow loop (module doc); returns the run's summary."""
    loop = _FollowLoop(config, out=out, tokenizer_revision=tokenizer_revision, trainer=trainer)
    with output_lock(loop.spool.claimed_dir / loop.consumer, stage="trainer"), stop_on_signals() as stop, \
            lease_kept(loop.spool, loop.consumer, config.source.lease_s), MetricsWriter(out / "metrics.jsonl") as loop.metrics:
        try:
            loop.run(stop)
        finally:
            released = loop.spool.release(loop.consumer)  # claims not published: back to ready/ for anyone
            if released:
                log(f"{loop.spool.path}: returned {released} unpublished claim(s) to ready/")
    return loop.summary(stop["signal"])


def follow_line(summary: dict[str, Any]) -> str:
    """The human line of a trainer's follow run."""
    return (f"{summary['out']}: {len(summary['versions'])} version(s) from {summary['updates']} update(s) on {summary['spool']} "
            f"(now v{summary['policy_version']}), {summary['dropped_records']} records dropped "
            f"({summary['stale_dropped']} stale), stopped by {summary['stopped_by']}")


class _RunFollower:
    """A :class:`FollowTrainer` over a :class:`~glmpost.rl.run.TrainingRun` kept open:
    ``make_batch(inputs, parent_version, skip_ids)`` makes an update's :class:`~glmpost.rl.updates.UpdateBatch`."""

    def __init__(self, run: TrainingRun, make_batch, *, revision: str, stage_options: dict[str, Any]):
        self.run, self.make_batch, self.revision, self.stage_options = run, make_batch, revision, stage_options
        self.batches: list[dict] = []  # the stage.json facts of each update since the last version

    def train(self, shards: list[Path], skip_ids: frozenset) -> dict[str, Any]:
        batch = self.make_batch([str(s) for s in shards], self.run.parent_version, skip_ids)
        mini = too_few_examples(self.run.job, batch.examples)
        if mini is not None:  # the stream's last few records: too few for the optimizer steps
            raise NothingToTrain(f"{len(batch.examples)} example(s), fewer than mini_batches {mini}")
        steps = self.run.update(batch.update())
        self.batches.append(batch.stage_extra)
        return {"records": batch.records, "trained_records": trained_records(batch.examples), "version_lags": batch.summary["version_lags"],
                "metrics": {**batch.step_metrics, **(steps[-1] if steps else {})}}

    def publish(self, manifest_extra: dict[str, Any]) -> int:
        result = self.run.publish(tokenizer_revision=self.revision, stage_options=self.stage_options,
                                  manifest_extra=manifest_extra,
                                  stage_extra={"version_lags": manifest_extra.get("version_lags", {}), "batches": self.batches})
        self.batches = []
        return result.version


def _follow_run(checkpoint: Path, out: Path, options: RunOptions, *, stage: str) -> TrainingRun:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("{follow} trains in one process for now: every rank would claim its own shards; "
                          "run it without torchrun / deepspeed")
    return TrainingRun(checkpoint, out, options, stage=stage, follow=True)


def _training_follow(follow: FollowConfig, run: TrainingRun, job: TrainingJob, *, make_batch, revision: str,
                     stage_options: dict[str, Any]) -> dict[str, Any]:
    """:func:`follow_spool` with ``run`` kept open (``job`` its trainer, ``make_batch`` each update's
    examples); closes it."""
    with run:
        run.open(job)
        return follow_spool(follow, out=run.out, tokenizer_revision=revision,
                            trainer=_RunFollower(run, make_batch, revision=revision, stage_options=stage_options))


def grpo_follow(follow: FollowConfig, *, checkpoint: Path, out: Path, options: RunOptions, config, temperature: float | None,
                ref_checkpoint: Path | None, stage_options: dict[str, Any]) -> dict[str, Any]:
    """``train-grpo --follow``: a :func:`~glmpost.rl.updates.grpo_batch` update per batch; the KL
    reference (``kl_coef`` > 0) is ``ref_checkpoint``, else the version the run started from."""

    run = _follow_run(checkpoint, out, options, stage="train-grpo")
    tokenizer, revision = load_tokenizer(checkpoint)
    reference_dir = resolve_checkpoint(ref_checkpoint or checkpoint)
    build = grpo_trainer(config, pad_token_id=tokenizer.pad_token_id,
                         reference=lambda session: run.load(reference_dir, session, trained=False))
    return _training_follow(follow, run, TrainingJob("train-grpo", config, build), revision=revision,
                            stage_options=stage_options,
                            make_batch=lambda inputs, parent_version, skip: grpo_batch(
                                inputs, config, parent_version=parent_version, revision=revision, temperature=temperature,
                                skip_ids=skip))


def opd_follow(follow: FollowConfig, *, checkpoint: Path, out: Path, options: RunOptions, config,
               stage_options: dict[str, Any]) -> dict[str, Any]:
    """``opd-merge --follow``: a :func:`~glmpost.rl.updates.opd_batch` update per batch (group size
    1: an update per ``follow_records`` scored trajectories)."""

    run = _follow_run(checkpoint, out, options, stage="opd-merge")
    tokenizer, revision = load_tokenizer(checkpoint)
    job = TrainingJob("opd-merge", config, opd_trainer(config, pad_token_id=tokenizer.pad_token_id))
    return _training_follow(follow, run, job, revision=revision, stage_options=stage_options,
                            make_batch=lambda inputs, parent_version, skip: opd_batch(
                                inputs, config, parent_version=parent_version, revision=revision, skip_ids=skip))


def sao_follow(follow: FollowConfig, *, checkpoint: Path, out: Path, critic_root: Path, init_critic: bool,
               options: RunOptions, config, stage_options: dict[str, Any]) -> dict[str, Any]:
    """``train-sao --follow``: a :func:`~glmpost.rl.updates.sao_batch` update per batch (group size 1),
    the critic kept in memory beside the policy and published with each version under ``critic_root``."""

    CriticVersions.finish_interrupted(critic_root, out)
    run = _follow_run(checkpoint, out, options, stage="train-sao")
    tokenizer, revision = load_tokenizer(run.parent)
    critic = CriticVersions(critic_root, policy=run.parent, version=run.plan.version, groups=config.critic_groups(),
                            optimizer=config.critic_optimizer(), init=init_critic, seed=config.seed)
    job = TrainingJob("train-sao", config, sao_trainer(config, critic, pad_token_id=tokenizer.pad_token_id, options=options),
                      companion=critic)
    return _training_follow(follow, run, job, revision=revision, stage_options=stage_options,
                            make_batch=lambda inputs, parent_version, skip: sao_batch(
                                inputs, config, parent_version=parent_version, revision=revision, skip_ids=skip))
