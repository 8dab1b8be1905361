"""The ``[pipeline]`` section of a recipe, read and validated (see :mod:`glmpost.pipeline`)."""

from __future__ import annotations

import os
import re
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from glmpost.checkpoints import CheckpointError, read_manifest, resolve_checkpoint
from glmpost.config import setting
from glmpost.errors import UsageError
from glmpost.toml import load_recipe

# The stages a recipe may list, in the order they run (each has its steps in steps.PIPELINE_STAGES).
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
    """A validated ``[pipeline]`` section, with every path absolute. A field with help text is a key
    of the section (``run_dir`` is ``run-dir``): its type and bounds are what the key accepts."""

    recipe: Path
    stages: list[str] = setting([], f"The stages to run, in this order; any subset of {', '.join(STAGE_ORDER)} that can run.")
    run_dir: Path = setting(None, "The folder every step writes its output under.")
    base_checkpoint: Path | None = setting(None, "The model to post-train (or put init-model first in stages).")
    sft_data: list[Path] = setting([], "qat's input data files.")
    prompts: list[Path] = setting([], "Reasoning RL prompt files.")
    opd_prompts: list[Path] = setting([], "Prompt files the OPD student samples on (default: prompts).")
    iterations: int = setting(1, "RL policy updates.", min=1)
    rollout_tasks: int = setting(1, "Tasks splitting each rollout (Slurm array size, --num-shards).", min=1)
    train_ranks: int = setting(1, "Training ranks per node (DeepSpeed data parallel).", min=1)
    train_nodes: int = setting(1, "Nodes of each training step.", min=1)
    launcher: str = setting("cpu", f"The environment and device of every job: {', '.join(LAUNCHERS)}.")
    sync_weights: bool = setting(False, "Publish every new policy as the rollout checkpoint the next iteration samples.")
    opd_group_size: int = setting(1, "Samples per OPD prompt (the brief: 1).", min=1)
    opd_judge: bool = setting(False, "Judge the OPD rollouts (opd-merge's task advantage needs rewards).")
    opd_default_teacher: str | None = setting("rl", f"Teacher of domains without a route: {', '.join(TEACHER_REFS)} or a checkpoint path.")
    teachers: dict[str, str] = field(default_factory=dict)  # [pipeline.teachers]: domain -> teacher
    seed: int = setting(0, "Base seed of the rollouts (iteration i samples with seed + i, OPD with seed + 1000).")
    slurm: SlurmConfig = field(default_factory=SlurmConfig)  # [pipeline.slurm]
    unresolved: dict[str, str] = field(default_factory=dict)  # key -> path naming an unset ${VARIABLE}

    def runs(self, stage: str) -> bool:
        return stage in self.stages

    @property
    def world_size(self) -> int:
        return self.train_ranks * self.train_nodes


def _section_keys() -> dict[str, tuple[str, str]]:
    """Key in the TOML -> (field, kind), from :class:`PipelineConfig`'s settings."""
    kinds = {int: "int", bool: "bool", str: "str", Path: "path", list[str]: "str-list", list[Path]: "path-list",
             Path | None: "path", str | None: "str"}
    hints = typing.get_type_hints(PipelineConfig)
    return {f.name.replace("_", "-"): (f.name, kinds[hints[f.name]]) for f in fields(PipelineConfig) if "help" in f.metadata}


_KEYS = _section_keys()
_TABLES = ("slurm", "teachers")


def _type_ok(kind: str, value: Any) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind in ("str", "path"):
        return isinstance(value, str)
    return isinstance(value, list) and all(isinstance(v, str) for v in value)  # str-list, path-list


_KIND_WORDS = {"int": "an integer", "bool": "true or false", "str": "a string", "path": "a path string",
               "str-list": "a list of strings", "path-list": "a list of path strings"}
def load_pipeline(path: Path | str, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Read and validate RECIPE's ``[pipeline]`` (``overrides`` replace its keys, as ``--set`` does).

    Raises UsageError with one line naming the file and key: unknown keys, wrong types, a stage
    list that cannot run in that order, a missing data file or base checkpoint.
    """
    path = Path(path)
    recipe = load_recipe(path)
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
                         f"{names[0] if names else text}; export it or pass `--set {key}=...`")


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
    _check_stage_order(config.stages, where)
    for f in fields(config):
        low = f.metadata.get("min")
        if low is not None and getattr(config, f.name) < low:
            raise UsageError(f"{where} {f.name.replace('_', '-')}: must be at least {low}, not {getattr(config, f.name)}")
    if config.launcher not in LAUNCHERS:
        raise UsageError(f"{where} launcher: '{config.launcher}' is not one of {', '.join(LAUNCHERS)}")
    _check_base_checkpoint(config, where)
    _check_inputs(config, where)


def _check_stage_order(stages: list[str], where: str) -> None:
    """Known stages, each once, in :data:`STAGE_ORDER`."""
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


def _check_base_checkpoint(config: PipelineConfig, where: str) -> None:
    """One starting model: ``base-checkpoint`` (a checkpoint) or the ``init-model`` stage."""
    stages = config.stages
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
        base_checkpoint_version(config, where)  # refuses a directory that is no checkpoint


def _check_inputs(config: PipelineConfig, where: str) -> None:
    """The data files and teachers the stages read."""
    stages = config.stages
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


def base_checkpoint_version(config: PipelineConfig, where: str) -> tuple[Path, int]:
    """The base checkpoint's version directory and policy version (0 for a plain HF directory)."""

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
