"""The versioned training run every training stage goes through (train-grpo, opd-merge, qat).

    plan -> set up -> train (save-every / resume) -> publish the next version

* **plan**: the parent checkpoint's policy version ``N`` and the target ``root/v(N+1)``
  (:class:`~glmpost.checkpoints.NextVersion`). A target that exists was trained: the run is skipped.
  Staging left by an interrupted run needs ``resume`` (continue it) or ``overwrite`` (start over).
* **set up**: the training session (device, DeepSpeed ZeRO under a launcher), the parent's weights
  on this rank's device, the stage's trainer (:attr:`TrainingJob.build`), the parent's optimizer
  state when the stage carries it from version to version.
* **train**: the trainer's preparation on the parent's weights, before any resumed weights are
  loaded (old log-probs belong to the policy that sampled), then the optimizer steps from the
  last saved state; every step's metrics go to ``staging/metrics.jsonl`` and, every
  ``save_every`` steps, the resumable state to ``staging/trainer_state/resume.pt``.
* **publish** (rank 0): weights (and optimizer state) into staging, ``stage.json``, the manifest,
  the parent's tokenizer files, the atomic move into place and ``LATEST``; the steps' metrics are
  appended to the root's ``metrics.jsonl`` (the history across versions).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from tqdm import tqdm

from glmpost.checkpoints import CheckpointManifest, NextVersion
from glmpost.config import ConfigError, setting, shared
from glmpost.kernel.loading import load_model
from glmpost.rl.distributed import OptimizerConfig, TrainingSession
from glmpost.stage import log, write_stage_json


@dataclass
class RunOptions:
    """How a training run executes, whatever it optimises (the same for every training stage)."""

    device: str = shared("device")
    deterministic: bool = setting(False, "Deterministic algorithms (torch, cuBLAS, HCCL switches).")
    zero_stage: int | None = setting(
        None, "Train with DeepSpeed ZeRO at this stage (default under a multi-process launcher: 1).", min=0, max=3)
    deepspeed_config: Path | None = setting(
        None, "DeepSpeed JSON config (its optimizer, ZeRO and clipping settings are used).", flag="--deepspeed")
    deterministic_topk: bool = shared("deterministic_topk")
    attention: str = shared("attention")
    save_every: int = setting(0, "Save resumable training state every N optimizer steps (0 = only at the end).", min=0)
    resume: bool = setting(False, "Continue an interrupted run from its saved state without repeating a step.")
    overwrite: bool = setting(False, "Discard an interrupted run's state and start the update over.")
    reset_optimizer: bool = setting(False, "Start AdamW fresh instead of from the parent version's optimizer state (--follow: after "
                                    "every published version too).")


class Trainer(Protocol):
    """What the run drives: ``prepare`` on the parent's weights, then resumable optimizer steps."""

    backend: Any

    def prepare(self, examples: list) -> Any: ...

    def steps(self, prepared: Any) -> int: ...

    def train(self, prepared: Any, *, start_step: int, on_step: Callable[[int, dict], None]) -> Any: ...


class Companion(Protocol):
    """A second model the stage's trainer updates beside the policy (SAO's critic), versioned in a
    root of its own (:class:`~glmpost.rl.critic.CriticVersions`): its resume state is saved with the
    policy's, under ``trainer_state/<name>``; its version is written before the policy's is published
    and moved into its root right after."""

    name: str
    version: int  # the version it publishes next (the policy's)

    def load_optimizer(self) -> None: ...

    def reset_optimizer(self) -> None: ...

    def save_resume_state(self, directory: Path, step: int) -> None: ...

    def load_resume_state(self, directory: Path, step: int) -> None: ...

    def save(self, *, tokenizer_revision: str, stage: str, stage_options: dict[str, Any], world_size: int,
             history: list[dict]) -> None: ...

    def publish(self) -> None: ...


@dataclass
class TrainingJob:
    """What a stage brings to a run: its trainer, its examples and what it records."""

    stage: str
    config: OptimizerConfig
    examples: list
    # (model, optimisation backend, session) -> the trainer.
    build: Callable[[Any, Any, TrainingSession], Trainer]
    # (model) -> None: changes the model before the optimisation backend takes it (fake quant; ZeRO-3
    # partitions the parameters it is given).
    adapt_model: Callable[[Any], None] | None = None
    # RL carries AdamW's state from version to version (trainer_state/optimizer.pt); SFT/QAT do not.
    keep_optimizer_state: bool = True
    step_metrics: dict[str, Any] = field(default_factory=dict)  # added to every step's metrics
    # (trainer) -> metric lines written after the steps' (held-out loss, quantization error); runs
    # after training on every rank and may change the model back before it is saved.
    finish: Callable[[Any], list[dict]] | None = None
    manifest_extra: dict[str, Any] = field(default_factory=dict)
    stage_extra: dict[str, Any] = field(default_factory=dict)  # stage.json fields
    companion: Companion | None = None  # set up by ``build``


@dataclass
class RunResult:
    """A finished run, on rank 0."""

    target: Path
    version: int
    parent: Path
    history: list[dict] = field(default_factory=list)
    world_size: int = 1
    steps: int = 0


class TrainingRun:
    """One update from a parent checkpoint to its next version under ``out`` (see the module doc)."""

    def __init__(self, checkpoint: Path | str, out: Path | str, options: RunOptions):
        self.plan = NextVersion.plan(checkpoint, out)
        self.options = options

    @property
    def parent(self) -> Path:
        return self.plan.parent

    @property
    def done(self) -> bool:
        """The target version exists: this update was trained and published."""
        return self.plan.target.exists()

    def skipped(self) -> dict[str, Any]:
        """The summary of an update whose version was already published."""
        return {"out": str(self.plan.target), "skipped": True, "policy_version": self.plan.version}

    def check_staging(self) -> None:
        staging = self.plan.staging
        if staging.exists() and not (self.options.resume or self.options.overwrite):
            raise ConfigError("an interrupted run left {staging}; pass {resume} to continue it or {overwrite} to start over",
                              staging=staging)

    def start_session(self) -> TrainingSession:
        o = self.options
        return TrainingSession.start(device=o.device, deterministic=o.deterministic, zero_stage=o.zero_stage,
                                     deepspeed_config=o.deepspeed_config)

    def load(self, checkpoint: Path, session: TrainingSession, *, trained: bool = True):
        return load_for_training(checkpoint, session, self.options, trained=trained)

    def run(self, job: TrainingJob, *, tokenizer_revision: str, stage_options: dict[str, Any]) -> RunResult | None:
        """Train ``job`` and publish; the result on rank 0, None on the other ranks."""
        plan, options = self.plan, self.options
        staging, resume_state = plan.staging, plan.staging / "trainer_state" / "resume.pt"
        session = self.start_session()
        model = self.load(self.parent, session)
        if job.adapt_model is not None:
            job.adapt_model(model)
        backend = session.backend(model, job.config)
        trainer = job.build(model, backend, session)
        resuming = options.resume and resume_state.exists()
        companion = job.companion
        companion_state = staging / "trainer_state" / companion.name if companion is not None else None
        if job.keep_optimizer_state and not options.reset_optimizer and not resuming:
            backend.load_optimizer(self.parent / "trainer_state" / "optimizer.pt")
            if companion is not None:
                companion.load_optimizer()
        if session.is_main:
            if staging.exists() and (options.overwrite or not resuming):
                shutil.rmtree(staging)  # --overwrite, or an interruption before the first saved state
            staging.mkdir(parents=True, exist_ok=True)
        session.barrier()
        metrics_path = staging / "metrics.jsonl"
        prepared = trainer.prepare(job.examples)  # on the parent's weights, before any resume
        total = trainer.steps(prepared)
        start_step, history = 0, []
        if resuming:  # weights, optimizer state, step and metrics of the last save
            start_step, history = backend.load_resume_state(resume_state)
            if companion is not None:
                companion.load_resume_state(companion_state, start_step)
            log(f"resuming at optimizer step {start_step} of {total}")
            if session.is_main:  # drop lines of steps that ran after the last saved state
                metrics_path.write_text("".join(json.dumps(m, sort_keys=True) + "\n" for m in history))
        progress = tqdm(total=total, initial=start_step, desc=job.stage, unit="step", leave=False,
                        disable=None if session.is_main else True)

        def on_step(step: int, metrics: dict) -> None:
            metrics.update(job.step_metrics)
            history.append(metrics)
            if session.is_main:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(metrics, sort_keys=True) + "\n")
            progress.update(1)
            if options.save_every and (step + 1) % options.save_every == 0 and step + 1 < total:
                if companion is not None:  # first: the policy's resume state names the step to resume at
                    companion.save_resume_state(companion_state, step + 1)
                backend.save_resume_state(resume_state, step + 1, history)

        with progress:
            trainer.train(prepared, start_step=start_step, on_step=on_step)
        finish_lines = job.finish(trainer) if job.finish is not None else []
        backend.save_model(staging)
        if job.keep_optimizer_state:
            backend.save_optimizer(staging / "trainer_state" / "optimizer.pt")
        if companion is not None:
            companion.save(tokenizer_revision=tokenizer_revision, stage=job.stage, stage_options=stage_options,
                           world_size=session.world_size, history=history)
        if session.is_main:
            if companion is not None:
                shutil.rmtree(companion_state, ignore_errors=True)
            if job.keep_optimizer_state:
                resume_state.unlink(missing_ok=True)
            else:  # resume state is not part of the checkpoint
                shutil.rmtree(staging / "trainer_state", ignore_errors=True)
            if finish_lines:
                with open(metrics_path, "a") as f:
                    f.writelines(json.dumps(line, sort_keys=True) + "\n" for line in finish_lines)
            publish_staged(plan, stage=job.stage, stage_options=stage_options, world_size=session.world_size,
                           stage_extra=job.stage_extra, manifest_extra=job.manifest_extra, steps=total,
                           tokenizer_revision=tokenizer_revision, history=history)
            if companion is not None:
                companion.publish()
        session.barrier()
        session.close()
        if not session.is_main:
            return None
        return RunResult(plan.target, plan.version, self.parent, history, session.world_size, total)


def load_for_training(checkpoint: Path, session: TrainingSession, options: RunOptions, *, trained: bool = True):
    """A model on this rank's device: the one trained holds float32 master weights on a CPU; another
    (a KL reference) keeps the checkpoint's dtype."""
    dtype = "float32" if trained and session.device.type == "cpu" else None
    return load_model(checkpoint, device=session.device, dtype=dtype, deterministic_topk=options.deterministic_topk,
                      attention=options.attention)


def publish_staged(plan: NextVersion, *, stage: str, stage_options: dict[str, Any], world_size: int, stage_extra: dict[str, Any],
                   manifest_extra: dict[str, Any], steps: int, tokenizer_revision: str, history: list[dict]) -> None:
    """Rank 0, the weights in ``plan.staging``: stage.json, the manifest, the move into place and
    ``LATEST``; the steps' metrics appended to the root's ``metrics.jsonl`` (its history across versions)."""
    write_stage_json(plan.staging, stage, stage_options, parent=str(plan.parent), world_size=world_size, **stage_extra)
    plan.publish(CheckpointManifest(policy_version=plan.version, tokenizer_revision=tokenizer_revision, stage=stage, step=steps,
                                    parent=str(plan.parent), extra=manifest_extra))
    with open(plan.root.path / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps(m, sort_keys=True) + "\n" for m in history)
