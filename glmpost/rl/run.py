"""The training run every training stage goes through (train-grpo, opd-merge, train-sao, qat), run
once on a batch of inputs or kept open by a follow trainer (``--follow``)::

    open -> update (one or more) -> publish the next version -> (update ... publish ...) -> close

* **plan**: the parent's policy version ``N`` and the target ``root/v(N+1)``
  (:class:`~glmpost.checkpoints.NextVersion`). Once: the parent is ``--checkpoint``; a target that
  exists was trained and the run is skipped; staging left by an interrupted run needs ``resume``
  (continue it) or ``overwrite`` (start over). Following: the parent is the output root's newest
  version, and staging a crash left is discarded (its updates are trained again from their
  returned claims). Either way the root's lock is held from the plan on, and a ``LATEST`` a crash
  left behind is moved to the newest version first.
* **open**: the training session (device, DeepSpeed ZeRO under a launcher), the parent's weights on
  this rank's device, the parent's optimizer state when the stage carries it from version to version.
* **update**: on the first, the stage's trainer (:attr:`TrainingJob.build`, and the companion's
  optimizer state: SAO's critic); the trainer's preparation on the weights as they are (old log-probs belong to the
  policy that sampled: once, before any resumed weights are loaded; following, the proximal policy),
  then the optimizer steps; every step's metrics go to ``staging/metrics.jsonl`` and, once, every
  ``save_every`` steps the resumable state to ``staging/trainer_state/resume.pt``.
* **publish** (rank 0): weights (and optimizer state) into staging, the update's closing metric
  lines, ``stage.json``, the manifest, the atomic move into place and ``LATEST``; the steps' metrics
  are appended to the root's ``metrics.jsonl`` (the history across versions). A follow trainer then
  plans the version after it; the updates since the last publish exist only in memory (a crash
  loses them, never a published version).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from glmpost.checkpoints import (
    LATEST,
    CheckpointManifest,
    CheckpointRoot,
    NextVersion,
    model_folder_problem,
    version_dir_name,
)
from glmpost.config import ConfigError, setting, shared
from glmpost.errors import GlmpostError, first_line, storage_error
from glmpost.fsutil import file_system_problem
from glmpost.kernel.loading import attention_ran, import_architecture, load_model, partitioned, saved_dtype
from glmpost.locks import output_lock
from glmpost.memory.process import peak_rss_mib, resident_mib, trim_heap
from glmpost.rl.distributed import TrainingSession
from glmpost.rl.jobs import RunResult, TrainingJob, Update, too_few_examples
from glmpost.rl.precision import MASTERS, checkpoint_layers, load_masters
from glmpost.rl.sharded_save import master_files, source_shard_bytes
from glmpost.stage import check_same_options, log, write_stage_json
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


# Options that say how a run executes, not what it trains: a rerun may change them (init_critic only
# says what to do when train-sao's critic root is empty).
RERUN_IGNORED = ("config", "resume", "save_every", "init_critic", "activation_checkpointing")


class TrainingRun:
    """A training session from a parent version to the versions after it (see the module doc):
    ``follow`` keeps it open across updates and versions, continuing ``out``'s newest version."""

    def __init__(self, checkpoint: Path | str, out: Path | str, options: RunOptions, *, stage: str, follow: bool = False):
        self.out, self.options, self.follow, self.stage = Path(out), options, follow, stage
        if options.resume and options.overwrite:
            raise ConfigError("{resume} continues an interrupted run and {overwrite} starts it over: give one of them")
        problem = model_folder_problem(self.out)
        if problem:
            raise ConfigError("{out} {path} {problem}", path=self.out, problem=problem)
        self._held = contextlib.ExitStack()
        writer = int(os.environ.get("RANK", "0")) == 0  # one writer per root: the run's rank 0 holds it for all
        if writer:
            self._held.enter_context(output_lock(self.out, stage=stage))
        try:
            repaired = CheckpointRoot(self.out).repair_latest() if writer else None
            if repaired is not None:
                log(f"{self.out}: {LATEST} named {repaired[0] or 'nothing'}, but {version_dir_name(repaired[1])} was "
                    "published; moved it")
            self.plan = NextVersion.plan(self.out if follow and CheckpointRoot(self.out).versions() else checkpoint, out)
        except BaseException:
            self._held.close()
            raise
        self.resume_state = self.plan.staging / "trainer_state" / "resume.pt"
        self.resuming = not follow and options.resume and self.resume_state.exists()
        self.steps_before = published_steps(self.out)  # the x-axis of train/global_step
        self.job: TrainingJob | None = None
        self.session: TrainingSession | None = None
        self.model = self.backend = self.trainer = None
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

    def __enter__(self) -> "TrainingRun":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def already_done(self, stage_options: dict[str, Any]) -> bool:
        """Whether this update was trained and published with these options (a rerun then does
        nothing). Another option, or other inputs, than the published version's: exit 2 naming it.
        ``overwrite`` trains it again and replaces it, when no later version was trained from it."""
        target = self.plan.target
        if not target.exists():
            return False
        if self.options.overwrite:
            later = [v for v in self.plan.root.versions() if v > self.plan.version]
            if later:
                raise ConfigError("{overwrite} would train {target} again, but {later} came after it; publish into another {out}",
                                  target=target, later=", ".join(version_dir_name(v) for v in later))
            log(f"{target}: training it again (--overwrite); the new version replaces it when it is published")
            return False
        check_same_options(target, self.stage, stage_options, ignore=RERUN_IGNORED, overwrite=False)
        return True

    def skipped(self) -> dict[str, Any]:
        """The summary of an update whose version was already published."""
        return {"out": str(self.plan.target), "skipped": True, "policy_version": self.plan.version}

    def check_staging(self) -> None:
        staging = self.plan.staging
        if staging.exists() and not (self.options.resume or self.options.overwrite):
            raise ConfigError("an interrupted run left {staging}; pass {resume} to continue it or {overwrite} to start over",
                              staging=staging)

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
        if self.follow and o.reset_optimizer and session.use_deepspeed:
            raise ConfigError("{reset_optimizer} with {follow} resets torch AdamW between versions; not under DeepSpeed")
        # QAT's fake quant (adapt_model) reads whole weights: its model is loaded whole, as before.
        import_architecture(self.parent)
        with session.partitioned_loading(job.config) if job.adapt_model is None else contextlib.nullcontext():
            before = resident_mib()  # DeepSpeed, transformers' integration and the model's code imported: what the model adds
            model = self.load(self.parent, session)
        trim_heap()  # what building and filling the model freed
        if partitioned(model) and session.is_main:
            held = sum(p.ds_tensor.numel() for p in model.parameters())
            peak = peak_rss_mib()
            log(f"ZeRO-3: the model was created partitioned over {session.world_size} ranks; rank 0 holds {held:,} of "
                f"{sum(p.ds_numel for p in model.parameters()):,} parameters"
                + (f" (resident before loading: {before:,.0f} MiB; peak so far: {peak:,.0f} MiB)" if peak is not None else ""))
        self.dtype = saved_dtype(self.parent) if job.publish_in_parent_dtype else "float32"
        masters = self.parent / "trainer_state" / MASTERS
        if not self.resuming and master_files(masters):  # the parent's float32 weights, before it was rounded
            load_masters(model, masters)
        if o.activation_checkpointing:
            checkpoint_layers(model)
        if job.adapt_model is not None:
            job.adapt_model(model)
        self.model, self.backend = model, session.backend(model, job.config)
        if self._carries_optimizer:
            self.backend.load_optimizer(self.parent / "trainer_state" / "optimizer.pt")

    @property
    def _carries_optimizer(self) -> bool:
        return self.job.keep_optimizer_state and not self.options.reset_optimizer and not self.resuming

    def _build_trainer(self) -> None:
        """The stage's trainer, on the first update: its settings may come from the first batch's
        records (the log-prob distribution they were sampled with). It sets the companion up."""
        self.trainer = self.job.build(self.model, self.backend, self.session)
        if self.job.companion is not None and self._carries_optimizer:
            self.job.companion.load_optimizer()

    def close(self) -> None:
        """End the session and let the root's lock go (callers close in a ``finally``, or use the
        run as a context manager; closing twice is harmless)."""
        if self.session is not None:
            self.session.close()
        self._held.close()

    @property
    def _companion_state(self) -> Path:
        return self.plan.staging / "trainer_state" / self.job.companion.name

    def update(self, update: Update) -> list[dict]:
        """Train one update (module doc); returns its steps' metrics, kept until the next publish."""
        o, session, staging, companion = self.options, self.session, self.plan.staging, self.job.companion
        if self.updates == 0:  # the version's first update starts its staging
            if session.is_main:
                if staging.exists() and (o.overwrite or not self.resuming):
                    shutil.rmtree(staging)  # --overwrite, an interruption before the first saved state, a lost follow update
                staging.mkdir(parents=True, exist_ok=True)
            session.barrier()
        if self.trainer is None:
            self._build_trainer()
        metrics_path = staging / "metrics.jsonl"
        prepared = self.trainer.prepare(update.examples)  # the weights as they are now, before any resume
        total = self.trainer.steps(prepared)
        start_step, steps = 0, []
        if self.resuming:  # weights, optimizer state, step and metrics of the last save
            start_step, steps = self.backend.load_resume_state(self.resume_state)
            if companion is not None:
                companion.load_resume_state(self._companion_state, start_step)
            log(f"resuming at optimizer step {start_step} of {total}")
            if session.is_main:  # drop lines of steps that ran after the last saved state
                metrics_path.write_text("".join(json.dumps(m, sort_keys=True) + "\n" for m in steps))
            self.resuming = False
        step_metrics = {**update.step_metrics, **({"train/update": self.updates} if self.follow else {})}
        progress = tqdm(total=total, initial=start_step, desc=self.job.stage, unit="step", leave=False,
                        disable=None if session.is_main else True)

        first_step = self.steps_before + len(self.history)

        def on_step(step: int, metrics: dict) -> None:
            metrics.update(step_metrics, **{"train/global_step": first_step + step})
            steps.append(metrics)
            if session.is_main:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(metrics, sort_keys=True) + "\n")
                track(metrics)
            progress.update(1)
            if not self.follow and o.save_every and (step + 1) % o.save_every == 0 and step + 1 < total:
                if companion is not None:  # first: the policy's resume state names the step to resume at
                    companion.save_resume_state(self._companion_state, step + 1)
                self.backend.save_resume_state(self.resume_state, step + 1, self.history + steps)

        with progress:
            self.trainer.train(prepared, start_step=start_step, on_step=on_step)
        if update.finish is not None:
            self.closing_lines += update.finish(self.trainer)
        self.history += steps
        self.updates += 1
        self.steps += total
        return steps

    def publish(self, *, tokenizer_revision: str, stage_options: dict[str, Any], manifest_extra: dict[str, Any],
                stage_extra: dict[str, Any]) -> RunResult:
        """Publish the updates since the last version as the next one (every rank: ZeRO-3 gathers
        the weights); a follow run then plans the version after it."""
        plan, session, job, companion = self.plan, self.session, self.job, self.job.companion
        staging = plan.staging
        rounded = self.dtype != "float32"
        try:
            self.backend.save_model(staging, dtype=getattr(torch, self.dtype), shard_bytes=source_shard_bytes(self.parent),
                                    masters=staging / "trainer_state" / MASTERS if rounded and job.keep_optimizer_state else None)
            if job.keep_optimizer_state:
                self.backend.save_optimizer(staging / "trainer_state" / "optimizer.pt")
        except Exception as exc:  # a full or read-only disk: the published versions are untouched
            problem = first_line(exc) if storage_error(exc) else file_system_problem(staging)
            if problem is None:
                raise
            raise GlmpostError(f"{staging}: cannot write the new version ({problem}); the published versions and "
                               "LATEST are as they were") from None
        if companion is not None:
            companion.save(tokenizer_revision=tokenizer_revision, stage=job.stage, stage_options=stage_options,
                           world_size=session.world_size, history=self.history)
        if session.is_main:
            if companion is not None:
                shutil.rmtree(self._companion_state, ignore_errors=True)
            if job.keep_optimizer_state:
                self.resume_state.unlink(missing_ok=True)
            else:  # resume state is not part of the checkpoint
                shutil.rmtree(staging / "trainer_state", ignore_errors=True)
            if self.closing_lines:
                with open(staging / "metrics.jsonl", "a") as f:
                    f.writelines(json.dumps(line, sort_keys=True) + "\n" for line in self.closing_lines)
                for line in self.closing_lines:
                    track(line)
            if self.follow:
                stage_extra = {**stage_extra, "updates": self.updates}
            manifest_extra = {**manifest_extra, "dtype": self.dtype, "precision": session.precision,
                              "masters": f"trainer_state/{MASTERS}" if rounded and job.keep_optimizer_state else None}
            publish_staged(plan, stage=job.stage, stage_options=stage_options, world_size=session.world_size,
                           stage_extra=stage_extra, manifest_extra=manifest_extra, steps=self.steps,
                           tokenizer_revision=tokenizer_revision, history=self.history,
                           replace=self.options.overwrite and not self.follow)
            if companion is not None:
                companion.publish()
        session.barrier()
        result = RunResult(plan.target, plan.version, plan.parent, self.history, session.world_size, self.steps)
        if not self.follow:  # a run once keeps its plan: what it reports
            return result
        self.plan = NextVersion.plan(plan.target, self.out)
        self.resume_state = self.plan.staging / "trainer_state" / "resume.pt"
        self.steps_before += len(self.history)
        self._clear()
        if companion is not None:
            companion.version = self.plan.version
        if self.follow and self.options.reset_optimizer:
            self.backend.reset_optimizer()
            if companion is not None:
                companion.reset_optimizer()
        return result

    def run(self, job: TrainingJob, update: Update, *, tokenizer_revision: str, stage_options: dict[str, Any]) -> RunResult | None:
        """Open, train ``update``, publish it and close; the result on rank 0, None on the other ranks."""
        short = too_few_examples(job, update.examples)  # before the model loads
        if short is not None:
            raise ConfigError("{mini_batches} {mini} is more than this update's {n} example(s): every optimizer step "
                              "needs one", mini=short, n=len(update.examples))
        try:
            self.open(job)
            self.update(update)
            result = self.publish(tokenizer_revision=tokenizer_revision, stage_options=stage_options,
                                  manifest_extra=update.manifest_extra, stage_extra=update.stage_extra)
        finally:
            self.close()
        return result if self.session.is_main else None


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
    """Rank 0, the weights in ``plan.staging``: stage.json, the manifest, the move into place and
    ``LATEST``; the steps' metrics appended to the root's ``metrics.jsonl`` (its history across versions)."""
    if "attention" in stage_options:
        stage_extra = {"attention_ran": attention_ran(plan.parent, stage_options["attention"]), **stage_extra}
    write_stage_json(plan.staging, stage, stage_options, parent=str(plan.parent), world_size=world_size, **stage_extra)
    plan.publish(CheckpointManifest(policy_version=plan.version, tokenizer_revision=tokenizer_revision, stage=stage, step=steps,
                                    parent=str(plan.parent), extra=manifest_extra), replace=replace)
    with open(plan.root.path / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps(m, sort_keys=True) + "\n" for m in history)
