"""The pipeline as a list of steps: every glmpost command the recipe's stages run, in order, with its
argv, inputs, outputs and ranks (see :mod:`glmpost.pipeline`).

``bin/pipeline`` runs the list one step after the other; ``bin/slurm/submit-pipeline`` submits one
job per step, each after the one before. Neither knows a stage: a pipeline stage is its name in
:data:`~glmpost.pipeline.recipe.STAGE_ORDER` (what a recipe may list, in the order stages run) and its
entry in :data:`PIPELINE_STAGES` (the function that lists its steps from the plan), so adding one is
its command module plus those two lines.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Callable

from glmpost.pipeline.plan import PipelinePlan
from glmpost.pipeline.recipe import STAGE_ORDER, PipelineConfig


@dataclass
class Step:
    """One glmpost command of the pipeline.

    ``name`` is unique in the list (the Slurm job name's suffix, ``train-1``); ``stage`` is the
    command (``train-grpo``: its sbatch template ``bin/slurm/<stage>.sbatch`` when there is one)
    and ``key`` tells that stage's steps apart (the iteration, ``opd``, ``start``). ``argv`` follows
    ``glmpost``. A step with ``ranks`` runs as the recipe's train-nodes x train-ranks processes; one
    with ``tasks`` as that many tasks splitting the work (each adds ``--shard-index I --num-shards
    N``). ``published`` is the directory whose ``glmpost.json`` means the step is done (it is
    skipped); ``resume_root`` the checkpoint root of a training step whose interrupted attempt
    the next one resumes (``--resume``) or starts over (``--overwrite``).
    """

    name: str
    stage: str
    key: str
    label: str
    argv: list[str]
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    ranks: bool = False
    tasks: int = 0
    published: str | None = None
    resume_root: str | None = None


def _command(stage: str, inputs: list[str], *options: str, config: PipelineConfig) -> list[str]:
    """``STAGE INPUTS... --config RECIPE OPTIONS...``: every stage reads its own recipe section."""
    return [stage, *inputs, "--config", str(config.recipe), *options]


def init_model_steps(config: PipelineConfig, plan: PipelinePlan) -> list[Step]:
    """The tiny GLM-5 (only when the recipe's stages start with init-model)."""
    return [Step("init-model", "init-model", "", "init-model", _command("init-model", [], "--out", plan.base, config=config),
                 outputs=[plan.base], published=plan.base)]


def qat_steps(config: PipelineConfig, plan: PipelinePlan) -> list[Step]:
    """INT4 QAT SFT: base -> the first SFT version."""
    data = [str(p) for p in config.sft_data]
    argv = _command("qat", data, "--checkpoint", plan.base, "--out", plan.sft_root, config=config)
    return [Step("qat", "qat", "", "qat: INT4 QAT SFT", argv, inputs=[*data, plan.base], outputs=[plan.sft or plan.sft_root],
                 ranks=True, published=plan.sft)]


def rl_steps(config: PipelineConfig, plan: PipelinePlan) -> list[Step]:
    """Reasoning RL: per iteration rollout -> judge -> train-grpo [-> sync-weights]."""
    steps = []
    if config.sync_weights:
        steps.append(Step("sync-start", "sync-weights", "start", "sync-weights: start checkpoint",
                          _command("sync-weights", [], "--checkpoint", plan.rl_start, "--out", plan.rollout_weights_root, config=config),
                          inputs=[plan.rl_start], outputs=[plan.rollout_weights_root]))
    prompts = [str(p) for p in config.prompts]
    for i in range(1, config.iterations + 1):
        folder, sample_with, trained = plan.rl_dirs[i], plan.rl_sample_with[i], plan.rl_trained[i]
        rollout, judged = f"{folder}/rollout", f"{folder}/judged"
        steps += [
            Step(f"rollout-{i}", "rollout", str(i), f"rollout: RL iteration {i}",
                 _command("rollout", prompts, "--checkpoint", sample_with, "--out", rollout, "--seed", str(config.seed + i),
                          config=config),
                 inputs=[*prompts, sample_with], outputs=[rollout], tasks=config.rollout_tasks),
            Step(f"judge-{i}", "judge", str(i), f"judge: RL iteration {i}",
                 _command("judge", [rollout], "--checkpoint", sample_with, "--out", judged, config=config),
                 inputs=[rollout, sample_with], outputs=[judged]),
            Step(f"train-{i}", "train-grpo", str(i), f"train-grpo: RL iteration {i} ({config.world_size} rank(s))",
                 _command("train-grpo", [judged], "--checkpoint", plan.rl_train_from[i], "--out", plan.policy_root, config=config),
                 inputs=[judged, plan.rl_train_from[i]], outputs=[trained], ranks=True, published=trained,
                 resume_root=plan.policy_root),
        ]
        if config.sync_weights:
            steps.append(Step(f"sync-{i}", "sync-weights", str(i), f"sync-weights: RL iteration {i}",
                              _command("sync-weights", [], "--checkpoint", trained, "--out", plan.rollout_weights_root, config=config),
                              inputs=[trained], outputs=[plan.rollout_weights_root]))
    return steps


def opd_steps(config: PipelineConfig, plan: PipelinePlan) -> list[Step]:
    """Cross-stage OPD: the student samples, [judge,] teachers score, opd-merge trains."""
    student = plan.opd_student
    prompts = [str(p) for p in (config.opd_prompts or config.prompts)]
    rollout, judged, scored = f"{plan.opd_dir}/rollout", f"{plan.opd_dir}/judged", f"{plan.opd_dir}/scored"
    steps = [Step("opd-rollout", "rollout", "opd", "rollout: cross-stage OPD",
                  _command("rollout", prompts, "--checkpoint", student, "--out", rollout,
                           "--group-size", str(config.opd_group_size), "--seed", str(config.seed + 1000), config=config),
                  inputs=[*prompts, student], outputs=[rollout], tasks=config.rollout_tasks)]
    if config.opd_judge:  # opd-merge's --task-advantage-weight needs rewards
        steps.append(Step("opd-judge", "judge", "opd", "judge: cross-stage OPD",
                          _command("judge", [rollout], "--checkpoint", student, "--out", judged, config=config),
                          inputs=[rollout, student], outputs=[judged]))
    teachers = [a for domain, path in plan.opd_routes.items() for a in ("--route", f"{domain}={path}")]
    if plan.opd_default_teacher:
        teachers += ["--default-teacher", plan.opd_default_teacher]
    source = judged if config.opd_judge else rollout
    steps += [
        Step("score-teacher", "score-teacher", "", "score-teacher: cross-stage OPD",
             _command("score-teacher", [source], "--out", scored, "--student", student, *teachers, config=config),
             inputs=[source, student, *plan.opd_routes.values(), *filter(None, [plan.opd_default_teacher])],
             outputs=[scored]),
        Step("opd-merge", "opd-merge", "", f"opd-merge: cross-stage OPD ({config.world_size} rank(s))",
             _command("opd-merge", [scored], "--checkpoint", student, "--out", plan.opd_root, config=config),
             inputs=[scored, student], outputs=[plan.opd_trained or plan.opd_root], ranks=True,
             published=plan.opd_trained, resume_root=plan.opd_root),
    ]
    return steps


def quantize_steps(config: PipelineConfig, plan: PipelinePlan) -> list[Step]:
    """The final policy in the deployment format ([quantize] scheme)."""
    return [Step("quantize", "quantize", "", "quantize: deployment checkpoint",
                 _command("quantize", [plan.final], "--out", plan.deploy, config=config),
                 inputs=[plan.final], outputs=[plan.deploy], published=plan.deploy)]


def gate_steps(config: PipelineConfig, plan: PipelinePlan) -> list[Step]:
    """diff-logprobs on the last rollouts: exit 1 when [diff-logprobs] fail-above is exceeded.
    ``--overwrite``: a gate is measured on every run, never skipped because an old report exists."""
    assert plan.gate_rollout is not None and plan.gate_checkpoint is not None
    return [Step("diff-logprobs", "diff-logprobs", "", "diff-logprobs: gate",
                 _command("diff-logprobs", [plan.gate_rollout], "--checkpoint", plan.gate_checkpoint, "--out", plan.gate_out,
                          "--overwrite", config=config),
                 inputs=[plan.gate_rollout, plan.gate_checkpoint], outputs=[plan.gate_out])]


PIPELINE_STAGES: dict[str, Callable[[PipelineConfig, PipelinePlan], list[Step]]] = {
    "init-model": init_model_steps,
    "qat": qat_steps,
    "rl": rl_steps,
    "opd": opd_steps,
    "quantize": quantize_steps,
    "diff-logprobs": gate_steps,
}
"""The function listing each stage's steps, in :data:`STAGE_ORDER`."""


def pipeline_steps(config: PipelineConfig, plan: PipelinePlan) -> list[Step]:
    """Every step of the recipe's stages, in order."""
    return [step for stage in STAGE_ORDER if config.runs(stage) for step in PIPELINE_STAGES[stage](config, plan)]


def step_assignments(steps: list[Step]) -> str:
    """The steps as bash arrays for ``eval`` (``PIPELINE_STEP_NAME[i]``, ..., ``PIPELINE_STEP_ARGV_i``)."""
    def array(name: str, values: list) -> str:
        return f"{name}=({' '.join(shlex.quote(str(v)) for v in values)})"

    lines = [
        f"PIPELINE_STEP_COUNT={len(steps)}",
        array("PIPELINE_STEP_NAME", [s.name for s in steps]),
        array("PIPELINE_STEP_STAGE", [s.stage for s in steps]),
        array("PIPELINE_STEP_KEY", [s.key for s in steps]),
        array("PIPELINE_STEP_LABEL", [s.label for s in steps]),
        array("PIPELINE_STEP_RANKS", [int(s.ranks) for s in steps]),
        array("PIPELINE_STEP_TASKS", [s.tasks for s in steps]),
        array("PIPELINE_STEP_PUBLISHED", [s.published or "" for s in steps]),
        array("PIPELINE_STEP_RESUME_ROOT", [s.resume_root or "" for s in steps]),
        *(array(f"PIPELINE_STEP_ARGV_{i}", s.argv) for i, s in enumerate(steps)),
    ]
    return "\n".join(lines) + "\n"
