"""The embedded default model: a tiny GLM-5-architecture causal LM built from a config.

``GlmMoeDsaForCausalLM`` (transformers >= 5.2) with every GLM-5 part present at toy size: MLA
attention (q/kv low-rank projections, rope/nope split), the DSA lightning indexer with a small
``index_topk`` (so sparse top-k selection really happens on short sequences), MoE layers with routed
and shared experts after ``first_k_dense_replace`` dense layers. Dimensions follow
``shared/notes/tiny-glm5-rl-facts.md`` (~180k parameters at vocab 512): a size that learns a toy
task with GRPO on one CPU in under a minute.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from glmpost.checkpoints import CheckpointManifest, tokenizer_revision, write_manifest
from glmpost.config import ConfigError, setting, shared
from glmpost.errors import UsageError
from glmpost.models.tokenizer import stop_token_ids, train_tokenizer
from glmpost.stage import MetricsWriter, log, write_stage_json

TINY_GLM5: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "index_topk": 8,
    "index_head_dim": 32,
    "index_n_heads": 4,
    "max_position_embeddings": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}

# Agentic recipes: multi-turn trajectories (turns plus observations) need a longer context; the
# same weights' shapes otherwise (rope positions are not parameters).
TINY_GLM5_AGENTIC: dict[str, Any] = {**TINY_GLM5, "max_position_embeddings": 4096}

PRESETS: dict[str, dict[str, Any]] = {"tiny-glm5": TINY_GLM5, "tiny-glm5-agentic": TINY_GLM5_AGENTIC}
DTYPES = ("float32", "bfloat16")
STAGE = "init-model"


@dataclass
class InitModelConfig:
    """The settings of ``glmpost init-model`` (its options, under the same names); refusals name these fields."""

    out: Optional[Path] = None  # the checkpoint directory (the caller stages it)
    preset: str = setting("tiny-glm5", f"Model preset: {', '.join(PRESETS)}.")
    seed: int = setting(0, "Seed of the weight initialisation; the same seed gives identical files.")
    index_topk: Optional[int] = setting(
        None, "DSA indexer top-k (keys each query may attend to); default from the preset (8).")
    overrides: list[str] = setting(
        [], "Override any GlmMoeDsaConfig field, KEY=VALUE with a JSON value (repeatable).", flag="--set")
    dtype: str = setting("float32", "Dtype the weights are saved in: float32 or bfloat16.")
    overwrite: bool = shared("overwrite")

    def model_settings(self) -> dict[str, Any]:
        """The checkpoint's ``GlmMoeDsaConfig`` fields (:func:`model_settings`), the dtype checked first."""
        if self.dtype not in DTYPES:
            raise ConfigError("{dtype} {value!r}: expected float32 or bfloat16", value=self.dtype)
        return model_settings(self.preset, parse_overrides(self.overrides), index_topk=self.index_topk)


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``overrides`` (``--set key=value``) pairs; values are JSON (numbers, lists, true/false), else strings."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError("{overrides} {item!r}: expected KEY=VALUE, e.g. {overrides} hidden_size=128", item=item)
        try:
            overrides[key] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key] = raw
    return overrides


def tiny_glm5_config(**overrides: Any):
    """A ``GlmMoeDsaConfig`` for the tiny preset; keyword arguments override any field."""
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(**{**TINY_GLM5, **overrides})


def build_model(config, *, seed: int):
    """A randomly initialised ``GlmMoeDsaForCausalLM``, identical for the same config and seed."""
    from transformers import GlmMoeDsaForCausalLM

    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = GlmMoeDsaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.float().eval()


def model_settings(preset: str, overrides: dict[str, Any], *, index_topk: int | None = None) -> dict[str, Any]:
    """A preset's ``GlmMoeDsaConfig`` fields with ``overrides`` (and ``index_topk``) applied; an
    unknown preset or field is refused naming the config field (``preset``, ``overrides``)."""
    from transformers import GlmMoeDsaConfig

    if preset not in PRESETS:
        raise ConfigError("{preset} {value!r}: unknown preset (known: {known})", value=preset, known=", ".join(PRESETS))
    settings = {**PRESETS[preset], **overrides}
    if index_topk is not None:
        settings["index_topk"] = index_topk
    unknown = sorted(set(settings) - set(GlmMoeDsaConfig.__dataclass_fields__) - {"rope_parameters"})
    if unknown:
        raise ConfigError("{overrides}: unknown GlmMoeDsaConfig field(s): {names}", names=", ".join(unknown))
    return settings


def write_tiny_checkpoint(directory, settings: dict[str, Any], *, preset: str, seed: int, dtype: str) -> dict[str, Any]:
    """Train the tokenizer, build the model with ``seed``, save both and ``glmpost.json`` (policy
    version 0) into ``directory``; returns the facts ``init-model`` reports and logs."""
    import time

    from transformers import GlmMoeDsaConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    log(f"training a {settings['vocab_size']}-id byte-level BPE tokenizer on the shipped task text")
    tokenizer = train_tokenizer(settings["vocab_size"])
    stops = stop_token_ids(tokenizer)
    settings = {**settings, "eos_token_id": stops, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None}
    try:
        model_config = GlmMoeDsaConfig(**settings)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"model config: {exc}") from None
    model = build_model(model_config, seed=seed)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.generation_config.eos_token_id = stops
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    revision = tokenizer_revision(directory)
    write_manifest(directory, CheckpointManifest(policy_version=0, tokenizer_revision=revision, stage="init-model",
                                                 step=0, parent=None, extra={"preset": preset, "seed": seed}))
    return {"parameters": sum(p.numel() for p in model.parameters()), "vocab_size": model_config.vocab_size,
            "index_topk": model_config.index_topk, "tokenizer_size": len(tokenizer), "tokenizer_revision": revision,
            "seconds": round(time.perf_counter() - started, 3)}


def init_model_run(config: InitModelConfig, settings: dict[str, Any], staging: Path, options: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Write the checkpoint of ``settings`` (:meth:`InitModelConfig.model_settings`), ``metrics.jsonl``
    and ``stage.json`` (recording ``options``) into ``staging``; ``(summary, human line)``."""

    facts = write_tiny_checkpoint(staging, settings, preset=config.preset, seed=config.seed, dtype=config.dtype)
    with MetricsWriter(staging / "metrics.jsonl") as metrics:
        metrics.write(**{"init/parameters": facts["parameters"], "init/vocab_size": facts["vocab_size"],
                         "init/tokenizer_size": facts["tokenizer_size"], "init/seconds": facts["seconds"]})
    write_stage_json(staging, STAGE, options)
    summary = {"out": str(config.out), "preset": config.preset, "parameters": facts["parameters"],
               "vocab_size": facts["vocab_size"], "index_topk": facts["index_topk"], "policy_version": 0,
               "tokenizer_revision": facts["tokenizer_revision"]}
    human = (
        f"{config.out}: {config.preset} GlmMoeDsaForCausalLM, {facts['parameters']:,} parameters, vocab {facts['vocab_size']}, "
        f"DSA index_topk {facts['index_topk']}, policy version 0, tokenizer {facts['tokenizer_revision']}"
    )
    return summary, human
