"""A trainer in follow mode: consume a spool as trajectories land, publish a version per batch of
them, commit each batch exactly once (brief, the asynchronous loop: "允许系统异步前进，同时只让仍然
可信的 token 产生梯度"; formats/SPEC.md §12).

Each round: finish any commit a crash interrupted (:meth:`~glmpost.formats.spool.Spool.reconcile`
from the published manifests, also for a shard claimed again after its lease was reaped), keep this
trainer's claims and claim ready shards, oldest first,
until they hold ``follow_records`` records; train one update from the output root's ``LATEST`` (the
initial ``--checkpoint`` before the first), leaving out every record the ledger says was trained;
the published version's manifest lists the shards and ids (the commit record); then ledger them and
move them to ``done/``. Staleness and DIS are the update's own (``--max-staleness``,
``--max-version-lag``, ``--trust-mask``). A batch with nothing left to train (all stale, all
trained before) is committed as dropped (version -1) so it is not retried forever.

A background thread renews the lease; SIGTERM / SIGINT stop after the update in progress and
return unused claims to ``ready/``. ``--max-versions`` and ``--idle-timeout`` stop it too.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from glmpost.config import setting
from glmpost.formats import ShardReader
from glmpost.formats.spool import DEFAULT_LEASE_S, Spool, lease_kept
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
    max_versions: Optional[int] = setting(None, "Stop after publishing this many versions (default: run until stopped).", min=1)
    idle_timeout: Optional[float] = setting(None, "Stop after this many seconds without a new shard (default: wait for ever).", min=0.0)


def default_consumer(out: Path) -> str:
    return "trainer-" + hashlib.blake2b(str(Path(out).resolve()).encode(), digest_size=5).hexdigest()


def committed_shards(root: Path, spool: Spool) -> dict[str, tuple[int, list[str]]]:
    """``{shard name: (version, ids)}`` of every version under ``root`` whose manifest commits
    shards of ``spool`` (its ``extra.spool``)."""
    from glmpost.checkpoints import CheckpointError, CheckpointRoot, read_manifest

    found: dict[str, tuple[int, list[str]]] = {}
    checkpoints = CheckpointRoot(root)
    for version in checkpoints.versions():
        try:
            extra = read_manifest(checkpoints.version_dir(version)).extra.get("spool") or {}
        except CheckpointError:
            continue
        if Path(extra.get("path", "")).resolve() == spool.path.resolve():
            for name, ids in extra.get("shards", {}).items():
                found[name] = (version, list(ids))
    return found


def _shard_ids(paths: list[Path]) -> dict[str, list[str]]:
    return {path.name: [record["id"] for record in ShardReader(path)] for path in paths}


Update = Callable[[Path, list[Path], frozenset, dict], Optional[dict]]


def follow_spool(config: FollowConfig, *, out: Path, checkpoint: Path, tokenizer_revision: str, update: Update) -> dict[str, Any]:
    """Run the follow loop (module doc). ``update(parent, shards, skip_ids, manifest_extra)``
    trains and publishes one version and returns its summary (``policy_version``); it raises
    :class:`~glmpost.rl.updates.NothingToTrain` when every record was excluded. Returns the run's summary."""
    from glmpost.checkpoints import LATEST
    from glmpost.rl.updates import NothingToTrain

    spool = Spool(config.follow, tokenizer_revision=tokenizer_revision)
    spool.bind_consumer_root(out)
    consumer = config.consumer or default_consumer(out)
    out.mkdir(parents=True, exist_ok=True)
    started, waited, last_new = time.monotonic(), 0.0, time.monotonic()
    versions, dropped = [], 0
    with stop_on_signals() as stop, lease_kept(spool, consumer, config.lease_s), MetricsWriter(out / "metrics.jsonl") as metrics:
        try:
            finished = spool.reconcile(consumer, committed_shards(out, spool))
            if finished:
                log(f"{spool.path}: finished {finished} commit(s) an interrupted run left")
            while stop["signal"] is None and (config.max_versions is None or len(versions) < config.max_versions):
                # A shard a published version already trained (its commit interrupted, then its
                # claim reaped and claimed again) is committed, not trained again.
                committed = committed_shards(out, spool)
                spool.reconcile(consumer, committed)
                claims = spool.claimed(consumer)
                ids = _shard_ids(claims)
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
                parent = out if (out / LATEST).is_file() else checkpoint
                extra = {"spool": {"path": str(spool.path.resolve()), "consumer": consumer, "shards": ids}}
                trained = spool.consumed_ids() | {i for _, shard_ids in committed.values() for i in shard_ids}
                try:
                    summary = update(parent, claims, frozenset(trained), extra)
                except NothingToTrain as exc:
                    log(f"{spool.path}: {len(claims)} shard(s) dropped: {exc}")
                    spool.commit(consumer, claims, version=-1, ids=ids)
                    dropped += sum(map(len, ids.values()))
                    continue
                version = summary["policy_version"]
                spool.commit(consumer, claims, version=version, ids=ids)
                versions.append(version)
                depth = spool.depth()
                metrics.write(**{"follow/policy_version": version,
                                 **{f"follow/version_lag/{lag}": n for lag, n in sorted(summary.get("version_lags", {}).items())},
                                 "follow/records": summary.get("records"), "follow/trained_records": summary.get("trained_records"),
                                 "follow/shards": len(claims), "follow/queue_ready": depth.ready,
                                 "follow/queue_claimed": depth.claimed, "follow/dropped_records": dropped,
                                 "follow/idle_fraction": round(waited / max(time.monotonic() - started, 1e-9), 4)})
                log(f"{spool.path}: v{version} from {len(claims)} shard(s), {summary.get('trained_records')} records trained; "
                    f"queue {depth.ready} ready")
        finally:
            released = spool.release(consumer)  # claims not trained: back to ready/ for anyone
            if released:
                log(f"{spool.path}: returned {released} unused claim(s) to ready/")
    return {"out": str(out), "spool": str(spool.path), "consumer": consumer, "versions": versions,
            "policy_version": versions[-1] if versions else None, "dropped_records": dropped,
            "stopped_by": stop["signal"] or "max_versions",
            "idle_fraction": round(waited / max(time.monotonic() - started, 1e-9), 4)}

def follow_line(summary: dict[str, Any]) -> str:
    """The human line of a trainer's follow run."""
    return (f"{summary['out']}: {len(summary['versions'])} version(s) from {summary['spool']} (now v{summary['policy_version']}), "
            f"{summary['dropped_records']} records dropped, stopped by {summary['stopped_by']}")


def _training_follow(follow: FollowConfig, *, checkpoint: Path, out: Path, options, train) -> dict[str, Any]:
    """:func:`follow_spool` with ``train(run, inputs, skip_ids, manifest_extra)`` publishing each
    version (an interrupted update resumes from its saved state, or starts over)."""
    import dataclasses
    import os

    from glmpost.checkpoints import load_tokenizer
    from glmpost.errors import UsageError
    from glmpost.rl.run import TrainingRun

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--follow trains in one process for now: every rank would claim its own shards; "
                         "run it without torchrun / deepspeed")
    options = dataclasses.replace(options, resume=True)
    _, revision = load_tokenizer(checkpoint)

    def update(parent: Path, shards: list[Path], skip_ids: frozenset, extra: dict) -> dict | None:
        return train(TrainingRun(parent, out, options), [str(s) for s in shards], skip_ids, extra)

    return follow_spool(follow, out=Path(out), checkpoint=Path(checkpoint), tokenizer_revision=revision, update=update)


def grpo_follow(follow: FollowConfig, *, checkpoint: Path, out: Path, options, config, temperature: float | None,
                ref_checkpoint: Path | None, stage_options: dict[str, Any]) -> dict[str, Any]:
    """``train-grpo --follow``: one :func:`~glmpost.rl.updates.grpo_update` per version."""
    import copy

    from glmpost.rl.updates import grpo_update

    return _training_follow(follow, checkpoint=checkpoint, out=out, options=options, train=lambda run, inputs, skip, extra: grpo_update(
        run, inputs, copy.deepcopy(config), temperature=temperature, ref_checkpoint=ref_checkpoint, stage_options=stage_options,
        skip_ids=skip, manifest_extra=extra))


def opd_follow(follow: FollowConfig, *, checkpoint: Path, out: Path, options, config,
               stage_options: dict[str, Any]) -> dict[str, Any]:
    """``opd-merge --follow``: one :func:`~glmpost.rl.updates.opd_update` per version (group size 1:
    a version per ``follow_records`` scored trajectories)."""
    import copy

    from glmpost.rl.updates import opd_update

    return _training_follow(follow, checkpoint=checkpoint, out=out, options=options, train=lambda run, inputs, skip, extra: opd_update(
        run, inputs, copy.deepcopy(config), stage_options=stage_options, skip_ids=skip, manifest_extra=extra))
