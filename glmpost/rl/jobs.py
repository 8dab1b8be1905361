"""What a training stage brings to a run (:class:`~glmpost.rl.run.TrainingCore`): its trainer
(:class:`TrainingJob`: how it is built, the optimizer state its versions carry, a companion model)
and each update (:class:`Update`: the examples, their step metrics, what the version records), and
what a published version reports (:class:`RunResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from glmpost.kernel.distribution import ScoredDistribution
from glmpost.rl.distributed import OptimizerConfig, TrainingSession


class Trainer(Protocol):
    """What the run drives: ``prepare`` on the parent's weights (its log-probs under ``distribution``,
    the update's records'), then resumable optimizer steps."""

    backend: Any

    def prepare(self, examples: list, distribution: ScoredDistribution) -> Any: ...

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
    """What a stage brings to a run: its trainer and how its versions carry optimizer state."""

    stage: str
    config: OptimizerConfig
    # (model, optimisation backend, session) -> the trainer.
    build: Callable[[Any, Any, TrainingSession], Trainer]
    # (model) -> None: changes the model before the optimisation backend takes it (fake quant; ZeRO-3
    # partitions the parameters it is given).
    adapt_model: Callable[[Any], None] | None = None
    # RL carries AdamW's state from version to version (trainer_state/optimizer.pt); SFT/QAT do not.
    keep_optimizer_state: bool = True
    companion: Companion | None = None  # set up by ``build``
    # Versions are published in the parent's dtype (bf16 in, bf16 out), the float32 masters kept in
    # trainer_state; QAT publishes its float32 masters (the deployed quantizer reads exactly those).
    publish_in_parent_dtype: bool = True


@dataclass
class Update:
    """What one update trains and what the version it goes into records."""

    examples: list
    step_metrics: dict[str, Any] = field(default_factory=dict)  # added to every step's metrics
    # (trainer) -> metric lines written after the steps' (held-out loss, quantization error, compacted
    # segments); runs after training on every rank and may change the model back before it is saved.
    finish: Callable[[Any], list[dict]] | None = None
    manifest_extra: dict[str, Any] = field(default_factory=dict)
    stage_extra: dict[str, Any] = field(default_factory=dict)  # stage.json fields
    # What the records' rollout log-probs are of (:class:`~glmpost.rl.admission.Admission`): the
    # trainer's log-probs are taken under it. SFT's examples have none: the model's own.
    distribution: ScoredDistribution = ScoredDistribution()


@dataclass
class RunResult:
    """A published version, on rank 0."""

    target: Path
    version: int
    parent: Path
    history: list[dict] = field(default_factory=list)
    world_size: int = 1
    steps: int = 0


def too_few_examples(job: TrainingJob, examples: list) -> int | None:
    """The job's ``mini_batches`` when ``examples`` cannot give each optimizer step one (a batch run
    refuses it; a follow trainer drops such a batch), else None."""
    mini = getattr(job.config, "mini_batches", 1)
    return mini if mini > len(examples) else None
