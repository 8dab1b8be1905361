"""SFT with fake quantization (INT4 QAT in GLM-5's SFT stage); --scheme none is plain SFT.

Data: chat JSONL (`messages` ending with the assistant's turn), prompt/response JSONL (`prompt` or
`messages` plus `response`), the same rows from parquet, CSV or JSON files or datasets directories, or
trajectory shards; the loss is the mean negative log-likelihood of
the response (action) tokens only, over the whole batch on every rank. The forward of every targeted
weight is dequant(quantize(w)) of the one quantizer that `glmpost quantize` also uses, so the
deployed weights equal the QAT forward bit for bit; the optimizer updates float master weights
through the straight-through estimator. Targets: linear layers and MoE experts (`--targets all`) or
experts only (`moe-only`, the safe recipe for SGLang); embeddings, lm_head, the MoE router, the DSA
indexer and kv_b_proj are skipped unless --include names them (--exclude wins), exactly as `glmpost
quantize` selects them; kv_b_proj because SGLang's DeepseekV2/V3 loader (which serves GLM-5) reads
kv_b_proj.weight after loading to split it into w_kc / w_vc, which a packed int4 layer lacks.

The new version (parent's policy version + 1) is written under --out (a checkpoint root, float master
weights, the scheme recorded in glmpost.json) and LATEST moves to it. Runs under `torchrun` /
`deepspeed` with ZeRO 1-3 like train-grpo. A run interrupted after --save-every steps continues with
--resume (no step is repeated; the result equals an uninterrupted run). metrics.jsonl: loss per step,
held-out loss (--eval) before and after, and per-layer quantization error (SQNR, max |error|).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from glmpost.commands.common import config_option, effective_options, report_update
from glmpost.commands.options import TRAINING_RUN_OPTIONS, config_from, json_option, with_config, with_options
from glmpost.quant.qat import QATQuantization
from glmpost.rl.qat_update import qat_update
from glmpost.rl.run import RunOptions
from glmpost.rl.run_once import RunOnce
from glmpost.rl.sft import SFTConfig

STAGE = "qat"


@with_options(RunOptions, TRAINING_RUN_OPTIONS)
@with_config(QATQuantization)
@with_config(SFTConfig)
def qat(
    ctx: typer.Context,
    inputs: list[str] = typer.Argument(..., help="SFT data: chat or prompt/response JSONL, parquet, CSV or JSON files or datasets directories, or trajectory shards."),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Model to fine-tune: a checkpoint root (its LATEST) or a version directory."),
    out: Path = typer.Option(..., "--out", help="Checkpoint root that receives the new version and its LATEST pointer."),
    eval_data: list[str] = typer.Option([], "--eval", help="Held-out data (same forms as the inputs): loss before and after, with fake quant on."),
    as_json: bool = json_option(),
    config: Path | None = config_option(),
    **shared: Any,
) -> None:
    scheme = ctx.params["scheme"]
    with RunOnce(checkpoint, out, config_from(ctx, RunOptions), stage=STAGE) as run:
        summary = qat_update(run, inputs, config_from(ctx, SFTConfig), quantization=config_from(ctx, QATQuantization),
                             eval_data=eval_data, stage_options=effective_options(ctx))
    report_update(summary, as_json=as_json, human=lambda s: (
        f"{s['out']}: {scheme} QAT of {s['quantized_layers']} layers, {s['records']} trajectories, {s['steps']} steps, "
        f"loss {s['loss_first']:.4f} -> {s['loss_last']:.4f}"
        + (f", held-out {s['eval_loss_before']:.4f} -> {s['eval_loss_after']:.4f}" if eval_data else "")
    ))
