"""``glmpost qat``'s run: SFT with every targeted weight fake-quantized by the deployed quantizer,
one :class:`~glmpost.rl.run_once.RunOnce` from a parent checkpoint to its next version; the
checkpoint keeps the float master weights."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import torch

from glmpost.config import ConfigError
from glmpost.errors import GlmpostError
from glmpost.formats import normalize_record, read_checked_records
from glmpost.formats.chat_format import template_kwargs
from glmpost.formats.prompts import conversation_record, parse_prompt_line
from glmpost.formats.sources import is_prompt_source, source_rows
from glmpost.kernel.loading import load_tokenizer
from glmpost.kernel.lora_versions import is_lora_version
from glmpost.quant.core import fake_quant
from glmpost.quant.qat import QATQuantization, apply_fake_quant, remove_fake_quant
from glmpost.quant.spec import make_spec
from glmpost.rl.jobs import TrainingJob, Update
from glmpost.rl.run_once import RunOnce
from glmpost.rl.sft import SFTConfig, SFTTrainer, sft_examples


def read_sft_records(inputs: Sequence[str], tokenizer, revision: str, *, stage: str = "qat",
                     template_kwargs: dict[str, Any] | None = None) -> list[dict]:
    """Records from conversations (JSONL, parquet, CSV or JSON files, datasets directories:
    :func:`~glmpost.formats.sources.source_rows`; tokenized with the checkpoint's chat template and its
    ``template_kwargs``) or shards."""
    records = []
    for item in inputs:
        path = Path(item)
        if is_prompt_source(path):
            for where, default_id, obj in source_rows(path):
                prompt = parse_prompt_line(obj, where=where, default_id=default_id)
                if prompt.response is None:
                    raise GlmpostError(f"{where}: no response to learn (give 'response' or end 'messages' with the assistant's turn)")
                records.append(normalize_record(conversation_record(prompt, tokenizer, revision, template_kwargs)))
        else:
            records.extend(read_checked_records([item], revision=revision, stage=stage))
    if not records:
        raise GlmpostError(f"{stage}: no records in {' '.join(inputs)}")
    return records


def quantization_error(model: torch.nn.Module, spec) -> list[dict]:
    """Per fake-quantized weight: SQNR in dB and the largest |fake_quant(w) - w| of its master weight."""
    rows = []
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if not name.endswith(".original"):  # only fake-quant parametrizations hold ".original"
                continue
            error = (fake_quant(weight, spec) - weight).float()
            noise = error.pow(2).sum()
            sqnr = float(10 * torch.log10(weight.float().pow(2).sum() / noise)) if noise > 0 else math.inf
            layer = name.replace(".parametrizations.", ".").removesuffix(".original")
            rows.append({"layer": layer, "qat/sqnr_db": round(sqnr, 3), "qat/max_abs_error": float(error.abs().max())})
    return rows


def qat_update(run: RunOnce, inputs: Sequence[str], config: SFTConfig, *, quantization: QATQuantization,
               eval_data: Sequence[str], stage_options: dict[str, Any]) -> dict[str, Any] | None:
    """SFT with every targeted weight fake-quantized by ``quantization.scheme`` (``none``: plain SFT)."""
    stage, scheme, q = "qat", quantization.scheme, quantization
    spec = make_spec(scheme, group_size=q.group_size)
    if run.already_done(stage_options):
        return run.skipped()
    if is_lora_version(run.parent):  # no QLoRA: QAT trains the full weights the deployed quantizer reads
        raise ConfigError("{checkpoint} {parent} is a LoRA version; qat trains full weights (no QLoRA yet): merge it first "
                          "with `glmpost quantize {parent} --scheme none --out DIR` and run qat on DIR", parent=run.parent)
    run.check_staging()
    config.validate()
    tokenizer, revision = load_tokenizer(run.parent)
    kwargs = template_kwargs(config.chat_template_kwargs)
    examples = sft_examples(read_sft_records(inputs, tokenizer, revision, template_kwargs=kwargs))
    held_out = sft_examples(read_sft_records(eval_data, tokenizer, revision, template_kwargs=kwargs)) if eval_data else []
    if not examples:
        raise GlmpostError(f"{stage}: no record has a response token to learn")
    seen: dict[str, Any] = {}

    def adapt(model) -> None:
        seen["names"] = apply_fake_quant(model, spec, targets=q.targets, include=list(q.include), exclude=list(q.exclude))
        update.manifest_extra["qat_targets"] = seen["names"]

    def build(model, backend, session):
        seen["mine"] = held_out[session.rank :: session.world_size]
        trainer = SFTTrainer(model, config, pad_token_id=tokenizer.pad_token_id, backend=backend)
        seen["eval_before"] = trainer.evaluate(seen["mine"]) if held_out else None
        return trainer

    def finish(trainer: SFTTrainer) -> list[dict]:
        seen["eval_after"] = trainer.evaluate(seen["mine"]) if held_out else None
        seen["errors"] = quantization_error(trainer.model, spec)
        remove_fake_quant(trainer.model)  # checkpoints hold the float master weights
        return [*seen["errors"], {"qat/eval_loss_before": seen["eval_before"], "qat/eval_loss_after": seen["eval_after"]}]

    job = TrainingJob(stage, config, build, adapt_model=adapt, keep_optimizer_state=False, publish_in_parent_dtype=False)
    update = Update(examples, {"qat/scheme": scheme}, finish=finish, manifest_extra={"quantization": spec.to_json()})
    result = run.run(job, update, tokenizer_revision=revision, stage_options=stage_options)
    if result is None:
        return None
    history = result.history
    return {
        "out": str(result.target), "policy_version": result.version, "parent": str(result.parent), "scheme": scheme,
        "quantized_layers": len(seen["names"]), "records": len(examples), "steps": len(history),
        "loss_first": history[0]["sft/loss"], "loss_last": history[-1]["sft/loss"],
        "eval_loss_before": seen["eval_before"], "eval_loss_after": seen["eval_after"],
        "min_sqnr_db": min((e["qat/sqnr_db"] for e in seen["errors"]), default=None),
    }
