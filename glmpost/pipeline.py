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

``python -m glmpost.pipeline RECIPE --shell`` prints the plan as shell assignments for
``eval`` (the scripts use it); ``--json`` prints it as JSON. Errors are one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from glmpost.toml import tomllib

from glmpost.errors import GlmpostError, UsageError

STAGE_ORDER = ("init-model", "qat", "rl", "opd", "quantize", "diff-logprobs")
LAUNCHERS = ("cpu", "cuda", "npu")
TEACHER_REFS = ("base", "sft", "rl")  # checkpoints of earlier stages a cross-stage OPD teacher can be
SLURM_KEYS = {
    "partition": str,
    "account": str,
    "qos": str,
    "time": str,
    "job-name": str,
    "cpus-per-task": int,
    "mem": str,
    "gpus-per-node": int,
    "gres": str,
    "extra-args": list,
}


@dataclass
class SlurmConfig:
    """``[pipeline.slurm]``: sbatch resources shared by every job (extra-args are passed verbatim)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    job_name: str = "glmpost"
    cpus_per_task: int | None = None
    mem: str | None = None
    gpus_per_node: int | None = None
    gres: str | None = None
    extra_args: list[str] = field(default_factory=list)

    def sbatch_args(self) -> list[str]:
        """Options for every sbatch call (the job name is set per step)."""
        args = []
        for key in ("partition", "account", "qos", "time", "cpus_per_task", "mem", "gpus_per_node", "gres"):
            value = getattr(self, key)
            if value is not None:
                args.append(f"--{key.replace('_', '-')}={value}")
        return args + [str(a) for a in self.extra_args]


@dataclass
class PipelineConfig:
    """A validated ``[pipeline]`` section, with every path absolute."""

    recipe: Path
    stages: list[str]
    run_dir: Path
    base_checkpoint: Path | None = None
    sft_data: list[Path] = field(default_factory=list)
    prompts: list[Path] = field(default_factory=list)
    opd_prompts: list[Path] = field(default_factory=list)
    iterations: int = 1
    rollout_tasks: int = 1
    train_ranks: int = 1
    train_nodes: int = 1
    launcher: str = "cpu"
    sync_weights: bool = False
    opd_group_size: int = 1
    opd_judge: bool = False
    opd_default_teacher: str | None = "rl"
    teachers: dict[str, str] = field(default_factory=dict)
    seed: int = 0
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    unresolved: dict[str, str] = field(default_factory=dict)  # key -> path naming an unset ${VARIABLE}

    def runs(self, stage: str) -> bool:
        return stage in self.stages

    @property
    def world_size(self) -> int:
        return self.train_ranks * self.train_nodes


# key in the TOML -> (dataclass field, kind)
_KEYS: dict[str, tuple[str, str]] = {
    "stages": ("stages", "str-list"),
    "run-dir": ("run_dir", "path"),
    "base-checkpoint": ("base_checkpoint", "path"),
    "sft-data": ("sft_data", "path-list"),
    "prompts": ("prompts", "path-list"),
    "opd-prompts": ("opd_prompts", "path-list"),
    "iterations": ("iterations", "int"),
    "rollout-tasks": ("rollout_tasks", "int"),
    "train-ranks": ("train_ranks", "int"),
    "train-nodes": ("train_nodes", "int"),
    "launcher": ("launcher", "str"),
    "sync-weights": ("sync_weights", "bool"),
    "opd-group-size": ("opd_group_size", "int"),
    "opd-judge": ("opd_judge", "bool"),
    "opd-default-teacher": ("opd_default_teacher", "str"),
    "seed": ("seed", "int"),
}
_TABLES = ("slurm", "teachers")


def _type_ok(kind: str, value: Any) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind in ("str", "path"):
        return isinstance(value, str)
    if kind in ("str-list", "path-list"):
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return False


_KIND_WORDS = {"int": "an integer", "bool": "true or false", "str": "a string", "path": "a path string",
               "str-list": "a list of strings", "path-list": "a list of path strings"}


def load_pipeline(path: Path | str, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Read and validate RECIPE's ``[pipeline]`` (``overrides`` replace its keys, as ``--set`` does).

    Raises UsageError with one line naming the file and key: unknown keys, wrong types, a stage
    list that cannot run in that order, a missing data file or base checkpoint.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            recipe = tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"recipe {path} does not exist") from None
    except IsADirectoryError:
        raise UsageError(f"recipe {path} is a directory, not a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"recipe {path} is not valid TOML: {exc}") from None
    where = f"{path}: [pipeline]"
    section = recipe.get("pipeline")
    if not isinstance(section, dict):
        raise UsageError(f"recipe {path} has no [pipeline] table (which stages to run, run-dir, data)")
    section = {**section, **(overrides or {})}

    values: dict[str, Any] = {}
    unresolved: dict[str, str] = {}
    for key, value in section.items():
        if key in _TABLES:
            if not isinstance(value, dict):
                raise UsageError(f"{where} {key}: must be a table ([pipeline.{key}])")
            continue
        if key not in _KEYS:
            known = ", ".join(sorted([*_KEYS, *_TABLES]))
            raise UsageError(f"{where}: unknown key '{key}' (known: {known})")
        name, kind = _KEYS[key]
        if not _type_ok(kind, value):
            raise UsageError(f"{where} {key}: must be {_KIND_WORDS[kind]}, not {value!r}")
        if kind == "path":
            value = _path(value, key, unresolved)
        elif kind == "path-list":
            value = [_path(v, key, unresolved) for v in value]
        values[name] = value
    if "stages" not in values:
        raise UsageError(f"{where}: missing key 'stages' (a list among {', '.join(STAGE_ORDER)})")
    if "run_dir" not in values:
        raise UsageError(f"{where}: missing key 'run-dir' (the folder every step writes its output under)")
    values["slurm"] = _slurm_table(section.get("slurm", {}), where)
    values["teachers"] = _teachers_table(section.get("teachers", {}), where)
    config = PipelineConfig(recipe=path.absolute(), unresolved=unresolved, **values)
    _validate(config, where)
    return config


_VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def _path(text: str, key: str, unresolved: dict[str, str]) -> Path:
    """An absolute path with environment variables expanded; one naming an unset variable is noted."""
    expanded = os.path.expandvars(text)
    if _VARIABLE.search(expanded):
        unresolved.setdefault(key, text)
        return Path(text)
    return Path(expanded).absolute()


def require_resolved(config: PipelineConfig) -> None:
    """Refuse to plan a run while a path still names an unset environment variable."""
    for key, text in config.unresolved.items():
        names = [m.group(1) for m in _VARIABLE.finditer(text) if m.group(1) not in os.environ]
        raise UsageError(f"{config.recipe}: [pipeline] {key}: {text} names the unset environment variable "
                         f"{names[0] if names else text}; export it or pass --set {key}=...")


def _slurm_table(table: dict[str, Any], where: str) -> SlurmConfig:
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key not in SLURM_KEYS:
            raise UsageError(f"{where}.slurm: unknown key '{key}' (known: {', '.join(sorted(SLURM_KEYS))})")
        kind = SLURM_KEYS[key]
        ok = isinstance(value, kind) and not isinstance(value, bool)
        if kind is list:
            ok = ok and all(isinstance(v, str) for v in value)
        if not ok:
            raise UsageError(f"{where}.slurm {key}: must be {'a list of strings' if kind is list else kind.__name__}, not {value!r}")
        if kind is int and value < 1:
            raise UsageError(f"{where}.slurm {key}: must be at least 1, not {value}")
        out[key.replace("-", "_")] = value
    return SlurmConfig(**out)


def _teachers_table(table: dict[str, Any], where: str) -> dict[str, str]:
    for domain, ref in table.items():
        if not isinstance(ref, str):
            raise UsageError(f"{where}.teachers {domain}: must be {', '.join(TEACHER_REFS)} or a checkpoint path, not {ref!r}")
    return dict(table)


def _validate(config: PipelineConfig, where: str) -> None:
    stages = config.stages
    if not stages:
        raise UsageError(f"{where} stages: empty; name at least one of {', '.join(STAGE_ORDER)}")
    for stage in stages:
        if stage not in STAGE_ORDER:
            raise UsageError(f"{where} stages: unknown stage '{stage}' (known: {', '.join(STAGE_ORDER)})")
    for i, stage in enumerate(stages):
        if stage in stages[:i]:
            raise UsageError(f"{where} stages: '{stage}' is listed twice")
        later = [s for s in stages[:i] if STAGE_ORDER.index(s) > STAGE_ORDER.index(stage)]
        if later:
            raise UsageError(f"{where} stages: '{stage}' cannot run after '{later[0]}' "
                             f"(each stage consumes the one before; order: {', '.join(STAGE_ORDER)})")
    if "diff-logprobs" in stages and not ({"rl", "opd"} & set(stages)):
        raise UsageError(f"{where} stages: 'diff-logprobs' needs rollouts to check: add 'rl' or 'opd' before it")
    for name in ("iterations", "rollout_tasks", "train_ranks", "train_nodes", "opd_group_size"):
        if getattr(config, name) < 1:
            raise UsageError(f"{where} {name.replace('_', '-')}: must be at least 1, not {getattr(config, name)}")
    if config.launcher not in LAUNCHERS:
        raise UsageError(f"{where} launcher: '{config.launcher}' is not one of {', '.join(LAUNCHERS)}")

    if "init-model" in stages:
        if config.base_checkpoint is not None:
            raise UsageError(f"{where}: base-checkpoint and the 'init-model' stage both give the starting model; keep one")
    elif config.base_checkpoint is None:
        raise UsageError(f"{where}: missing key 'base-checkpoint' (the model to post-train), or put 'init-model' first in stages")
    elif "base-checkpoint" in config.unresolved:
        pass  # checked when a run is planned (require_resolved)
    elif not config.base_checkpoint.exists():
        raise UsageError(f"{where} base-checkpoint: {config.base_checkpoint} does not exist")
    else:
        _base_version(config, where)  # refuses a directory that is no checkpoint

    needs = {"qat": ("sft_data", "sft-data"), "rl": ("prompts", "prompts")}
    for stage, (name, key) in needs.items():
        if stage in stages and not getattr(config, name):
            raise UsageError(f"{where}: stage '{stage}' needs '{key}' (its input data files)")
    if "opd" in stages and not (config.opd_prompts or config.prompts):
        raise UsageError(f"{where}: stage 'opd' needs 'opd-prompts' (or 'prompts') to sample the student on")
    for key, files in (("sft-data", config.sft_data), ("prompts", config.prompts), ("opd-prompts", config.opd_prompts)):
        for file in files:
            if key in config.unresolved and _VARIABLE.search(str(file)):
                continue  # checked when a run is planned
            if not file.is_file():
                raise UsageError(f"{where} {key}: {file} does not exist")
    if "opd" in stages:
        refs = dict(config.teachers)
        if config.opd_default_teacher is not None:
            refs["(opd-default-teacher)"] = config.opd_default_teacher
        if not refs:
            raise UsageError(f"{where}: stage 'opd' needs a teacher: opd-default-teacher or a [pipeline.teachers] table")
        for domain, ref in refs.items():
            label = "opd-default-teacher" if domain == "(opd-default-teacher)" else f"teachers.{domain}"
            if ref == "sft" and "qat" not in stages:
                raise UsageError(f"{where} {label}: 'sft' names the qat stage's checkpoint, but stages has no 'qat'")
            if ref == "rl" and "rl" not in stages:
                raise UsageError(f"{where} {label}: 'rl' names the RL stage's final checkpoint, but stages has no 'rl'")
            if ref not in TEACHER_REFS and not Path(ref).exists():
                raise UsageError(f"{where} {label}: teacher checkpoint {ref} does not exist (or use {', '.join(TEACHER_REFS)})")


def _base_version(config: PipelineConfig, where: str) -> tuple[Path, int]:
    """The base checkpoint's version directory and policy version (0 for a plain HF directory)."""
    from glmpost.checkpoints import CheckpointError, read_manifest, resolve_checkpoint

    if "init-model" in config.stages:
        return config.run_dir / "model", 0
    assert config.base_checkpoint is not None
    try:
        directory = resolve_checkpoint(config.base_checkpoint)
    except CheckpointError as exc:
        raise UsageError(f"{where} base-checkpoint: {exc}") from None
    try:
        version = read_manifest(directory).policy_version
    except CheckpointError:
        version = 0
    return directory, version


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
    base, base_version = _base_version(config, where)
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


def _parse_override(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE in TOML (``iterations=2``, ``launcher="npu"``); a bare word is a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"--set {text}: expected KEY=VALUE (a [pipeline] key and a TOML value)")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m glmpost.pipeline",
        description="Validate a recipe's [pipeline] section and print its plan (paths of every step).",
    )
    parser.add_argument("recipe", help="TOML recipe with a [pipeline] section.")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="Override a [pipeline] key (TOML value); repeatable.")
    parser.add_argument("--run-dir", help="Override [pipeline] run-dir.")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--shell", action="store_true", help="Print bash assignments for eval.")
    mode.add_argument("--json", action="store_true", help="Print the configuration and plan as JSON.")
    args = parser.parse_args(argv)
    try:
        overrides = dict(_parse_override(s) for s in args.set)
        if args.run_dir:
            overrides["run-dir"] = args.run_dir
        config = load_pipeline(args.recipe, overrides)
        steps = plan(config)
    except GlmpostError as exc:
        sys.stderr.write(f"glmpost: error: {exc}\n")
        return exc.exit_code
    if args.shell:
        sys.stdout.write(shell_assignments(config, steps))
    elif args.json:
        payload = {"config": asdict(config), "plan": asdict(steps)}
        sys.stdout.write(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    else:
        sys.stdout.write(f"ok: {config.recipe}: stages {' -> '.join(config.stages)}; outputs under {config.run_dir}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
