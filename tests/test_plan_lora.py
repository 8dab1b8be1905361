"""``glmpost plan``'s LoRA count (issue 45: "plan counts LoRA"): the adapter's parameters per target,
exact against PEFT's adapter on the model built for real, on every architecture plan knows."""

from __future__ import annotations

import json

import pytest
import torch
from test_plan_architectures import CONFIGS, _model

from glmpost.kernel.loading import load_weights
from glmpost.kernel.lora import LoraSettings, default_targets, peft_config
from glmpost.memory.lora import default_target_names, lora_parameter_count
from glmpost.memory.plan import ModelShape


def _peft_counts(model, settings: LoraSettings) -> dict[str, int]:
    from peft import get_peft_model

    wrapped = get_peft_model(model, peft_config(settings, model))
    counts: dict[str, int] = {}
    for name, parameter in wrapped.named_parameters():
        if "lora_" not in name:
            continue
        parts = name.split(".")
        at = next(i for i, part in enumerate(parts) if part in ("lora_A", "lora_B"))
        target = parts[at - 2] if parts[at - 1] == "base_layer" else parts[at - 1]  # experts: ParamWrapper nests
        counts[target] = counts.get(target, 0) + parameter.numel()
        assert parameter.requires_grad
    return counts


def _models(tiny_checkpoint):
    yield "glm5", load_weights(tiny_checkpoint, torch.float32), json.loads((tiny_checkpoint / "config.json").read_text())
    for name in sorted(CONFIGS):
        yield name, _model(name), dict(CONFIGS[name])


@pytest.mark.parametrize("rank", [4, 16])
def test_lora_parameter_counts_equal_pefts_on_every_architecture(tiny_checkpoint, rank):
    for name, model, config in _models(tiny_checkpoint):
        shape = ModelShape.from_config(config)
        assert default_target_names(shape) == default_targets(model), name
        expected = _peft_counts(model, LoraSettings(rank, 8.0, None))
        counted = lora_parameter_count(shape, rank)
        assert {k: v for k, v in counted.items() if k != "total"} == expected, name
        assert counted["total"] == sum(expected.values()) > 0


def test_explicit_targets_and_rank_zero(tiny_checkpoint):
    model = load_weights(tiny_checkpoint, torch.float32)
    shape = ModelShape.from_config(json.loads((tiny_checkpoint / "config.json").read_text()))
    settings = LoraSettings(8, 16.0, ("kv_b_proj", "experts"))
    assert lora_parameter_count(shape, 8, ("kv_b_proj", "experts")) == {**_peft_counts(model, settings), "total": 8 * 2 * (32 + 128) + 8 * 4 * (64 + 64 + 32 + 64)}
    assert lora_parameter_count(shape, 0) == {"total": 0}


def test_the_actors_plan_with_lora_holds_the_frozen_base_and_the_adapters_states(tiny_checkpoint):
    from glmpost.memory.roles import Workload, plan_memory

    shape = ModelShape.from_config(json.loads((tiny_checkpoint / "config.json").read_text()))
    full = {r.role: r for r in plan_memory(shape, Workload(dtype="bfloat16", precision="bf16"))}
    lora = {r.role: r for r in plan_memory(shape, Workload(dtype="bfloat16", precision="bf16", lora_rank=16))}
    n, p = lora_parameter_count(shape, 16)["total"], shape.parameter_count()
    base = (p["total"] - p["fp32_kept"]) * 2 + p["fp32_kept"] * 4  # bf16, the router and indexer weights in float32
    actor = lora["actor"].details
    assert (actor["weights"], actor["grads"], actor["optimizer"], actor["lora_parameters"]) == (base + 4 * n, 4 * n, 8 * n, n)
    assert lora["actor"].model_state < full["actor"].model_state
    assert lora["critic"].model_state == full["critic"].model_state  # SAO's critic stays a full model
    assert actor["workspace"]["lora_experts_delta"] == 2 * 4 * shape.experts * 3 * shape.hidden * shape.moe_intermediate
    zero3 = {r.role: r for r in plan_memory(shape, Workload(dtype="bfloat16", lora_rank=16, zero_stage=3, ranks=2))}["actor"].details
    assert (zero3["weights"], zero3["grads"], zero3["optimizer"]) == (-(-(base + 4 * n) // 2), 2 * n, 4 * n)


def test_a_recipes_lora_rank_is_counted_by_plan(glmpost_cli, tmp_path):
    """``[train-grpo] lora-rank = 8`` (the option train-grpo takes): ``glmpost plan`` of the recipe
    plans the actor as the adapter's (its parameters, grads and AdamW states) over the frozen base;
    ``lora-targets`` narrows it; the same recipe without it plans full fine-tuning."""
    from glmpost.memory.recipe import model_config

    shape = ModelShape.from_config(model_config("tiny-glm5")[1])
    plans = {}
    for name, section in (("full", ""), ("lora", "lora-rank = 8\n"), ("narrow", 'lora-rank = 8\nlora-targets = ["kv_b_proj"]\n')):
        recipe = tmp_path / f"{name}.toml"
        recipe.write_text(f'[plan]\ndtype = "float32"\n[train-grpo]\nprecision = "fp32"\n{section}')
        result = glmpost_cli("plan", recipe, "--json")
        assert result.exit_code == 0, result.stderr
        plans[name] = json.loads(result.stdout)
    full, lora, narrow = (plans[n]["roles"]["actor"]["details"] for n in ("full", "lora", "narrow"))
    assert plans["lora"]["workload"]["lora_rank"] == 8 and plans["full"]["workload"]["lora_rank"] == 0
    n = lora_parameter_count(shape, 8)["total"]
    assert (lora["lora_parameters"], lora["grads"], lora["optimizer"]) == (n, 4 * n, 8 * n)
    assert lora["optimizer"] < full["optimizer"] and "lora_parameters" not in full
    assert narrow["lora_parameters"] == lora_parameter_count(shape, 8, ("kv_b_proj",))["total"] < n
    table = glmpost_cli("plan", tmp_path / "lora.toml")
    assert table.exit_code == 0 and f"actor: a LoRA adapter of rank 8 ({n:,} parameters on the default targets)" in table.stdout
