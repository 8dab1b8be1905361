"""The core of every training run (train-grpo, opd-merge, train-sao, qat): from a parent version,
train updates and publish them as the next version::

    open -> update (one or more) -> publish the next version

Two runs stand on it: :class:`~glmpost.rl.run_once.RunOnce` (one update from ``--checkpoint``,
resumable, skipped when its version exists) and :class:`~glmpost.rl.follow_session.FollowSession`
(kept open by a follow trainer across updates and versions). Each plans the version
(:class:`~glmpost.checkpoints.NextVersion`: the parent's policy version ``N``, the target
``root/v(N+1)``) and holds the output root while it runs (:class:`~glmpost.rl.held_run.HeldRun`: the
root's lock, and a ``LATEST`` a crash left behind moved to the newest version).

* **open**: the training session (device, DeepSpeed ZeRO under a launcher), the parent's weights on
  this rank's device, the parent's optimizer state when the stage carries it from version to version.
* **update**: on the first, the stage's trainer (:attr:`TrainingJob.build`, and the companion's
  optimizer state: SAO's critic); the trainer's preparation on the weights as they are (old log-probs
  belong to the policy that sampled: before any resumed weights are loaded; following, the proximal
  policy), every log-prob under the update's distribution (its records'), then the optimizer steps;
  every step's metrics go to ``staging/metrics.jsonl`` and, when asked, every ``save_every`` steps
  the resumable state to ``staging/trainer_state/resume.pt``.
* **publish** (rank 0 writes): the weights (and optimizer state) into staging, the companion's
  version, the resume state dropped, the update's closing metric lines, then ``stage.json``, the
  manifest, the atomic move into place and ``LATEST``; the steps' metrics are appended to the root's
  ``metrics.jsonl`` (the history across versions). A follow session then continues from it
  (:meth:`TrainingCore.advance`); the updates since the last publish exist only in memory (a crash
  loses them, never a published version).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from glmpost.checkpoints import CheckpointManifest, NextVersion, read_manifest
from glmpost.config import section, setting, shared
from glmpost.errors import GlmpostError, first_line, storage_error
from glmpost.fsutil import file_system_problem
from glmpost.kernel.loading import attention_ran, import_architecture, load_model, partitioned, saved_dtype
from glmpost.kernel.lora_versions import is_lora_version
from glmpost.memory.process import peak_rss_mib, resident_mib, trim_heap
from glmpost.rl.distributed import TrainingSession
from glmpost.rl.jobs import RunResult, TrainingJob, Update
from glmpost.rl.lora_training import LoraOptions, lora_training
from glmpost.rl.precision import MASTERS, checkpoint_layers, load_masters
from glmpost.rl.sharded_save import master_files, source_shard_bytes
from glmpost.stage import log, write_stage_json
from glmpost.trackers import track


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
    activation_checkpointing: bool = setting(False, "Recompute each decoder layer in the backward pass instead of keeping "
                                             "its activations (the same gradients; memory for time).")
    precision: str = setting("auto", "Training arithmetic: bf16 (autocast over float32 master weights and AdamW states; the "
                             "LM head, log-probs and losses in float32), fp32, or auto: bf16 on an accelerator, fp32 on a "
                             "CPU. Versions are published in the parent checkpoint's dtype either way.")
    lora: LoraOptions = section(LoraOptions)  # the policy trained as a LoRA adapter (glmpost.rl.lora_training)


class TrainingCore:
    """A training session from ``plan``'s parent to the versions after it (module doc): the model
    and its trainer, the updates since the last version, and publishing them. ``resuming``: the
    first update continues from the state a run once saved in staging."""

    def __init__(self, plan: NextVersion, options: RunOptions, *, stage: str, resuming: bool = False):
        self.plan, self.options, self.stage, self.resuming = plan, options, stage, resuming
        self.steps_before = published_steps(plan.root.path)  # the x-axis of train/global_step
        self.job: TrainingJob | None = None
        self.session: TrainingSession | None = None
        self.model = self.backend = self.trainer = None
        self.lora = lora_training(options.lora, plan.parent, stage)  # None: every weight trains
        self._clear()

    def _clear(self) -> None:
        """Nothing trained since the last version."""
        self.history: list[dict] = []  # the optimizer steps since the last version
        self.updates = 0  # updates since the last version
        self.steps = 0  # their planned optimizer steps
        self.closing_lines: list[dict] = []  # their ``finish`` lines

    @property
    def parent(self) -> Path:
        return self.plan.parent

    @property
    def parent_version(self) -> int:
        """The newest published version (the one this run started from, or published since)."""
        return self.plan.parent_version

    @property
    def resume_state(self) -> Path:
        return self.plan.staging / "trainer_state" / "resume.pt"

    @property
    def _companion_state(self) -> Path:
        return self.plan.staging / "trainer_state" / self.job.companion.name

    @property
    def _carries_optimizer(self) -> bool:
        return self.job.keep_optimizer_state and not self.options.reset_optimizer and not self.resuming

    def load(self, checkpoint: Path, session: TrainingSession, *, trained: bool = True):
        return load_for_training(checkpoint, session, self.options, trained=trained)

    def open(self, job: TrainingJob) -> None:
        """Start the session, load the parent's weights and restore the optimizer state the parent
        carries (not when resuming: the resume state holds it)."""
        o = self.options
        self.job = job
        self.session = session = TrainingSession.start(device=o.device, deterministic=o.deterministic,
                                                       zero_stage=o.zero_stage, deepspeed_config=o.deepspeed_config,
                                                       precision=o.precision)
        # QAT's fake quant (adapt_model) reads whole weights: its model is loaded whole, as before.
        import_architecture(self.parent)
        with session.partitioned_loading(job.config) if job.adapt_model is None else contextlib.nullcontext():
            before = resident_mib()  # DeepSpeed, transformers' integration and the model's code imported: what the model adds
            model = self.load(self.parent, session) if self.lora is None else self.lora.load_base(session)
        if self.lora is not None:  # the adapter made whole, as in one process (DeepSpeed partitions it later)
            model = self.lora.adapt(model, self.parent, session, deterministic_topk=o.deterministic_topk, attention=o.attention)
        trim_heap()  # what building and filling the model freed
        if partitioned(model) and session.is_main:
            held = sum(getattr(p, "ds_tensor", p).numel() for p in model.parameters())  # a fresh adapter: not yet partitioned
            peak = peak_rss_mib()
            log(f"ZeRO-3: the model was created partitioned over {session.world_size} ranks; rank 0 holds {held:,} of "
                f"{sum(getattr(p, 'ds_numel', p.numel()) for p in model.parameters()):,} parameters"
                + (f" (resident before loading: {before:,.0f} MiB; peak so far: {peak:,.0f} MiB)" if peak is not None else ""))
        # A LoRA version is its float32 adapter (its own masters); the frozen base is the published weights.
        self.dtype = saved_dtype(self.parent) if job.publish_in_parent_dtype and self.lora is None else "float32"
        masters = self.parent / "trainer_state" / MASTERS
        if not self.resuming and self.lora is None and master_files(masters):  # the parent's float32 weights, before it was rounded
            load_masters(model, masters)
        if o.activation_checkpointing:
            checkpoint_layers(model)
        if job.adapt_model is not None:
            job.adapt_model(model)
        self.model, self.backend = model, session.backend(model, job.config, kinds=self.lora and self.lora.backends())
        if self._carries_optimizer:
            self.backend.load_optimizer(self.parent / "trainer_state" / "optimizer.pt")

    def close(self) -> None:
        """End the session (closing twice is harmless)."""
        if self.session is not None:
            self.session.close()

    # One update.

    def update(self, update: Update, *, save_every: int = 0) -> list[dict]:
        """Train one update (module doc); returns its steps' metrics, kept until the next publish.
        ``save_every``: save the resumable state every that many optimizer steps (a run once)."""
        if self.updates == 0:
            self._start_staging()
        if self.trainer is None:
            self._build_trainer()
        prepared = self.trainer.prepare(update.examples, update.distribution)  # the weights as they are now, before any resume
        total = self.trainer.steps(prepared)
        start_step, steps = self._resume(total) if self.resuming else (0, [])
        progress = tqdm(total=total, initial=start_step, desc=self.job.stage, unit="step", leave=False,
                        disable=None if self.session.is_main else True)
        first_step = self.steps_before + len(self.history)

        def on_step(step: int, metrics: dict) -> None:
            metrics.update(update.step_metrics, **{"train/global_step": first_step + step})
            steps.append(metrics)
            self._record_step(metrics)
            progress.update(1)
            if save_every and (step + 1) % save_every == 0 and step + 1 < total:
                self._save_resume_state(step + 1, self.history + steps)

        with progress:
            self.trainer.train(prepared, start_step=start_step, on_step=on_step)
        if update.finish is not None:
            self.closing_lines += update.finish(self.trainer)
        self.history += steps
        self.updates += 1
        self.steps += total
        return steps

    def _start_staging(self) -> None:
        """A version's first update starts its staging afresh, unless it resumes the state saved there
        (what is left is an interruption before the first saved state, ``overwrite``, a lost follow update)."""
        staging = self.plan.staging
        if self.session.is_main:
            if staging.exists() and not self.resuming:
                shutil.rmtree(staging)
            staging.mkdir(parents=True, exist_ok=True)
        self.session.barrier()

    def _build_trainer(self) -> None:
        """The stage's trainer, on the first update; it sets the companion up."""
        self.trainer = self.job.build(self.model, self.backend, self.session)
        if self.job.companion is not None and self._carries_optimizer:
            self.job.companion.load_optimizer()

    def _resume(self, total: int) -> tuple[int, list[dict]]:
        """Weights, optimizer state, step and metrics of the last save; the metric lines of steps that
        ran after it are dropped."""
        start_step, steps = self.backend.load_resume_state(self.resume_state)
        if self.job.companion is not None:
            self.job.companion.load_resume_state(self._companion_state, start_step)
        log(f"resuming at optimizer step {start_step} of {total}")
        if self.session.is_main:
            (self.plan.staging / "metrics.jsonl").write_text("".join(json.dumps(m, sort_keys=True) + "\n" for m in steps))
        self.resuming = False
        return start_step, steps

    def _record_step(self, metrics: dict) -> None:
        if self.session.is_main:
            with open(self.plan.staging / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics, sort_keys=True) + "\n")
            track(metrics)

    def _save_resume_state(self, step: int, history: list[dict]) -> None:
        if self.job.companion is not None:  # first: the policy's resume state names the step to resume at
            self.job.companion.save_resume_state(self._companion_state, step)
        self.backend.save_resume_state(self.resume_state, step, history)

    # Publishing the updates since the last version, in the order a crash leaves safe.

    def publish(self, *, tokenizer_revision: str, stage_options: dict[str, Any], manifest_extra: dict[str, Any],
                stage_extra: dict[str, Any], replace: bool = False) -> RunResult:
        """Publish the updates since the last version as the next one (every rank: ZeRO-3 gathers the
        weights; rank 0 writes); ``replace``: over a published version (``overwrite``)."""
        self._save_weights()
        if self.job.companion is not None:
            self.job.companion.save(tokenizer_revision=tokenizer_revision, stage=self.job.stage, stage_options=stage_options,
                                    world_size=self.session.world_size, history=self.history)
        if self.session.is_main:
            self._drop_resume_state()
            self._write_closing_lines()
            self._publish_version(tokenizer_revision=tokenizer_revision, stage_options=stage_options,
                                  manifest_extra=manifest_extra, stage_extra=stage_extra, replace=replace)
            if self.job.companion is not None:
                self.job.companion.publish()
        self.session.barrier()
        plan = self.plan
        return RunResult(plan.target, plan.version, plan.parent, self.history, self.session.world_size, self.steps)

    @property
    def _keeps_masters(self) -> bool:
        """Whether the version keeps its float32 master weights beside the rounded ones."""
        return self.dtype != "float32" and self.job.keep_optimizer_state

    def _save_weights(self) -> None:
        """The weights (in the version's dtype) and the optimizer state into staging."""
        staging = self.plan.staging
        try:
            self.backend.save_model(staging, dtype=getattr(torch, self.dtype), shard_bytes=source_shard_bytes(self.parent),
                                    masters=staging / "trainer_state" / MASTERS if self._keeps_masters else None)
            if self.job.keep_optimizer_state:
                self.backend.save_optimizer(staging / "trainer_state" / "optimizer.pt")
        except Exception as exc:  # a full or read-only disk: the published versions are untouched
            problem = first_line(exc) if storage_error(exc) else file_system_problem(staging)
            if problem is None:
                raise
            raise GlmpostError(f"{staging}: cannot write the new version ({problem}); the published versions and "
                               "LATEST are as they were") from None

    def _drop_resume_state(self) -> None:
        """The resume state is not part of the version (nor is ``trainer_state`` when it carries no optimizer state)."""
        if self.job.companion is not None:
            shutil.rmtree(self._companion_state, ignore_errors=True)
        if self.job.keep_optimizer_state:
            self.resume_state.unlink(missing_ok=True)
        else:
            shutil.rmtree(self.plan.staging / "trainer_state", ignore_errors=True)

    def _write_closing_lines(self) -> None:
        """The updates' ``finish`` lines after their steps' in staging's ``metrics.jsonl``."""
        if self.closing_lines:
            with open(self.plan.staging / "metrics.jsonl", "a") as f:
                f.writelines(json.dumps(line, sort_keys=True) + "\n" for line in self.closing_lines)
            for line in self.closing_lines:
                track(line)

    def _publish_version(self, *, tokenizer_revision: str, stage_options: dict[str, Any], manifest_extra: dict[str, Any],
                         stage_extra: dict[str, Any], replace: bool) -> None:
        manifest_extra = {**manifest_extra, "dtype": self.dtype, "precision": self.session.precision,
                          "masters": f"trainer_state/{MASTERS}" if self._keeps_masters else None}
        publish_staged(self.plan, stage=self.job.stage, stage_options=stage_options, world_size=self.session.world_size,
                       stage_extra=stage_extra, manifest_extra=manifest_extra, steps=self.steps,
                       tokenizer_revision=tokenizer_revision, history=self.history, replace=replace)

    # After a version: a follow session continues from it.

    def advance(self) -> None:
        """Continue from the version just published: plan the one after it, nothing trained since."""
        self.plan = NextVersion.plan(self.plan.target, self.plan.root.path)
        self.steps_before += len(self.history)
        self._clear()
        if self.job.companion is not None:
            self.job.companion.version = self.plan.version

    def reset_optimizer(self) -> None:
        """AdamW from zero (the policy's, and the companion's)."""
        self.backend.reset_optimizer()
        if self.job.companion is not None:
            self.job.companion.reset_optimizer()


def load_for_training(checkpoint: Path, session: TrainingSession, options: RunOptions, *, trained: bool = True):
    """A model on this rank's device: the one trained holds float32 master weights (whatever the
    checkpoint's dtype; ``precision`` bf16 computes in bfloat16 over them); another (a KL reference)
    keeps the checkpoint's dtype."""
    dtype = "float32" if trained else None
    return load_model(checkpoint, device=session.device, dtype=dtype, deterministic_topk=options.deterministic_topk,
                      attention=options.attention)


def published_steps(root: Path) -> int:
    """The optimizer steps of the versions published in ``root`` (its ``metrics.jsonl`` lines of a step)."""
    path = Path(root) / "metrics.jsonl"
    if not path.is_file():
        return 0
    with open(path) as f:
        return sum(1 for line in f if '"train/step"' in line)


def publish_staged(plan: NextVersion, *, stage: str, stage_options: dict[str, Any], world_size: int, stage_extra: dict[str, Any],
                   manifest_extra: dict[str, Any], steps: int, tokenizer_revision: str, history: list[dict],
                   replace: bool = False) -> None:
    """Rank 0, the weights in ``plan.staging``: stage.json, the manifest (a staged LoRA version's
    keeps the base it names), the move into place and ``LATEST``; the steps' metrics appended to the
    root's ``metrics.jsonl`` (its history across versions)."""
    if "attention" in stage_options:
        stage_extra = {"attention_ran": attention_ran(plan.parent, stage_options["attention"]), **stage_extra}
    write_stage_json(plan.staging, stage, stage_options, parent=str(plan.parent), world_size=world_size, **stage_extra)
    lora_base = read_manifest(plan.staging).lora_base if is_lora_version(plan.staging) else None
    plan.publish(CheckpointManifest(policy_version=plan.version, tokenizer_revision=tokenizer_revision, stage=stage, step=steps,
                                    parent=str(plan.parent), extra=manifest_extra, lora_base=lora_base), replace=replace)
    with open(plan.root.path / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps(m, sort_keys=True) + "\n" for m in history)
