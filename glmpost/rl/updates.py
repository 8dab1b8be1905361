"""The policy-gradient stages' updates: GRPO (train-grpo), OPD / MOPD (opd-merge) and SAO (train-sao).

Per stage: ``*_batch`` admits the records (:func:`~glmpost.rl.admission.admit`) and builds the
examples, metrics and stage.json facts of one update (:class:`UpdateBatch`, with the distribution
the records were sampled from); ``*_trainer`` builds the stage's trainer; ``*_update`` is the run
once, a :class:`~glmpost.rl.run_once.RunOnce` from a parent checkpoint to its next version, which
returns the facts its command reports (a dict, the same keys as ``--json`` prints). Following a
spool, the same batches and trainers serve :mod:`glmpost.rl.follow_session`. QAT's run is
:mod:`glmpost.rl.qat_update`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from glmpost.config import ConfigError
from glmpost.errors import GlmpostError
from glmpost.kernel.distribution import ScoredDistribution
from glmpost.kernel.loading import load_tokenizer
from glmpost.rl.admission import NothingToTrain, admit
from glmpost.rl.batches import (
    failure_counts,
    prepare_batch,
    prepare_opd_batch,
    segment_accounting,
    train_examples,
    trained_records,
    usable_records,
)
from glmpost.rl.configs import GRPOConfig, OPDConfig
from glmpost.rl.critic import CriticVersions
from glmpost.rl.jobs import RunResult, TrainingJob, Update
from glmpost.rl.precision import checkpoint_layers
from glmpost.rl.routing_replay import prepare_replay
from glmpost.rl.run import RunOptions
from glmpost.rl.run_once import RunOnce
from glmpost.rl.sao import CriticTrainer, SAOConfig, SAOTrainer
from glmpost.rl.trainer import PolicyTrainer
from glmpost.stage import log


@dataclass
class UpdateBatch:
    """What one update trains, made from its records: the examples, and what its step metrics,
    manifest, stage.json and summary record."""

    records: int  # records left after the ledger and the staleness filter
    examples: list
    excluded: dict[str, int]
    step_metrics: dict[str, Any]
    stage_extra: dict[str, Any]
    summary: dict[str, Any]
    distribution: ScoredDistribution  # what the records' rollout log-probs are of: the trainer's log-probs' too
    lines: list[dict[str, Any]] = field(default_factory=list)  # metric lines after the steps' (each compacted segment)

    def update(self, *, manifest_extra: dict[str, Any] | None = None, stage_extra: dict[str, Any] | None = None) -> Update:
        """The run's :class:`~glmpost.rl.jobs.Update`: :attr:`lines` written after the steps' metrics;
        ``stage_extra`` (default :attr:`stage_extra`) in stage.json."""
        finish = (lambda trainer: list(self.lines)) if self.lines else None
        return Update(self.examples, self.step_metrics, finish=finish, manifest_extra=dict(manifest_extra or {}),
                      stage_extra=self.stage_extra if stage_extra is None else stage_extra, distribution=self.distribution)


def _published(result: RunResult, records: int, trained: int, excluded: dict) -> dict[str, Any]:
    last = result.history[-1] if result.history else {}
    return {
        "out": str(result.target), "policy_version": result.version, "parent": str(result.parent), "records": records,
        "trained_records": trained, "excluded": excluded, "steps": result.steps, "world_size": result.world_size,
        "loss": last.get("train/loss"), "trusted_fraction": last.get("train/trusted_fraction"),
    }


def _group_metrics(batch) -> dict[str, int]:
    """Trained groups by their number of valid samples, and untrained records by status or reason."""
    return {"train/excluded_small_group": batch.excluded.get("small_group", 0),
            **{f"train/effective_group_size/{n}": count for n, count in batch.group_sizes.items()},
            **{f"train/failed/{reason}": count for reason, count in batch.failed.items()}}


def grpo_batch(inputs: Sequence[str], config: GRPOConfig, *, parent_version: int, revision: str, temperature: float | None,
               skip_ids: frozenset[str] = frozenset()) -> UpdateBatch:
    """The examples of one GRPO + IcePop update on judged shards, from a parent at ``parent_version``
    (``temperature`` None: the records' own; ``skip_ids``: records trained before, left out and
    counted)."""
    stage = "train-grpo"
    admitted = admit(inputs, config, stage=stage, parent_version=parent_version, revision=revision,
                     require=["rollout_log_probs", "sampling", "reward"], skip_ids=skip_ids, temperature=temperature)
    records, lags, stale = admitted.records, admitted.lags, admitted.stale
    batch = prepare_batch(records, advantage_eps=config.advantage_eps, advantage_scaling=config.advantage_scaling)
    if not batch.examples:
        raise NothingToTrain(f"{stage}: no usable records (excluded: {batch.excluded})", stale)
    prepare_replay(config, records, batch.examples, stage)
    segments, segment_lines = segment_accounting(batch.examples, config.segment_decay_base())
    return UpdateBatch(
        len(records), batch.examples, batch.excluded,
        step_metrics={
            "train/reward_mean": float(batch.rewards.mean()), "train/reward_std": float(batch.rewards.std()),
            "train/zero_advantage_groups": batch.zero_advantage_groups, "train/groups": batch.groups,
            "train/excluded_nan_reward": batch.excluded["nan_reward"], "train/excluded_status": batch.excluded["status"],
            "train/policy_version": parent_version + 1, **admitted.metrics, **_group_metrics(batch), **segments,
        },
        stage_extra={"excluded": batch.excluded, "zero_advantage_groups": batch.zero_advantage_groups, "version_lags": lags,
                     "log_prob_distribution": admitted.scored, "stale_dropped": admitted.stale_dropped,
                     "group_sizes": {str(k): v for k, v in batch.group_sizes.items()}, "failed": batch.failed},
        summary={"zero_advantage_groups": batch.zero_advantage_groups, "reward_mean": float(batch.rewards.mean()),
                 "version_lags": lags, "compactions": segments.get("compaction/compactions", 0)},
        distribution=admitted.distribution, lines=segment_lines,
    )
def grpo_trainer(config: GRPOConfig, *, pad_token_id: int, reference: Callable[[Any], Any] | None):
    """``build(model, backend, session)`` of the GRPO trainer; ``reference(session)`` loads the KL
    reference model (called when ``kl_coef`` > 0)."""
    def build(model, backend, session):
        ref = reference(session) if config.kl_coef > 0 and reference is not None else None
        return PolicyTrainer(model, config, pad_token_id=pad_token_id, backend=backend, reference=ref)

    return build


def grpo_update(run: RunOnce, inputs: Sequence[str], config: GRPOConfig, *, temperature: float | None,
                ref_checkpoint: Path | None, stage_options: dict[str, Any], skip_ids: frozenset[str] = frozenset(),
                manifest_extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """One GRPO + IcePop update on judged shards (:func:`grpo_batch`), published as the next version;
    ``manifest_extra`` goes into its manifest."""
    if run.already_done(stage_options):
        return run.skipped()
    run.check_staging()
    tokenizer, revision = load_tokenizer(run.parent)
    batch = grpo_batch(inputs, config, parent_version=run.plan.parent_version, revision=revision, temperature=temperature,
                       skip_ids=skip_ids)
    build = grpo_trainer(config, pad_token_id=tokenizer.pad_token_id,
                         reference=lambda session: run.load(ref_checkpoint or run.parent, session, trained=False))
    update = batch.update(manifest_extra={"records": batch.records, "trained_records": trained_records(batch.examples),
                                          **(manifest_extra or {})})
    result = run.run(TrainingJob("train-grpo", config, build), update, tokenizer_revision=revision, stage_options=stage_options)
    if result is None:
        return None
    return {**_published(result, batch.records, trained_records(batch.examples), batch.excluded), **batch.summary}


def opd_batch(inputs: Sequence[str], config: OPDConfig, *, parent_version: int, revision: str,
              skip_ids: frozenset[str] = frozenset()) -> UpdateBatch:
    """The examples of one OPD / MOPD update on teacher-scored shards (the temperature is the
    records'); ``skip_ids`` as :func:`grpo_batch`'s."""
    stage = "opd-merge"

    def has_topk(record: dict, where: str) -> None:
        if config.loss == "topk" and "teacher_topk_ids" not in record:
            raise GlmpostError(f"{where}: record {record['id']!r} has no teacher_topk_ids: "
                               "run `glmpost score-teacher --payload topk` for --loss topk")

    need = ["rollout_log_probs", "sampling", "teacher_log_probs", "teacher"] + (["reward"] if config.task_advantage_weight > 0 else [])
    admitted = admit(inputs, config, stage=stage, parent_version=parent_version, revision=revision, require=need,
                     check=has_topk, skip_ids=skip_ids)
    records, lags, student = admitted.records, admitted.lags, admitted.distribution
    if student != ScoredDistribution():
        log(f"warning: the rollouts' log-probs are of the student's distribution at temperature {student.temperature}, "
            f"top-k {student.top_k or 'off'}, top-p {student.top_p}; the teacher scored its own at 1, so the OPD advantage "
            "compares the teacher's distribution with that one")
    batch = prepare_opd_batch(records, loss=config.loss, task_advantage_weight=config.task_advantage_weight,
                              advantage_eps=config.advantage_eps)
    if not batch.examples:
        raise NothingToTrain(f"{stage}: no usable records (excluded: {batch.excluded})", admitted.stale)
    prepare_replay(config, records, batch.examples, stage)
    if config.task_advantage_weight > 0 and batch.zero_advantage_groups == batch.groups:
        log("warning: every group has one member or equal rewards, so the task advantage is 0; sample groups of G > 1 for it")
    domains: dict[str, dict[str, int]] = {}
    for example in batch.examples:
        counts = domains.setdefault(example.domain or "none", {})
        counts[example.teacher] = counts.get(example.teacher, 0) + 1
    step_metrics = {
        "train/records": trained_records(batch.examples), "train/excluded_status": batch.excluded["status"],
        "train/excluded_nan_reward": batch.excluded["nan_reward"], "train/policy_version": parent_version + 1,
        **{f"train/records/{d}": sum(c.values()) for d, c in domains.items()}, **admitted.metrics,
    }
    if batch.rewards.size:
        step_metrics["train/reward_mean"] = float(batch.rewards.mean())
    return UpdateBatch(len(records), batch.examples, batch.excluded, step_metrics=step_metrics,
                       stage_extra={"excluded": batch.excluded, "teachers": domains, "version_lags": lags,
                                    "log_prob_distribution": admitted.scored},
                       summary={"loss_kind": config.loss, "teachers": domains, "version_lags": lags}, distribution=student)
def opd_trainer(config: OPDConfig, *, pad_token_id: int):
    """``build(model, backend, session)`` of the OPD trainer."""
    return lambda model, backend, session: PolicyTrainer(model, config, pad_token_id=pad_token_id, backend=backend)


def opd_update(run: RunOnce, inputs: Sequence[str], config: OPDConfig, *, stage_options: dict[str, Any],
               skip_ids: frozenset[str] = frozenset(), manifest_extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """One OPD / MOPD update on teacher-scored shards (:func:`opd_batch`), published as the next version."""
    if run.already_done(stage_options):
        return run.skipped()
    run.check_staging()
    tokenizer, revision = load_tokenizer(run.parent)
    batch = opd_batch(inputs, config, parent_version=run.plan.parent_version, revision=revision, skip_ids=skip_ids)
    job = TrainingJob("opd-merge", config, opd_trainer(config, pad_token_id=tokenizer.pad_token_id))
    update = batch.update(manifest_extra={"records": batch.records, "trained_records": trained_records(batch.examples),
                                          "teachers": batch.summary["teachers"], **(manifest_extra or {})})
    result = run.run(job, update, tokenizer_revision=revision, stage_options=stage_options)
    if result is None:
        return None
    first = result.history[0] if result.history else {}
    teacher_kl = {key.split("/", 1)[1]: value for key, value in first.items() if key.startswith("teacher_kl/")}
    return {**_published(result, batch.records, trained_records(batch.examples), batch.excluded), **batch.summary, "teacher_kl": teacher_kl}


def sao_batch(inputs: Sequence[str], config: SAOConfig, *, parent_version: int, revision: str,
              skip_ids: frozenset[str] = frozenset()) -> UpdateBatch:
    """The examples of one SAO update on judged shards (group size 1: each trajectory as it is, its
    reward for the critic's GAE); ``skip_ids`` as :func:`grpo_batch`'s."""
    stage = "train-sao"
    admitted = admit(inputs, config, stage=stage, parent_version=parent_version, revision=revision,
                     require=["rollout_log_probs", "sampling", "reward"], skip_ids=skip_ids, dis="dis" in config.trust_masks())
    records, lags = admitted.records, admitted.lags
    usable, excluded = usable_records(records, need_reward=True)
    if not usable:
        raise NothingToTrain(f"{stage}: no usable records (excluded: {excluded})", admitted.stale)
    examples = [e for r in usable for e in train_examples(r, 0.0, reward=float(r["reward"]), domain=r.get("domain", ""))]
    prepare_replay(config, usable, examples, stage)
    rewards = np.array([float(r["reward"]) for r in usable])
    failed = failure_counts(records)
    segments, segment_lines = segment_accounting(examples, config.segment_decay_base())
    return UpdateBatch(
        len(records), examples, excluded,
        step_metrics={"train/reward_mean": float(rewards.mean()), "train/reward_std": float(rewards.std()),
                      "train/records": len(usable), "train/excluded_nan_reward": excluded["nan_reward"],
                      "train/excluded_status": excluded["status"], "train/policy_version": parent_version + 1,
                      **admitted.metrics, **{f"train/failed/{reason}": count for reason, count in failed.items()}, **segments},
        stage_extra={"excluded": excluded, "version_lags": lags, "log_prob_distribution": admitted.scored, "failed": failed,
                     "stale_dropped": admitted.stale_dropped},
        summary={"reward_mean": float(rewards.mean()), "version_lags": lags,
                 "compactions": segments.get("compaction/compactions", 0)},
        distribution=admitted.distribution, lines=segment_lines,
    )
def sao_trainer(config: SAOConfig, critic: CriticVersions, *, pad_token_id: int, options: RunOptions):
    """``build(model, backend, session)`` of the SAO trainer: the policy's, and the critic set up
    from ``critic``'s parent on the same session."""
    def build(model, backend, session):
        critic_model, critic_backend = critic.setup(session, dtype="float32", deterministic_topk=options.deterministic_topk,
                                                    attention=options.attention)  # float32 masters, as the policy's
        if options.activation_checkpointing:
            checkpoint_layers(critic_model.language_model)
        actor = PolicyTrainer(model, config, pad_token_id=pad_token_id, backend=backend)
        return SAOTrainer(actor, CriticTrainer(critic_model, critic_backend, config, pad_token_id=pad_token_id))

    return build


def sao_update(run: RunOnce, inputs: Sequence[str], config: SAOConfig, *, critic_root: Path, init_critic: bool,
               stage_options: dict[str, Any]) -> dict[str, Any] | None:
    """One SAO update on judged shards (:func:`sao_batch`): the policy's next version under the run's
    root and the critic's under ``critic_root`` (:class:`~glmpost.rl.critic.CriticVersions`)."""
    finished = CriticVersions.finish_interrupted(critic_root, run.plan.root.path)
    if finished:
        log(f"{critic_root}: published critic v{finished[-1]}, which an interrupted run had left staged")
    if run.plan.target.exists() and run.options.overwrite:
        raise ConfigError("{overwrite} cannot train {target} again: its critic's version was trained with it; publish "
                          "into another {out} (and {critic})", target=run.plan.target)
    if run.already_done(stage_options):
        return {**run.skipped(), "critic": str(critic_root)}
    run.check_staging()
    tokenizer, revision = load_tokenizer(run.parent)
    batch = sao_batch(inputs, config, parent_version=run.plan.parent_version, revision=revision)
    critic = CriticVersions(critic_root, policy=run.parent, version=run.plan.version, groups=config.critic_groups(),
                            optimizer=config.critic_optimizer(), init=init_critic, seed=config.seed)
    build = sao_trainer(config, critic, pad_token_id=tokenizer.pad_token_id, options=run.options)
    update = batch.update(manifest_extra={"records": batch.records, "trained_records": trained_records(batch.examples),
                                          "critic": str(critic.root.version_dir(critic.version))},
                          stage_extra={**batch.stage_extra, "critic_parent": str(critic.parent)})
    result = run.run(TrainingJob("train-sao", config, build, companion=critic), update, tokenizer_revision=revision,
                     stage_options=stage_options)
    if result is None:
        return None
    last = result.history[-1] if result.history else {}
    return {**_published(result, batch.records, trained_records(batch.examples), batch.excluded), **batch.summary,
            "critic": str(critic.parent), "value_loss": last.get("sao/value_loss"),
            "explained_variance": last.get("sao/explained_variance"),
            "critic_steps": config.critic_steps, "critic_optimizer_steps": last.get("sao/critic_optimizer_steps"),
            "actor_optimizer_steps": last.get("sao/actor_optimizer_steps")}
