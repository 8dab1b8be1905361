"""Print the peak memory per role that a recipe needs (`glmpost plan RECIPE`).

Follows the brief's decomposition (section "内存不是“参数量乘位宽”"): for each object of an RL / OPD
run -- actor, reference, teacher, critic, rollout KV cache, DSA index, teacher payload,
weight-sync buffer -- the bytes of model state (weights, gradients, optimizer states per ZeRO
stage and rank), saved activations, operator workspace, communication buffers and live IO, and
their sum as the role's peak. Roles the recipe does not use read '-'. Settings come from the
recipe's stage sections (micro-batch, chunk size, ZeRO stage, group size, max-new-tokens, rollout
batch, teacher payload, weight-sync quantization) and the model config (--model: a preset, a
config.json or a checkpoint). Options of this command can also be set in the recipe's [plan]
section (flags win). Each object is then described: its layout, producer, consumer, owner and lifetime.
Model-state and KV-cache bytes are exact; activations and workspace are
estimates (see glmpost/memory/plan.py); the allocator's fragmentation is not modelled (--margin).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer

from glmpost.commands.common import print_summary, stage_commands
from glmpost.commands.options import json_option
from glmpost.commands.recipe_checks import check_recipe, stage_values
from glmpost.errors import UsageError, first_line
from glmpost.memory.plan import ModelShape
from glmpost.memory.recipe import model_config, workload_from_recipe
from glmpost.memory.roles import format_bytes, format_objects, format_table, memory_objects, plan_memory

PLAN_DEFAULTS: dict[str, Any] = {
    "model": "tiny-glm5",
    "prompt_tokens": 256,
    "dtype": "bfloat16",
    "ranks": 1,
    "attention": None,
    "margin": 0.0,
}


def plan(
    ctx: typer.Context,
    recipe: Path = typer.Argument(..., help="The TOML recipe whose stages to plan for.", dir_okay=False),
    model: str | None = typer.Option(
        None, "--model", help="Model: a preset (tiny-glm5, glm5), a config.json or a checkpoint (root or version). Default: tiny-glm5."),
    prompt_tokens: int | None = typer.Option(None, "--prompt-tokens", min=1, help="Prompt length in tokens (sequence = prompt + max-new-tokens). Default: 256."),
    dtype: str | None = typer.Option(None, "--dtype", help="Weight / activation dtype: bfloat16, float16 or float32. Default: bfloat16."),
    ranks: int | None = typer.Option(None, "--ranks", min=1, help="Data-parallel training ranks (ZeRO divides states by this). Default: [pipeline] train-ranks x train-nodes, else 1."),
    attention: str | None = typer.Option(
        None, "--attention", help="Attention path: native (glmpost's GLM-5 attention over the DSA top-k keys), or transformers' "
        "reference with its kernel: math (torch SDPA math path, CPU), eager, or fused (flash / memory-efficient). Default: the "
        "training stage's --attention (native; reference plans as math)."),
    margin: float | None = typer.Option(None, "--margin", min=0.0, help="Runtime margin as a fraction of each role's sum (the brief's M_runtime_margin). Default: 0."),
    as_json: bool = json_option("the plan"),
) -> None:
    root = ctx.find_root().command  # the glmpost command, whose subcommands are the stages
    report = check_recipe(recipe, root=root)
    if report.errors:
        raise UsageError(f"{report.errors[0]} (see `glmpost recipe check {recipe}`)")
    given = {"model": model, "prompt_tokens": prompt_tokens, "dtype": dtype, "ranks": ranks, "attention": attention, "margin": margin}
    settings = _settings(report, given)
    description, config = model_config(str(settings["model"]))
    try:
        shape = ModelShape.from_config(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"--model {settings['model']}: not a causal LM config transformers knows ({first_line(exc)})") from None
    commands = stage_commands(root)
    values = {name: stage_values(commands[name], given_values) for name, given_values in report.stages.items() if name != "plan"}
    workload = workload_from_recipe(values, settings, lambda name: stage_values(commands[name], {}) if name in commands else {})
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
        "objects": {role: asdict(facts) for role, facts in memory_objects(workload.attention).items()},
    }
    human = _human(recipe, description, counts, workload, rows, summary)
    print_summary(summary, as_json=as_json, human=human)


def _settings(report, given: dict) -> dict:
    """Each plan setting: the command line's, else the recipe's ``[plan]``, else the default."""
    recipe_plan = report.stages.get("plan", {})
    defaults = {**PLAN_DEFAULTS, "ranks": report.pipeline.world_size if report.pipeline is not None else 1}
    settings = {k: given[k] if given[k] is not None else recipe_plan.get(k) if recipe_plan.get(k) is not None else defaults[k]
                for k in PLAN_DEFAULTS}
    if settings["attention"] not in (None, "native", "math", "eager", "fused"):
        raise UsageError(f"--attention {settings['attention']!r}: expected native, math, eager or fused")
    if settings["dtype"] not in ("bfloat16", "float16", "float32"):
        raise UsageError(f"--dtype {settings['dtype']!r}: expected bfloat16, float16 or float32")
    return settings


def _human(recipe: Path, description: str, counts: dict, workload, rows: list, summary: dict) -> str:
    """The plan as a table with its workload above and what it models below."""
    return "\n".join([
        (f"{recipe}: peak memory per role (brief: 内存不是“参数量乘位宽”), model {description}: "
        f"{counts['total']:,} parameters ({counts['trainable']:,} trainable; DSA indexer frozen)"),
        (f"train micro-batch {workload.micro_batch} x {workload.seq} tokens, {workload.dtype}, "
        f"ZeRO stage {workload.zero_stage} on {workload.ranks} rank(s), attention {workload.attention}, "
        f"log-prob chunk {workload.chunk_size}; rollout batch {workload.rollout_batch} x "
        f"{workload.rollout_prompt}+{workload.response_tokens} tokens"),
        *([f"actor: a LoRA adapter of rank {workload.lora_rank} ({summary['roles']['actor']['details']['lora_parameters']:,} "
           f"parameters on {', '.join(workload.lora_targets or ('the default targets',))}) over the frozen base"]
          if workload.lora_rank else []),
        "",
        format_table(rows),
        "",
        (f"exact: model state, KV cache, indexer cache; estimated: activations, workspace, buffers; "
        f"not modelled: allocator fragmentation. Co-located peak {format_bytes(summary['colocated_peak'])}."),
        "",
        format_objects(memory_objects(workload.attention)),
    ])
