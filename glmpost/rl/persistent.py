"""A trainer that stays in memory from version to version (``train-grpo --follow``, ``opd-merge
--follow``; brief, the asynchronous loop: "sync every K steps").

The model, its optimizer and the stage's trainer are set up once, from the output root's newest
version (the initial ``--checkpoint`` before the first). Each :meth:`PersistentRun.train` is one
update on one batch: old log-probs and trust masks on the weights as they are now (the proximal
policy), then the stage's optimizer steps. :meth:`PersistentRun.publish` writes the weights as the
next version (``root/v(N+1)``, its optimizer state beside them) and moves ``LATEST``: the rollout
switches to it. Batches trained since the last version exist only in memory: a crash loses them
(never a published version), a restart trains them again from the newest version.

Staleness is counted in published versions: a batch trained after the last publish is
``v_rollout`` behind the version being built by ``parent_version + 1 - v_rollout`` at most.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

from glmpost.checkpoints import LATEST, CheckpointRoot, NextVersion
from glmpost.config import ConfigError
from glmpost.rl.run import Companion, RunOptions, load_for_training, publish_staged
from glmpost.rl.distributed import TrainingSession
from glmpost.stage import log


def newest_parent(out: Path, checkpoint: Path) -> Path:
    """The version to continue from: ``out``'s newest (``LATEST`` repaired when a crash came between
    moving a version in and moving ``LATEST``), else ``checkpoint``."""
    root = CheckpointRoot(out)
    versions = root.versions()
    if not versions:
        return Path(checkpoint)
    latest = root.latest()
    if latest != versions[-1]:
        log(f"{out}: {LATEST} named {'nothing' if latest is None else f'v{latest}'}, but v{versions[-1]} was published; moving it")
        root.set_latest(versions[-1])
    return Path(out)


class PersistentRun:
    """One training session across many batches and versions (the module doc). ``build(model,
    backend, session)`` makes the stage's trainer (``prepare`` / ``train``), on the first batch, and
    sets ``companion`` up (SAO's critic), published after each version."""

    def __init__(self, checkpoint: Path, out: Path, options: RunOptions, *, stage: str, config: Any,
                 build: Callable[[Any, Any, TrainingSession], Any], companion: Companion | None = None):
        self.out, self.options, self.stage, self.config, self.companion = Path(out), options, stage, config, companion
        self.plan = NextVersion.plan(newest_parent(self.out, checkpoint), self.out)
        self.session = TrainingSession.start(device=options.device, deterministic=options.deterministic,
                                             zero_stage=options.zero_stage, deepspeed_config=options.deepspeed_config)
        if options.reset_optimizer and self.session.use_deepspeed:
            self.session.close()
            raise ConfigError("{reset_optimizer} with --follow resets torch AdamW between versions; not under DeepSpeed")
        self.model = load_for_training(self.plan.parent, self.session, options)
        self.backend = self.session.backend(self.model, config)
        if not options.reset_optimizer:
            self.backend.load_optimizer(self.plan.parent / "trainer_state" / "optimizer.pt")
        self._build, self.trainer = build, None
        self.history: list[dict] = []  # the optimizer steps since the last version
        self.updates = 0  # batches trained since the last version

    @property
    def parent_version(self) -> int:
        """The newest published version (the one this process started from, or published since)."""
        return self.plan.parent_version

    @property
    def parent(self) -> Path:
        return self.plan.parent

    def train(self, examples: list, step_metrics: dict[str, Any]) -> list[dict]:
        """One update on ``examples``; each step's metrics (with ``step_metrics``) are returned and kept."""
        if self.trainer is None:
            self.trainer = self._build(self.model, self.backend, self.session)  # sets the companion up
            if self.companion is not None and not self.options.reset_optimizer:
                self.companion.load_optimizer()
        prepared = self.trainer.prepare(examples)  # the weights as they are now: the proximal policy
        steps: list[dict] = []

        def on_step(step: int, metrics: dict) -> None:
            metrics.update(step_metrics, **{"train/update": self.updates})
            steps.append(metrics)

        self.trainer.train(prepared, start_step=0, on_step=on_step)
        self.history += steps
        self.updates += 1
        return steps

    def publish(self, *, tokenizer_revision: str, stage_options: dict[str, Any], manifest_extra: dict[str, Any],
                stage_extra: dict[str, Any]) -> int:
        """Write the weights as the next version and move ``LATEST``; returns the version."""
        plan = self.plan
        if plan.staging.exists():  # a crash while writing an earlier attempt
            shutil.rmtree(plan.staging)
        plan.staging.mkdir(parents=True)
        self.backend.save_model(plan.staging)
        self.backend.save_optimizer(plan.staging / "trainer_state" / "optimizer.pt")
        (plan.staging / "metrics.jsonl").write_text("".join(json.dumps(m, sort_keys=True) + "\n" for m in self.history))
        companion = self.companion if self.trainer is not None else None
        if companion is not None:
            companion.save(tokenizer_revision=tokenizer_revision, stage=self.stage, stage_options=stage_options,
                           world_size=self.session.world_size, history=self.history)
        publish_staged(plan, stage=self.stage, stage_options=stage_options, world_size=self.session.world_size,
                       stage_extra={**stage_extra, "updates": self.updates}, manifest_extra=manifest_extra,
                       steps=len(self.history), tokenizer_revision=tokenizer_revision, history=self.history)
        version = plan.version
        self.plan = NextVersion.plan(plan.target, self.out)
        self.history, self.updates = [], 0
        if companion is not None:
            companion.publish()
            companion.version = self.plan.version
        if self.options.reset_optimizer:
            self.backend.reset_optimizer()
            if companion is not None:
                companion.reset_optimizer()
        return version

    def close(self) -> None:
        self.session.close()
