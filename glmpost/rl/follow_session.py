"""A training run kept open by a follow trainer (``train-grpo``, ``opd-merge``, ``train-sao`` with
``--follow``): :class:`FollowSession`, the :class:`~glmpost.rl.run.TrainingCore` the spool loop
(:func:`~glmpost.rl.follow.follow_spool`) drives, and each stage's follow run.

``with FollowSession(checkpoint, out, options, stage=..., stage_options=...) as session`` holds the
output root (:func:`~glmpost.rl.run.hold_root`) and continues its newest version (``checkpoint``
before the first). :meth:`FollowSession.open` loads it once; then each batch of claimed shards is
one update (:meth:`FollowSession.train`, its records admitted by the stage's batch), and every
publish makes the updates since the last version the next one and plans the version after it
(AdamW from zero again with ``reset_optimizer``). A crash loses the updates since the last version,
never a published one: so ``save_every``, ``resume`` and ``overwrite`` do not apply here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any, Callable

from glmpost.checkpoints import CheckpointRoot, NextVersion, resolve_checkpoint
from glmpost.config import ConfigError
from glmpost.kernel.loading import load_tokenizer
from glmpost.rl.admission import NothingToTrain
from glmpost.rl.batches import trained_records
from glmpost.rl.critic import CriticVersions
from glmpost.rl.distributed import TrainingSession, uses_deepspeed
from glmpost.rl.follow import FollowConfig, follow_spool
from glmpost.rl.jobs import TrainingJob, too_few_examples
from glmpost.rl.run import RunOptions, TrainingCore, check_run_options, hold_root
from glmpost.rl.updates import UpdateBatch, grpo_batch, grpo_trainer, opd_batch, opd_trainer, sao_batch, sao_trainer

# (input shards, the parent's policy version, ids trained before) -> the update's batch.
MakeBatch = Callable[[list[str], int, frozenset], UpdateBatch]


class FollowSession:
    """A :class:`~glmpost.rl.run.TrainingCore` kept open across updates and versions (module doc):
    the :class:`~glmpost.rl.follow.FollowTrainer` a follow loop drives."""

    def __init__(self, checkpoint: Path | str, out: Path | str, options: RunOptions, *, stage: str,
                 stage_options: dict[str, Any]):
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("{follow} trains in one process for now: every rank would claim its own shards; "
                              "run it without torchrun / deepspeed")
        self.checkpoint, self.out, self.options, self.stage = checkpoint, Path(out), options, stage
        check_run_options(self.out, options)
        if options.reset_optimizer and uses_deepspeed(zero_stage=options.zero_stage, deepspeed_config=options.deepspeed_config):
            raise ConfigError("{reset_optimizer} with {follow} resets torch AdamW between versions; not under DeepSpeed")
        self.stage_options = stage_options
        self.core: TrainingCore | None = None
        self.make_batch: MakeBatch | None = None
        self.revision = ""
        self.batches: list[dict] = []  # the stage.json facts of each update since the last version
        self._held = contextlib.ExitStack()

    def __enter__(self) -> "FollowSession":
        with contextlib.ExitStack() as held:
            held.enter_context(hold_root(self.out, self.stage))
            newest = self.out if CheckpointRoot(self.out).versions() else self.checkpoint
            self.core = TrainingCore(NextVersion.plan(newest, self.out), self.options, stage=self.stage)
            self._held = held.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.core is not None:
                self.core.close()
        finally:
            self._held.__exit__(*exc)  # the root's lock sees what ended the run (a full disk: named)

    @property
    def plan(self) -> NextVersion:
        return self.core.plan

    @property
    def parent(self) -> Path:
        return self.core.parent

    def load(self, checkpoint: Path, session: TrainingSession, *, trained: bool = True):
        return self.core.load(checkpoint, session, trained=trained)

    def open(self, job: TrainingJob, make_batch: MakeBatch, *, revision: str) -> None:
        """Load the newest version for ``job``; ``make_batch`` makes each update's batch, of records
        of tokenizer ``revision``."""
        self.make_batch, self.revision = make_batch, revision
        self.core.open(job)

    def train(self, shards: list[Path], skip_ids: frozenset) -> dict[str, Any]:
        """One update on ``shards`` (:meth:`~glmpost.rl.follow.FollowTrainer.train`)."""
        core = self.core
        batch = self.make_batch([str(s) for s in shards], core.parent_version, skip_ids)
        mini = too_few_examples(core.job, batch.examples)
        if mini is not None:  # the stream's last few records: too few for the optimizer steps
            raise NothingToTrain(f"{len(batch.examples)} example(s), fewer than mini_batches {mini}")
        update = batch.update()
        steps = core.update(dataclasses.replace(update, step_metrics={**update.step_metrics, "train/update": core.updates}))
        self.batches.append(batch.stage_extra)
        return {"records": batch.records, "trained_records": trained_records(batch.examples),
                "version_lags": batch.summary["version_lags"], "metrics": {**batch.step_metrics, **(steps[-1] if steps else {})}}

    def publish(self, manifest_extra: dict[str, Any]) -> int:
        """The updates since the last version as the next one, then the version after it planned
        (:meth:`~glmpost.rl.follow.FollowTrainer.publish`); returns the version published."""
        core = self.core
        stage_extra = {"version_lags": manifest_extra.get("version_lags", {}), "batches": self.batches, "updates": core.updates}
        result = core.publish(tokenizer_revision=self.revision, stage_options=self.stage_options,
                              manifest_extra=manifest_extra, stage_extra=stage_extra)
        self.batches = []
        core.advance()
        if self.options.reset_optimizer:
            core.reset_optimizer()
        return result.version


def grpo_follow(follow: FollowConfig, *, checkpoint: Path, out: Path, options: RunOptions, config, temperature: float | None,
                ref_checkpoint: Path | None, stage_options: dict[str, Any]) -> dict[str, Any]:
    """``train-grpo --follow``: a :func:`~glmpost.rl.updates.grpo_batch` update per batch; the KL
    reference (``kl_coef`` > 0) is ``ref_checkpoint``, else the version the run started from."""
    with FollowSession(checkpoint, out, options, stage="train-grpo", stage_options=stage_options) as session:
        tokenizer, revision = load_tokenizer(checkpoint)
        reference_dir = resolve_checkpoint(ref_checkpoint or checkpoint)
        build = grpo_trainer(config, pad_token_id=tokenizer.pad_token_id,
                             reference=lambda s: session.load(reference_dir, s, trained=False))
        session.open(TrainingJob("train-grpo", config, build), revision=revision,
                     make_batch=lambda inputs, parent_version, skip: grpo_batch(
                         inputs, config, parent_version=parent_version, revision=revision, temperature=temperature,
                         skip_ids=skip))
        return follow_spool(follow, out=session.out, tokenizer_revision=revision, trainer=session)


def opd_follow(follow: FollowConfig, *, checkpoint: Path, out: Path, options: RunOptions, config,
               stage_options: dict[str, Any]) -> dict[str, Any]:
    """``opd-merge --follow``: a :func:`~glmpost.rl.updates.opd_batch` update per batch (group size
    1: an update per ``follow_records`` scored trajectories)."""
    with FollowSession(checkpoint, out, options, stage="opd-merge", stage_options=stage_options) as session:
        tokenizer, revision = load_tokenizer(checkpoint)
        session.open(TrainingJob("opd-merge", config, opd_trainer(config, pad_token_id=tokenizer.pad_token_id)),
                     revision=revision, make_batch=lambda inputs, parent_version, skip: opd_batch(
                         inputs, config, parent_version=parent_version, revision=revision, skip_ids=skip))
        return follow_spool(follow, out=session.out, tokenizer_revision=revision, trainer=session)


def sao_follow(follow: FollowConfig, *, checkpoint: Path, out: Path, critic_root: Path, init_critic: bool,
               options: RunOptions, config, stage_options: dict[str, Any]) -> dict[str, Any]:
    """``train-sao --follow``: a :func:`~glmpost.rl.updates.sao_batch` update per batch (group size 1),
    the critic kept in memory beside the policy and published with each version under ``critic_root``."""
    CriticVersions.finish_interrupted(critic_root, out)
    with FollowSession(checkpoint, out, options, stage="train-sao", stage_options=stage_options) as session:
        tokenizer, revision = load_tokenizer(session.parent)
        critic = CriticVersions(critic_root, policy=session.parent, version=session.plan.version, groups=config.critic_groups(),
                                optimizer=config.critic_optimizer(), init=init_critic, seed=config.seed)
        job = TrainingJob("train-sao", config, sao_trainer(config, critic, pad_token_id=tokenizer.pad_token_id, options=options),
                          companion=critic)
        session.open(job, revision=revision, make_batch=lambda inputs, parent_version, skip: sao_batch(
            inputs, config, parent_version=parent_version, revision=revision, skip_ids=skip))
        return follow_spool(follow, out=session.out, tokenizer_revision=revision, trainer=session)
