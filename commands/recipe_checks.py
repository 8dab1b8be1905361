"""A recipe as the command tree reads it: every stage section checked against that stage's options
(`glmpost recipe check`), and the values each stage would run with (`glmpost plan`).

Not a command: the helpers the ``recipe`` and ``plan`` commands share.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import typer

from glmpost.commands.common import PIPELINE_SECTION, stage_commands
from glmpost.commands.options import flag_of
from glmpost.config import ConfigError
from glmpost.errors import GlmpostError
from glmpost.pipeline import load_pipeline
from glmpost.rl.batch_rules import batch_arithmetic
from glmpost.rl.configs import GRPOConfig, OPDConfig
from glmpost.rl.deepspeed_settings import deepspeed_config
from glmpost.rl.distributed import OptimizerConfig
from glmpost.rl.sao import SAOConfig
from glmpost.rl.sft import SFTConfig
from glmpost.toml import load_recipe

# Values of path parameters with these suffixes are input files no stage writes: they must exist.
INPUT_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".pq", ".csv", ".toml")
# Sections that are not stages.
# Commands that read their recipe section from a positional RECIPE (not --config).

_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


@dataclass
class RecipeReport:
    """What ``check_recipe`` found: values per stage (converted as the stage converts them)."""

    path: Path
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    pipeline: Any = None
    ranks: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": str(self.path),
            "ok": not self.errors,
            "stages": {name: {"options": sorted(values)} for name, values in self.stages.items()},
            "errors": self.errors,
            "warnings": self.warnings,
            "ranks": self.ranks,
        }


def option_lookup(command: Any) -> dict[str, Any]:
    """Recipe key (flag without dashes, or Python name; dashes = underscores) -> parameter,
    exactly as ``commands.common`` reads a section."""
    params: dict[str, Any] = {}
    for p in command.params:
        if p.name in ("config", "help") or p.name in ("recipe",) and p.param_type_name == "argument":
            continue
        params[p.name] = p
        for opt in p.opts:
            if opt.startswith("--"):
                params[opt[2:].replace("-", "_")] = p
    return params


def known_keys(command: Any) -> list[str]:
    params = option_lookup(command).values()
    return sorted({o[2:] for p in params for o in p.opts if o.startswith("--")}
                  | {p.name.replace("_", "-") for p in params if p.param_type_name == "argument"})


def _message(exc: BaseException) -> str:
    text = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    return " ".join(text.split())


def convert_value(command: Any, param: Any, value: Any) -> Any:
    """The value the stage would see, converted by the option's own type (raises on a bad one)."""
    if param.param_type_name == "argument":
        value = [str(s) for s in value] if isinstance(value, list) else [str(value)]
    elif getattr(param, "multiple", False) and not isinstance(value, list):
        raise ValueError(f"expects a list (a TOML array such as [{value!r}]), got {type(value).__name__} {value!r}")
    ctx = command.context_class(command, info_name=command.name)
    return param.process_value(ctx, value)  # the option's coercion (and checks), as for a flag


def default_value(command: Any, param: Any) -> Any:
    ctx = command.context_class(command, info_name=command.name)
    return param.get_default(ctx, call=True)


def _input_paths(param: Any, value: Any) -> list[str]:
    """Values of a path-like parameter that name input files (not --out, not globs)."""
    if param.name == "out":
        return []
    descriptor = getattr(param, "type_descriptor", None)
    is_path = bool(getattr(descriptor, "is_path", False)) or param.param_type_name == "argument" or param.name == "eval"
    if not is_path:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    return [str(v) for v in values if isinstance(v, (str, Path)) and str(v).endswith(INPUT_FILE_SUFFIXES)
            and not any(c in str(v) for c in "*?[")]


def check_section(report: RecipeReport, name: str, command: Any, section: dict[str, Any]) -> None:
    where = f"{report.path}: [{name}]"
    params = option_lookup(command)
    values: dict[str, Any] = {}
    for key, setting in section.items():
        param = params.get(key.replace("-", "_"))
        if param is None:  # a sub-table too: --config refuses it the same way
            unknown = f"sub-table [{name}.{key}]" if isinstance(setting, dict) else f"key '{key}'"
            report.errors.append(f"{where}: unknown {unknown} (known: {', '.join(known_keys(command))})")
            continue
        try:
            converted = convert_value(command, param, setting)
        except (_ClickException, GlmpostError, ValueError, TypeError) as exc:
            report.errors.append(f"{where} {key}: {_message(exc)}")
            continue
        for path in _input_paths(param, setting):
            if not Path(path).exists():
                report.errors.append(f"{where} {key}: input file {path} does not exist (relative to {Path.cwd()})")
        values[param.name] = converted
    report.stages[name] = values


def stage_values(command: Any, given: dict[str, Any]) -> dict[str, Any]:
    """Every option of a stage: the recipe's converted value, else the command's default."""
    out = {}
    for p in command.params:
        if p.name in ("config", "help"):
            continue
        out[p.name] = given[p.name] if p.name in given else default_value(command, p)
    return out


def check_pipeline(report: RecipeReport) -> None:
    """``[pipeline]``: its keys (declared once, as :class:`glmpost.pipeline.PipelineConfig`'s
    settings) and what they name, checked as the pipeline scripts will load them."""

    try:
        report.pipeline = load_pipeline(report.path)
    except GlmpostError as exc:
        text = _message(exc)
        report.errors.append(text if str(report.path) in text else f"{report.path}: [{PIPELINE_SECTION}]: {text}")


# ----------------------------------------------------------------------------------------------
# Batch arithmetic and trainer settings


def trainer_config_errors(stage: str, values: dict[str, Any], command: Any) -> list[str]:
    """Run the trainer's own ``validate()`` and DeepSpeed-config checks on the section's values."""

    errors = []
    config_class = {"train-grpo": GRPOConfig, "train-sao": SAOConfig, "qat": SFTConfig, "opd-merge": OPDConfig}.get(stage)
    if config_class is not None:
        names = {f.name for f in fields(config_class)}
        kwargs = {k: v for k, v in values.items() if k in names and v is not None}
        try:
            config_class(**kwargs).validate()
        except (ValueError, TypeError) as exc:
            errors.append(f"{_message(exc).replace('_', '-')}")
    if "zero_stage" in values or "deepspeed_config" in values:
        ds_path = values.get("deepspeed_config")
        zero = values.get("zero_stage")
        if zero is not None or (ds_path is not None and Path(ds_path).exists()):
            try:
                deepspeed_config(OptimizerConfig(), zero_stage=zero, path=Path(ds_path) if ds_path else None)
            except ConfigError as exc:
                errors.append(exc.spelled(lambda name: flag_of(command, name)))
    return errors


def check_recipe(path: Path, *, root: Any, ranks: int | None = None) -> RecipeReport:
    """Every check of ``glmpost recipe check`` against the stages of ``root`` (the glmpost command);
    problems are collected, not raised.

    ``ranks`` (data-parallel training ranks) defaults to the ``[pipeline]``'s train-ranks x
    train-nodes, else 1.
    """
    report = RecipeReport(Path(path))
    recipe = load_recipe(report.path)
    commands = stage_commands(root)
    groups = {name.split(".")[0] for name in commands if "." in name}

    def visit(table: dict[str, Any], prefix: str) -> None:
        for key, section in table.items():
            name = f"{prefix}.{key}" if prefix else key
            if not prefix and key == PIPELINE_SECTION:
                check_pipeline(report)
            elif name in commands:
                if not isinstance(section, dict):
                    report.errors.append(f"{report.path}: [{name}] must be a table, got {type(section).__name__}")
                else:
                    check_section(report, name, commands[name], section)
            elif name in groups and isinstance(section, dict):
                visit(section, name)
            else:
                known = sorted([*commands, PIPELINE_SECTION])
                report.errors.append(f"{report.path}: unknown section [{name}] (known: {', '.join(known)})")

    visit(recipe, "")
    if ranks is None:
        ranks = report.pipeline.world_size if report.pipeline is not None else 1
    report.ranks = ranks
    everything = {name: stage_values(commands[name], given) for name, given in report.stages.items()}
    for name, values in everything.items():
        for message in trainer_config_errors(name, values, commands[name]):
            report.errors.append(f"{report.path}: [{name}] {message}")
    errors, warnings = batch_arithmetic(everything, ranks=ranks)
    report.errors.extend(f"{report.path}: [{s}] {m}" for s, m in errors)
    report.warnings.extend(f"{report.path}: [{s}] {m}" for s, m in warnings)
    return report
