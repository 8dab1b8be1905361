"""A recipe's run as the memory plan sees it (``glmpost plan``): the model's config from a preset, a
config.json or a checkpoint, and the :class:`~glmpost.memory.roles.Workload` the recipe's stage
sections describe."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from glmpost.checkpoints import CheckpointError, resolve_checkpoint
from glmpost.config import ConfigError
from glmpost.errors import UsageError
from glmpost.memory.roles import Workload
from glmpost.models.tiny import PRESETS, tiny_glm5_config

TRAINING_STAGES = ("train-grpo", "opd-merge", "train-sao", "qat")

def model_config(spec: str) -> tuple[str, dict[str, Any]]:
    """``(description, config dict)`` from a preset name, a config.json file or a checkpoint."""

    if spec in PRESETS:

        return f"preset {spec}", tiny_glm5_config(**PRESETS[spec]).to_dict()
    if spec == "glm5":  # transformers' GlmMoeDsaConfig defaults are GLM-5's published dimensions
        from transformers import GlmMoeDsaConfig

        return "preset glm5 (transformers GlmMoeDsaConfig defaults)", GlmMoeDsaConfig().to_dict()
    path = Path(spec)
    if path.is_dir():

        try:
            path = resolve_checkpoint(path) / "config.json"
        except CheckpointError as exc:
            raise ConfigError("{model} {spec}: {reason}", spec=spec, reason=exc) from None
    if not path.is_file():
        raise ConfigError("{model} {spec}: not a preset (tiny-glm5, glm5), a config.json or a checkpoint", spec=spec)
    try:
        return str(path), json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError("{model} {spec}: {path} is not valid JSON ({reason})", spec=spec, path=path, reason=exc) from None


def workload_from_recipe(values: dict[str, dict[str, Any]], settings: dict[str, Any],
                         defaults_of: Callable[[str], dict[str, Any]]) -> Workload:
    """The run the recipe describes: ``values`` (stage -> every option's value) of the stages it
    has; ``defaults_of(stage)`` gives the options of a stage it leaves out."""
    def stage(name: str) -> dict[str, Any]:
        return values[name] if name in values else defaults_of(name)

    rollout = stage("rollout")
    training_name = next((s for s in TRAINING_STAGES if s in values), "train-grpo")
    train = stage(training_name)
    response = int(rollout.get("max_new_tokens") or 64)
    w = Workload(
        micro_batch=int(train.get("micro_batch_size") or 8),
        micro_batch_tokens=int(train.get("micro_batch_tokens") or 0),
        pack_sequences=bool(train.get("pack_sequences")),
        seq=settings["prompt_tokens"] + response,
        response_tokens=response,
        chunk_size=int(train.get("chunk_size") or 512),
        dtype=settings["dtype"],
        precision="fp32" if train.get("precision") == "fp32" else "bf16",  # auto: an accelerator's bf16
        activation_checkpointing=bool(train.get("activation_checkpointing")),
        zero_stage=int(train.get("zero_stage") or 0),
        ranks=settings["ranks"],
        # The training stage's --attention: native, or transformers' modules (SDPA's math path on a CPU).
        attention=settings["attention"] or ("math" if train.get("attention") == "reference" else "native"),
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
        routing=bool(rollout.get("record_routing") or train.get("routing_replay")),
        lora_rank=int(train.get("lora_rank") or 0),
        lora_targets=tuple(t.strip() for item in train.get("lora_targets") or () for t in str(item).split(",") if t.strip()) or None,
    )
    ds_path = train.get("deepspeed_config")
    if ds_path and Path(ds_path).is_file():
        try:
            ds = json.loads(Path(ds_path).read_text())
        except json.JSONDecodeError as exc:
            raise UsageError(f"[{training_name}] deepspeed {ds_path}: invalid JSON ({exc})") from None
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
