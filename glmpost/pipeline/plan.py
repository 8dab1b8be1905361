"""Where every pipeline step reads and writes, fixed before anything runs (see :mod:`glmpost.pipeline`)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmpost.pipeline.recipe import PipelineConfig, base_checkpoint_version, require_resolved


def _vdir(root: Path, version: int) -> Path:
    return root / f"v{version:06d}"


@dataclass
class PipelinePlan:
    """Every step's input and output paths, fixed before anything runs."""

    base: str
    base_version: int
    sft_root: str
    sft: str | None
    rl_start: str
    rl_start_version: int
    policy_root: str
    rollout_weights_root: str
    rl_dirs: dict[int, str]           # iteration -> folder holding rollout/ and judged/
    rl_train_from: dict[int, str]     # iteration -> version directory the update starts from
    rl_sample_with: dict[int, str]    # iteration -> checkpoint the rollouts sample with
    rl_trained: dict[int, str]        # iteration -> version directory the update publishes
    opd_dir: str
    opd_student: str
    opd_root: str
    opd_trained: str | None
    opd_default_teacher: str | None
    opd_routes: dict[str, str]
    final: str
    deploy: str
    gate_rollout: str | None
    gate_checkpoint: str | None
    gate_out: str


def plan(config: PipelineConfig) -> PipelinePlan:
    """Where every step reads and writes (see the module docstring for the order)."""
    where = f"{config.recipe}: [pipeline]"
    require_resolved(config)
    run = config.run_dir
    base, base_version = base_checkpoint_version(config, where)
    sft_root = run / "sft"
    sft = _vdir(sft_root, base_version + 1) if config.runs("qat") else None
    start, start_version = (sft, base_version + 1) if sft is not None else (base, base_version)
    policy_root, weights_root = run / "policy", run / "rollout-weights"
    rl_dirs, train_from, sample_with, trained = {}, {}, {}, {}
    final, final_version = start, start_version
    gate_rollout = gate_checkpoint = None
    if config.runs("rl"):
        for i in range(1, config.iterations + 1):
            rl_dirs[i] = run / "rl" / f"iter-{i:03d}"
            train_from[i] = start if i == 1 else _vdir(policy_root, start_version + i - 1)
            sample_with[i] = _vdir(weights_root, start_version + i - 1) if config.sync_weights else train_from[i]
            trained[i] = _vdir(policy_root, start_version + i)
        final, final_version = trained[config.iterations], start_version + config.iterations
        gate_rollout, gate_checkpoint = rl_dirs[config.iterations] / "rollout", train_from[config.iterations]
    refs = {"base": base, "sft": sft, "rl": final if config.runs("rl") else None}
    opd_root = run / "opd-policy"
    opd_student = final
    opd_trained = None
    routes = {domain: str(refs.get(ref) or Path(ref).absolute()) for domain, ref in config.teachers.items()}
    default_teacher = None
    if config.opd_default_teacher is not None:
        ref = config.opd_default_teacher
        default_teacher = str(refs.get(ref) or Path(ref).absolute())
    if config.runs("opd"):
        opd_trained = _vdir(opd_root, final_version + 1)
        gate_rollout, gate_checkpoint = run / "opd" / "rollout", opd_student
        final = opd_trained
    return PipelinePlan(
        base=str(base), base_version=base_version, sft_root=str(sft_root), sft=None if sft is None else str(sft),
        rl_start=str(start), rl_start_version=start_version, policy_root=str(policy_root),
        rollout_weights_root=str(weights_root),
        rl_dirs={i: str(p) for i, p in rl_dirs.items()}, rl_train_from={i: str(p) for i, p in train_from.items()},
        rl_sample_with={i: str(p) for i, p in sample_with.items()}, rl_trained={i: str(p) for i, p in trained.items()},
        opd_dir=str(run / "opd"), opd_student=str(opd_student), opd_root=str(opd_root),
        opd_trained=None if opd_trained is None else str(opd_trained),
        opd_default_teacher=default_teacher, opd_routes=routes, final=str(final), deploy=str(run / "deploy"),
        gate_rollout=None if gate_rollout is None else str(gate_rollout),
        gate_checkpoint=None if gate_checkpoint is None else str(gate_checkpoint), gate_out=str(run / "diff-logprobs"),
    )


def shell_assignments(config: PipelineConfig, steps: PipelinePlan) -> str:
    """``NAME=value`` lines (bash arrays for lists and per-iteration paths) for ``eval``."""
    q = shlex.quote

    def scalar(name: str, value: Any) -> str:
        if isinstance(value, bool):
            value = int(value)
        return f"{name}={q('' if value is None else str(value))}"

    def array(name: str, values: list[Any]) -> str:
        return f"{name}=({' '.join(q(str(v)) for v in values)})"

    def indexed(name: str, values: dict[int, str]) -> str:
        return f"{name}=({' '.join(f'[{i}]={q(v)}' for i, v in values.items())})"

    routes = [f"{domain}={path}" for domain, path in steps.opd_routes.items()]
    lines = [
        scalar("PIPELINE_RECIPE", config.recipe),
        scalar("PIPELINE_RUN_DIR", config.run_dir),
        array("PIPELINE_STAGES", config.stages),
        scalar("PIPELINE_LAUNCHER", config.launcher),
        scalar("PIPELINE_ITERATIONS", config.iterations if config.runs("rl") else 0),
        scalar("PIPELINE_ROLLOUT_TASKS", config.rollout_tasks),
        scalar("PIPELINE_TRAIN_RANKS", config.train_ranks),
        scalar("PIPELINE_TRAIN_NODES", config.train_nodes),
        scalar("PIPELINE_WORLD_SIZE", config.world_size),
        scalar("PIPELINE_SYNC_WEIGHTS", config.sync_weights),
        scalar("PIPELINE_SEED", config.seed),
        array("PIPELINE_SFT_DATA", config.sft_data),
        array("PIPELINE_PROMPTS", config.prompts),
        array("PIPELINE_OPD_PROMPTS", config.opd_prompts or config.prompts),
        scalar("PIPELINE_OPD_GROUP_SIZE", config.opd_group_size),
        scalar("PIPELINE_OPD_JUDGE", config.opd_judge),
        scalar("PIPELINE_BASE", steps.base),
        scalar("PIPELINE_SFT_ROOT", steps.sft_root),
        scalar("PIPELINE_SFT", steps.sft),
        scalar("PIPELINE_RL_START", steps.rl_start),
        scalar("PIPELINE_POLICY_ROOT", steps.policy_root),
        scalar("PIPELINE_ROLLOUT_WEIGHTS_ROOT", steps.rollout_weights_root),
        indexed("PIPELINE_RL_DIR", steps.rl_dirs),
        indexed("PIPELINE_RL_TRAIN_FROM", steps.rl_train_from),
        indexed("PIPELINE_RL_SAMPLE_WITH", steps.rl_sample_with),
        indexed("PIPELINE_RL_TRAINED", steps.rl_trained),
        scalar("PIPELINE_OPD_DIR", steps.opd_dir),
        scalar("PIPELINE_OPD_STUDENT", steps.opd_student),
        scalar("PIPELINE_OPD_ROOT", steps.opd_root),
        scalar("PIPELINE_OPD_TRAINED", steps.opd_trained),
        scalar("PIPELINE_OPD_DEFAULT_TEACHER", steps.opd_default_teacher),
        array("PIPELINE_OPD_ROUTES", routes),
        scalar("PIPELINE_FINAL", steps.final),
        scalar("PIPELINE_DEPLOY", steps.deploy),
        scalar("PIPELINE_GATE_ROLLOUT", steps.gate_rollout),
        scalar("PIPELINE_GATE_CHECKPOINT", steps.gate_checkpoint),
        scalar("PIPELINE_GATE_OUT", steps.gate_out),
        array("PIPELINE_SBATCH_ARGS", config.slurm.sbatch_args()),
        scalar("PIPELINE_JOB_NAME", config.slurm.job_name),
    ]
    return "\n".join(lines) + "\n"
