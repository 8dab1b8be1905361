"""Print the peak memory per role that a recipe needs (`glmpost plan RECIPE`).

Follows the brief's decomposition (section "内存不是“参数量乘位宽”"): for each object of an RL / OPD
run -- actor, reference, teacher, critic, rollout KV cache, DSA index, teacher payload,
weight-sync buffer -- the bytes of model state (weights, gradients, optimizer states per ZeRO
stage and rank), saved activations, operator workspace, communication buffers and live IO, and
their sum as the role's peak. Roles the recipe does not use read '-'. Settings come from the
recipe's stage sections (micro-batch, chunk size, ZeRO stage, group size, max-new-tokens, rollout
batch, teacher payload, weight-sync quantization) and the model config (--model: a preset, a
config.json or a checkpoint). Options of this command can also be set in the recipe's [plan]
section (flags win). Model-state and KV-cache bytes are exact; activations and workspace are
estimates (see glmpost/memory_plan.py); the allocator's fragmentation is not modelled (--margin).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer

from glmpost.commands.common import print_summary
from glmpost.commands.options import json_option
from glmpost.errors import UsageError
from glmpost.memory_plan import (
    ModelShape,
    Workload,
    format_bytes,
    format_table,
    plan_memory,
)

TRAINING_STAGES = ("train-grpo", "opd-merge", "train-sao", "qat")
PLAN_DEFAULTS: dict[str, Any] = {
    "model": "tiny-glm5",
    "prompt_tokens": 256,
    "dtype": "bfloat16",
    "ranks": 1,
    "attention": "math",
    "margin": 0.0,
}


def model_config(spec: str) -> tuple[str, dict[str, Any]]:
    """``(description, config dict)`` from a preset name, a config.json file or a checkpoint."""
    from glmpost.models.tiny import PRESETS

    if spec in PRESETS:
        from glmpost.models.tiny import tiny_glm5_config

        return f"preset {spec}", tiny_glm5_config(**PRESETS[spec]).to_dict()
    if spec == "glm5":  # transformers' GlmMoeDsaConfig defaults are GLM-5's published dimensions
        from transformers import GlmMoeDsaConfig

        return "preset glm5 (transformers GlmMoeDsaConfig defaults)", GlmMoeDsaConfig().to_dict()
    path = Path(spec)
    if path.is_dir():
        from glmpost.checkpoints import CheckpointError, resolve_checkpoint

        try:
            path = resolve_checkpoint(path) / "config.json"
        except CheckpointError as exc:
            raise UsageError(f"--model {spec}: {exc}") from None
    if not path.is_file():
        raise UsageError(f"--model {spec}: not a preset (tiny-glm5, glm5), a config.json or a checkpoint")
    try:
        return str(path), json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(f"--model {spec}: {path} is not valid JSON ({exc})") from None


def workload_from_recipe(values: dict[str, dict[str, Any]], settings: dict[str, Any], commands: dict[str, Any]) -> Workload:
    """The run the recipe describes; stage defaults (``commands``: section -> command) fill what
    its sections leave out."""
    from glmpost.commands.recipe import stage_values

    def stage(name: str) -> dict[str, Any]:
        if name in values:
            return values[name]
        return stage_values(commands[name], {}) if name in commands else {}

    rollout = stage("rollout")
    training_name = next((s for s in TRAINING_STAGES if s in values), "train-grpo")
    train = stage(training_name)
    response = int(rollout.get("max_new_tokens") or 64)
    w = Workload(
        micro_batch=int(train.get("micro_batch_size") or 8),
        seq=settings["prompt_tokens"] + response,
        response_tokens=response,
        chunk_size=int(train.get("chunk_size") or 512),
        dtype=settings["dtype"],
        zero_stage=int(train.get("zero_stage") or 0),
        ranks=settings["ranks"],
        attention=settings["attention"],
        rollout_batch=int(rollout.get("batch_size") or 32),
        rollout_prompt=settings["prompt_tokens"],
        rollout_dtype=settings["dtype"],
        records_per_update=int(rollout.get("prompts_per_shard") or 1) * int(rollout.get("group_size") or 1),
        reference=training_name == "train-grpo" and float(train.get("kl_coef") or 0.0) > 0,
        teacher="score-teacher" in values or "opd-merge" in values,
        critic="train-sao" in values,
        training=any(s in values for s in TRAINING_STAGES),
        rollout="rollout" in values,
        margin=settings["margin"],
    )
    ds_path = train.get("deepspeed_config")
    if ds_path and Path(ds_path).is_file():
        try:
            ds = json.loads(Path(ds_path).read_text())
        except json.JSONDecodeError as exc:
            raise UsageError(f"--deepspeed {ds_path}: invalid JSON ({exc})") from None
        zero = ds.get("zero_optimization", {})
        w.zero_stage = int(zero.get("stage", w.zero_stage))
        w.reduce_bucket = int(zero.get("reduce_bucket_size", w.reduce_bucket))
        w.allgather_bucket = int(zero.get("allgather_bucket_size", w.allgather_bucket))
    teacher = values.get("score-teacher", {})
    merge = values.get("opd-merge", {})
    if teacher.get("payload") == "topk" or merge.get("loss") == "topk":
        w.teacher_payload = "topk"
        w.teacher_topk = int(teacher.get("topk") or merge.get("topk") or 0)
    if "sync-weights" in values:
        w.sync = True
        w.sync_quantize = str(values["sync-weights"].get("quantize") or "none")
    else:
        w.sync = w.rollout and w.training  # an RL iteration hands the new weights to the rollout engine
    return w


def plan(
    recipe: Path = typer.Argument(..., help="The TOML recipe whose stages to plan for.", dir_okay=False),
    model: str | None = typer.Option(
        None, "--model", help="Model: a preset (tiny-glm5, glm5), a config.json or a checkpoint (root or version). Default: tiny-glm5."),
    prompt_tokens: int | None = typer.Option(None, "--prompt-tokens", min=1, help="Prompt length in tokens (sequence = prompt + max-new-tokens). Default: 256."),
    dtype: str | None = typer.Option(None, "--dtype", help="Weight / activation dtype: bfloat16, float16 or float32. Default: bfloat16."),
    ranks: int | None = typer.Option(None, "--ranks", min=1, help="Data-parallel training ranks (ZeRO divides states by this). Default: [pipeline] train-ranks x train-nodes, else 1."),
    attention: str | None = typer.Option(
        None, "--attention", help="Attention kernel: math (torch SDPA math path, CPU), eager, or fused (flash / memory-efficient). Default: math."),
    margin: float | None = typer.Option(None, "--margin", min=0.0, help="Runtime margin as a fraction of each role's sum (the brief's M_runtime_margin). Default: 0."),
    as_json: bool = json_option("the plan"),
) -> None:
    from glmpost.commands.recipe import check_recipe, stage_commands, stage_values

    report = check_recipe(recipe)
    if report.errors:
        raise UsageError(f"{report.errors[0]} (see `glmpost recipe check {recipe}`)")
    given = {"model": model, "prompt_tokens": prompt_tokens, "dtype": dtype, "ranks": ranks, "attention": attention, "margin": margin}
    recipe_plan = report.stages.get("plan", {})
    world = getattr(report.pipeline, "world_size", None)
    defaults = {**PLAN_DEFAULTS, "ranks": int(world()) if callable(world) else 1}
    settings = {k: given[k] if given[k] is not None else recipe_plan.get(k) if recipe_plan.get(k) is not None else defaults[k]
                for k in PLAN_DEFAULTS}
    if settings["attention"] not in ("math", "eager", "fused"):
        raise UsageError(f"--attention {settings['attention']!r}: expected math, eager or fused")
    if settings["dtype"] not in ("bfloat16", "float16", "float32"):
        raise UsageError(f"--dtype {settings['dtype']!r}: expected bfloat16, float16 or float32")
    description, config = model_config(str(settings["model"]))
    try:
        shape = ModelShape.from_config(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"--model {settings['model']}: not a GLM-5 (GlmMoeDsa) config ({exc})") from None
    from glmpost.commands.app import app as glmpost_app

    commands = stage_commands(typer.main.get_command(glmpost_app))
    values = {name: stage_values(commands[name], given_values) for name, given_values in report.stages.items() if name != "plan"}
    workload = workload_from_recipe(values, settings, commands)
    rows = plan_memory(shape, workload)
    counts = shape.parameter_count()
    summary = {
        "recipe": str(recipe),
        "model": description,
        "parameters": counts,
        "workload": asdict(workload),
        "roles": {row.role: row.to_dict() for row in rows},
        "colocated_peak": sum(row.peak for row in rows if row.used),
        "not_modelled": "allocator fragmentation (M_allocator)",
    }
    human = "\n".join([
        (f"{recipe}: peak memory per role (brief: 内存不是“参数量乘位宽”), model {description}: "
        f"{counts['total']:,} parameters ({counts['trainable']:,} trainable; DSA indexer frozen)"),
        (f"train micro-batch {workload.micro_batch} x {workload.seq} tokens, {workload.dtype}, "
        f"ZeRO stage {workload.zero_stage} on {workload.ranks} rank(s), attention {workload.attention}, "
        f"log-prob chunk {workload.chunk_size}; rollout batch {workload.rollout_batch} x "
        f"{workload.rollout_prompt}+{workload.response_tokens} tokens"),
        "",
        format_table(rows),
        "",
        (f"exact: model state, KV cache, indexer cache; estimated: activations, workspace, buffers; "
        f"not modelled: allocator fragmentation. Co-located peak {format_bytes(summary['colocated_peak'])}."),
    ])
    print_summary(summary, as_json=as_json, human=human)
