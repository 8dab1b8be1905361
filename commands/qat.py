"""SFT with fake quantization (INT4 QAT in GLM-5's SFT stage); --scheme none is plain SFT.

Data: chat JSONL (`messages` ending with the assistant's turn), prompt/response JSONL (`prompt` or
`messages` plus `response`), or trajectory shards; the loss is the mean negative log-likelihood of
the response (action) tokens only, over the whole batch on every rank. The forward of every targeted
weight is dequant(quantize(w)) of the one quantizer that `glmpost quantize` also uses, so the
deployed weights equal the QAT forward bit for bit; the optimizer updates float master weights
through the straight-through estimator. Targets: linear layers and MoE experts (`--targets all`) or
experts only (`moe-only`); embeddings, lm_head, the MoE router and the DSA indexer are skipped unless
--include names them.

The new version (parent's policy version + 1) is written under --out (a checkpoint root, float master
weights, the scheme recorded in glmpost.json) and LATEST moves to it. Runs under `torchrun` /
`deepspeed` with ZeRO 1-3 like train-grpo. A run interrupted after --save-every steps continues with
--resume (no step is repeated; the result equals an uninterrupted run). metrics.jsonl: loss per step,
held-out loss (--eval) before and after, and per-layer quantization error (SQNR, max |error|).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
import typer
from tqdm import tqdm

from glmpost.checkpoints import (
    CheckpointManifest,
    NextVersion,
    load_model,
    load_tokenizer,
)
from glmpost.commands.common import (
    config_option,
    effective_options,
    log,
    print_summary,
    skip_published,
    write_stage_json,
)
from glmpost.rl.distributed import TrainingSession
from glmpost.errors import GlmpostError, UsageError
from glmpost.formats import (
    SHARD_SUFFIX,
    ShardReader,
    normalize_record,
    resolve_shard_paths,
)
from glmpost.rollout.prompts import conversation_record, parse_prompt_line, read_jsonl
from glmpost.quant.core import fake_quant
from glmpost.quant.qat import apply_fake_quant, remove_fake_quant
from glmpost.quant.spec import make_spec
from glmpost.rl.sft import SFTConfig, SFTTrainer, sft_examples

STAGE = "qat"


def read_sft_records(inputs: list[str], tokenizer, revision: str) -> list[dict]:
    """Records from JSONL conversations (tokenized with the checkpoint's chat template) or shards."""
    records = []
    for item in inputs:
        path = Path(item)
        if path.is_file() and not path.name.endswith(SHARD_SUFFIX):
            for where, obj in read_jsonl(path):
                prompt = parse_prompt_line(obj, where=where, default_id=f"{path.stem}-{where.rsplit(':', 1)[1]}")
                if prompt.response is None:
                    raise GlmpostError(f"{where}: no response to learn (give 'response' or end 'messages' with the assistant's turn)")
                records.append(normalize_record(conversation_record(prompt, tokenizer, revision)))
            continue
        for shard in resolve_shard_paths([item]):
            for index, record in enumerate(ShardReader(shard)):
                if record["tokenizer_revision"] != revision:
                    raise GlmpostError(f"{shard}: record {index}: tokenizer revision {record['tokenizer_revision']} differs from the checkpoint's {revision}")
                records.append(record)
    if not records:
        raise GlmpostError(f"{STAGE}: no records in {' '.join(inputs)}")
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


def qat(
    ctx: typer.Context,
    inputs: list[str] = typer.Argument(..., help="SFT data: chat or prompt/response JSONL files, or trajectory shards."),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Model to fine-tune: a checkpoint root (its LATEST) or a version directory."),
    out: Path = typer.Option(..., "--out", help="Checkpoint root that receives the new version and its LATEST pointer."),
    scheme: str = typer.Option("w4a16", "--scheme", help="Fake quantization: w4a16 (int4 groups), w8a16, w8a8-dynamic (weights), or none (plain SFT)."),
    group_size: int | None = typer.Option(None, "--group-size", help="w4a16 group size along the input dim (32 or 128; default 128; -1 = one scale per output channel); must divide every targeted layer."),
    targets: str = typer.Option("all", "--targets", help="all (linear layers and experts) or moe-only (experts only)."),
    include: list[str] = typer.Option([], "--include", help="Regex of extra layers to quantize (e.g. lm_head); repeatable."),
    exclude: list[str] = typer.Option([], "--exclude", help="Regex of layers to leave in float; repeatable."),
    eval_data: list[str] = typer.Option([], "--eval", help="Held-out data (same forms as the inputs): loss before and after, with fake quant on."),
    lr: float = typer.Option(1e-5, "--lr", help="AdamW learning rate."),
    weight_decay: float = typer.Option(0.0, "--weight-decay", help="AdamW weight decay."),
    epochs: int = typer.Option(1, "--epochs", min=1, help="Passes over the data."),
    batch_size: int = typer.Option(32, "--batch-size", min=1, help="Trajectories per optimizer step (over all ranks)."),
    micro_batch_size: int = typer.Option(8, "--micro-batch-size", min=1, help="Trajectories per forward/backward on each rank."),
    grad_clip: float = typer.Option(1.0, "--grad-clip", min=0.0, help="Clip the global gradient norm to this; 0 disables."),
    chunk_size: int = typer.Option(512, "--chunk-size", min=1, help="Positions per chunk of the log-prob computation."),
    seed: int = typer.Option(0, "--seed", help="Seed of the data shuffling."),
    zero_stage: int | None = typer.Option(None, "--zero-stage", min=0, max=3, help="Train with DeepSpeed ZeRO at this stage (1, 2 or 3)."),
    deepspeed_config: Path | None = typer.Option(None, "--deepspeed", help="DeepSpeed JSON config."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda[:N] or npu[:N]."),
    deterministic: bool = typer.Option(False, "--deterministic", help="Deterministic algorithms (torch, cuBLAS, HCCL switches)."),
    save_every: int = typer.Option(0, "--save-every", min=0, help="Save resumable training state every N optimizer steps (0 = only at the end)."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run from its saved state without repeating a step."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Discard an interrupted run's state and start over."),
    as_json: bool = typer.Option(False, "--json", help="Print the result summary as JSON."),
    config: Path | None = config_option(),
) -> None:
    spec = make_spec(scheme, group_size=group_size)
    plan = NextVersion.plan(checkpoint, out)
    parent, version, target = plan.parent, plan.version, plan.target
    if skip_published(target, version, as_json=as_json):
        return
    staging = plan.staging
    state_dir = staging / "trainer_state"
    resume_state = state_dir / "resume.pt"
    if staging.exists() and not (resume or overwrite):
        raise UsageError(f"an interrupted run left {staging}; pass --resume to continue it or --overwrite to start over")
    sft = SFTConfig(lr=lr, weight_decay=weight_decay, epochs=epochs, batch_size=batch_size,
                    micro_batch_size=micro_batch_size, grad_clip=grad_clip, chunk_size=chunk_size, seed=seed)
    try:
        sft.validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    tokenizer, revision = load_tokenizer(parent)
    examples = sft_examples(read_sft_records(inputs, tokenizer, revision))
    held_out = sft_examples(read_sft_records(eval_data, tokenizer, revision)) if eval_data else []
    if not examples:
        raise GlmpostError(f"{STAGE}: no record has a response token to learn")
    session = TrainingSession.start(device=device, deterministic=deterministic, zero_stage=zero_stage, deepspeed_config=deepspeed_config)
    model = load_model(parent, device=session.device, dtype="float32" if session.device.type == "cpu" else None)
    names = apply_fake_quant(model, spec, targets=targets, include=include, exclude=exclude)
    trainer = SFTTrainer(model, sft, pad_token_id=tokenizer.pad_token_id, backend=session.backend(model, sft))
    mine = lambda items: items[session.rank :: session.world_size]
    eval_before = trainer.evaluate(mine(held_out)) if held_out else None

    if session.is_main:
        if staging.exists() and (overwrite or not resume_state.exists()):
            shutil.rmtree(staging)  # --overwrite, or an interruption before the first saved state
        staging.mkdir(parents=True, exist_ok=True)
    session.barrier()
    total = trainer.total_steps(len(examples))
    start_step, history = 0, []
    if resume and resume_state.exists():  # weights, AdamW state, step and metrics of the last save
        start_step, history = trainer.backend.load_resume_state(resume_state)
        log(f"resuming at optimizer step {start_step} of {total}")
    progress = tqdm(total=total, initial=start_step, desc=STAGE, unit="step", leave=False,
                    disable=None if session.is_main else True)

    def on_step(step: int, metrics: dict) -> None:
        metrics["qat/scheme"] = scheme
        history.append(metrics)
        progress.update(1)
        if save_every and (step + 1) % save_every == 0 and step + 1 < total:
            trainer.backend.save_resume_state(resume_state, step + 1, history)

    with progress:
        trainer.train(examples, start_step=start_step, on_step=on_step)
    eval_after = trainer.evaluate(mine(held_out)) if held_out else None
    errors = quantization_error(model, spec)
    remove_fake_quant(model)  # checkpoints hold the float master weights
    trainer.backend.save_model(staging)
    if session.is_main:
        shutil.rmtree(state_dir, ignore_errors=True)  # resume state is not part of the checkpoint
        with open(staging / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps(line, sort_keys=True) + "\n" for line in [*history, *errors, {"qat/eval_loss_before": eval_before, "qat/eval_loss_after": eval_after}])
        write_stage_json(staging, STAGE, effective_options(ctx), parent=str(parent), world_size=session.world_size)
        plan.publish(CheckpointManifest(
            policy_version=version, tokenizer_revision=revision, stage=STAGE, step=len(history), parent=str(parent),
            extra={"quantization": spec.to_json(), "qat_targets": names},
        ))
    session.barrier()
    session.close()
    if not session.is_main:
        return
    summary = {
        "out": str(target), "policy_version": version, "parent": str(parent), "scheme": scheme,
        "quantized_layers": len(names), "records": len(examples), "steps": len(history),
        "loss_first": history[0]["sft/loss"], "loss_last": history[-1]["sft/loss"],
        "eval_loss_before": eval_before, "eval_loss_after": eval_after,
        "min_sqnr_db": min((e["qat/sqnr_db"] for e in errors), default=None),
    }
    human = (
        f"{target}: {scheme} QAT of {len(names)} layers, {len(examples)} trajectories, {len(history)} steps, "
        f"loss {summary['loss_first']:.4f} -> {summary['loss_last']:.4f}"
        + (f", held-out {eval_before:.4f} -> {eval_after:.4f}" if held_out else "")
    )
    print_summary(summary, as_json=as_json, human=human)
