"""The recipe's ``[pipeline]`` section: which GLM-5 stages run, in what order, on what data.

``bin/pipeline`` (plain shell) and ``bin/slurm/submit-pipeline`` (an sbatch chain) run GLM-5's
post-training sequence from ONE recipe (brief, "GLM-5 的后训练流水线"): INT4 QAT SFT -> Reasoning RL
iterations (rollout -> judge -> train-grpo -> sync-weights) -> cross-stage OPD (rollout ->
score-teacher -> opd-merge) -> quantize for deployment -> the diff-logprobs gate. Every stage reads
its options from its own section of the same recipe (``[rollout]``, ``[train-grpo]``, ...); this
module owns ``[pipeline]`` (and its ``[pipeline.slurm]`` and ``[pipeline.teachers]`` tables)::

    [pipeline]
    stages = ["qat", "rl", "opd", "quantize", "diff-logprobs"]   # in this order; any subset that can run
    base-checkpoint = "ckpt/glm5-sft"     # or put "init-model" first to build the tiny model
    run-dir = "runs/glm5"                 # every step's output lives in its own folder below it
    sft-data = ["data/sft.jsonl"]         # qat's inputs
    prompts = ["data/reasoning.jsonl"]    # Reasoning RL prompts
    iterations = 2                        # RL policy updates
    rollout-tasks = 4                     # rollout split (Slurm array size, --num-shards)
    train-ranks = 8                       # training ranks per node (DeepSpeed data parallel)
    train-nodes = 1
    launcher = "npu"                      # cpu | cuda | npu: environment and device of every job

Relative paths are resolved against the current directory, as the stages resolve theirs. A path may
name environment variables (``base-checkpoint = "${GLM5_SFT_CHECKPOINT}"``): a recipe that leaves
site paths to the environment still passes ``glmpost recipe check``; planning a run (the scripts)
refuses an unset one, naming it. Versions
are fixed when the pipeline is planned (the base checkpoint's policy version + 1 per update), so a
rerun names the same version directories and every stage skips the work it already published.

The pipeline is a list of steps (:mod:`glmpost.pipeline.steps`: each one glmpost command with its
argv, inputs, outputs and ranks; one entry per stage of ``STAGE_ORDER`` in ``PIPELINE_STAGES``); the scripts run that
list and know no stage. ``python -m glmpost.pipeline RECIPE --shell`` prints the plan and its
steps as shell assignments for ``eval`` (the scripts use it); ``--json`` prints them as JSON.
Errors are one line (exit 2).
"""

from glmpost.pipeline.plan import PipelinePlan, plan, shell_assignments
from glmpost.pipeline.recipe import (
    LAUNCHERS,
    STAGE_ORDER,
    PipelineConfig,
    SlurmConfig,
    load_pipeline,
    require_resolved,
)
from glmpost.pipeline.steps import PIPELINE_STAGES, Step, pipeline_steps, step_assignments

__all__ = ["LAUNCHERS", "PIPELINE_STAGES", "STAGE_ORDER", "PipelineConfig", "PipelinePlan", "SlurmConfig", "Step",
           "load_pipeline", "pipeline_steps", "plan", "require_resolved", "shell_assignments", "step_assignments"]
