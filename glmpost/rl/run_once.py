"""A training run once: one update from ``--checkpoint`` to its next version under ``--out``
(train-grpo, opd-merge, train-sao and qat without ``--follow``), on the shared
:class:`~glmpost.rl.run.TrainingCore`.

``with RunOnce(checkpoint, out, options, stage=...) as run`` holds the output root
(:class:`~glmpost.rl.held_run.HeldRun`) and plans the version ``root/v(N+1)`` for a parent at policy
version ``N``. A target that exists was trained: the rerun does nothing (:meth:`RunOnce.already_done`;
other options than the published version's are refused, ``overwrite`` trains it again). Staging that
an interrupted run left needs ``resume`` (continue from the state saved every ``save_every`` steps,
repeating no step) or ``overwrite`` (start over). :meth:`RunOnce.run` then opens the core, trains the
update and publishes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from glmpost.checkpoints import NextVersion, version_dir_name
from glmpost.config import ConfigError
from glmpost.rl.jobs import RunResult, TrainingJob, Update, too_few_examples
from glmpost.rl.held_run import HeldRun
from glmpost.rl.run import RunOptions, TrainingCore
from glmpost.stage import check_same_options, log

# Options that say how a run executes, not what it trains: a rerun may change them (init_critic only
# says what to do when train-sao's critic root is empty).
RERUN_IGNORED = ("config", "resume", "save_every", "init_critic", "activation_checkpointing")


class RunOnce(HeldRun):
    """One update from ``checkpoint`` to its next version under ``out`` (module doc)."""

    def __init__(self, checkpoint: Path | str, out: Path | str, options: RunOptions, *, stage: str):
        super().__init__(checkpoint, out, options, stage=stage)
        self._done: tuple[Path, int] | None = None  # a version that was this update already

    def open_core(self) -> TrainingCore:
        plan = NextVersion.plan(self.checkpoint, self.out)
        resuming = self.options.resume and (plan.staging / "trainer_state" / "resume.pt").exists()
        return TrainingCore(plan, self.options, stage=self.stage, resuming=resuming)

    def already_done(self, stage_options: dict[str, Any]) -> bool:
        """Whether this update was trained and published with these options (a rerun then does
        nothing). Another option, or other inputs, than the published version's: exit 2 naming it.
        ``overwrite`` trains it again and replaces it, when no later version was trained from it."""
        target = self.plan.target
        if not target.exists():
            return self._parent_is_this_update(stage_options)
        if self.options.overwrite:
            later = [v for v in self.plan.root.versions() if v > self.plan.version]
            if later:
                raise ConfigError("{overwrite} would train {target} again, but {later} came after it; publish into another {out}",
                                  target=target, later=", ".join(version_dir_name(v) for v in later))
            log(f"{target}: training it again (--overwrite); the new version replaces it when it is published")
            return False
        check_same_options(target, self.stage, stage_options, ignore=RERUN_IGNORED, overwrite=False)
        return True

    def _parent_is_this_update(self, stage_options: dict[str, Any]) -> bool:
        """Whether ``checkpoint`` named this root (not one of its versions) and its newest version was
        trained from these inputs with these options (the same command run again after it published: done, not an
        update of that version from records it already trained on). Options that admit records sampled
        versions before ``checkpoint`` (``max_version_lag`` >= 1) ask for that update: it trains."""
        parent = self.plan.parent  # the root's LATEST: a version named explicitly is a new update of it
        if (self.options.overwrite or Path(self.checkpoint).resolve() != self.out.resolve()
                or stage_options.get("max_version_lag", 0)):
            return False
        try:
            before = json.loads((parent / "stage.json").read_text())
        except (OSError, ValueError):
            return False
        earlier, ignore = before.get("options", {}), (*RERUN_IGNORED, "checkpoint")
        if before.get("stage") != self.stage or any(key not in earlier or earlier[key] != value
                                                    for key, value in stage_options.items() if key not in ignore):
            return False
        log(f"{parent} was trained from these inputs with these options; nothing to do (already done)")
        self._done = (parent, self.plan.parent_version)
        return True

    def skipped(self) -> dict[str, Any]:
        """The summary of an update whose version was already published."""
        target, version = self._done or (self.plan.target, self.plan.version)
        return {"out": str(target), "skipped": True, "policy_version": version}

    def check_staging(self) -> None:
        staging = self.plan.staging
        if staging.exists() and not (self.options.resume or self.options.overwrite):
            raise ConfigError("an interrupted run left {staging}; pass {resume} to continue it or {overwrite} to start over",
                              staging=staging)

    def run(self, job: TrainingJob, update: Update, *, tokenizer_revision: str, stage_options: dict[str, Any]) -> RunResult | None:
        """Open, train ``update``, publish it and end the session; the result on rank 0, None on the other ranks."""
        short = too_few_examples(job, update.examples)  # before the model loads
        if short is not None:
            raise ConfigError("{mini_batches} {mini} is more than this update's {n} example(s): every optimizer step "
                              "needs one", mini=short, n=len(update.examples))
        core = self.core
        try:
            core.open(job)
            core.update(update, save_every=self.options.save_every)
            result = core.publish(tokenizer_revision=tokenizer_revision, stage_options=stage_options,
                                  manifest_extra=update.manifest_extra, stage_extra=update.stage_extra,
                                  replace=self.options.overwrite)
        finally:
            core.close()
        return result if core.session.is_main else None
