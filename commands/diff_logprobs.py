"""Measure how far two numerical paths' log-probs are apart on the same action tokens.

Path A is always the trainer's forward of --checkpoint (in --dtype, on --device, with its DSA
top-k rule). Path B is, by what you pass:

\b
  (shards only)    the rollout_log_probs the engine recorded (the IcePop view);
  --against CKPT   another checkpoint, e.g. the FP8 / W4A16 rollout checkpoint
                   (dequantized);
  --against-dtype, --against-device, --against-topk, --against-batch-size
                   the same checkpoint in another dtype, device, DSA top-k
                   rule or batch size;
  --against-server URL
                   a `glmpost serve` / SGLang server (prefill log-probs).

delta = log p_A - log p_B per action token. Reports mean / p50 / p99 / max |delta|, k1 and k3
estimates of KL(p_B || p_A), the fraction IcePop keeps at --beta and DIS at --eps-low/--eps-high,
sampled-token agreement (both paths resample every action position with the record's own seeded
uniforms; the fraction where they pick the same token), a breakdown by response position and by
status, and the worst tokens with their decoded context. --indexer also compares the GLM-5 DSA
indexer's selected key sets between two local paths (mean Jaccard, identical sets and orders,
boundary ties). Writes DIR/report.json, plots (delta_hist.png, abs_delta_vs_position.png,
scatter.png), DIR/metrics.jsonl and DIR/stage.json; prints a table (or --json).

--fail-above METRIC=VALUE turns it into a CI gate: exit 1 when the metric exceeds the value.
"""

from __future__ import annotations

from pathlib import Path

import typer

from glmpost.closure.diff import STAGE, DiffConfig, LogprobDiff, diff_table
from glmpost.commands.common import (
    config_option,
    effective_options,
    print_summary,
    staged_output_dir,
)
from glmpost.commands.options import json_option
from glmpost.errors import UsageError


def diff_logprobs(
    ctx: typer.Context,
    inputs: list[str] = typer.Argument(..., help="Trajectory shards (files, directories or globs); without --against* they need rollout_log_probs."),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Path A: the trainer's weights, a root (its LATEST) or a version."),
    out: Path = typer.Option(..., "--out", help="Directory for report.json, plots, metrics.jsonl and stage.json (created; never silently replaced)."),
    against: Path | None = typer.Option(None, "--against", help="Path B: another checkpoint (root or version; quantized ones are dequantized)."),
    against_server: str | None = typer.Option(None, "--against-server", help="Path B: a glmpost serve / SGLang server URL."),
    dtype: str = typer.Option("auto", "--dtype", help="Path A dtype: auto (the checkpoint's), fp32, bf16 or fp16."),
    against_dtype: str | None = typer.Option(None, "--against-dtype", help="Path B dtype (default: path A's)."),
    device: str = typer.Option("auto", "--device", help="Path A device: auto, cpu, cuda[:N] or npu[:N]."),
    against_device: str | None = typer.Option(None, "--against-device", help="Path B device (default: path A's)."),
    deterministic_topk: bool = typer.Option(True, "--deterministic-topk/--torch-topk", help="Path A DSA indexer top-k rule (see `glmpost rollout --help`)."),
    against_topk: str | None = typer.Option(None, "--against-topk", help="Path B DSA indexer top-k rule: deterministic or torch (default: path A's)."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Path A trajectories per forward pass."),
    against_batch_size: int | None = typer.Option(None, "--against-batch-size", min=1, help="Path B trajectories per forward pass (default: path A's)."),
    indexer: bool = typer.Option(False, "--indexer", help="Also compare the DSA indexer's selected top-k key sets (two local paths)."),
    beta: float = typer.Option(2.0, "--beta", help="IcePop beta: a token is kept when 1/beta <= p_A / p_B <= beta."),
    eps_low: float = typer.Option(0.2, "--eps-low", help="DIS lower epsilon: kept when 1 - eps_low < ratio."),
    eps_high: float = typer.Option(0.28, "--eps-high", help="DIS upper epsilon: kept when ratio < 1 + eps_high."),
    fail_above: list[str] = typer.Option([], "--fail-above", help="METRIC=VALUE (mean_abs, p50_abs, p99_abs, max_abs, k1, k3, sample_disagreement, indexer_differing_sets): exit 1 when exceeded; repeatable."),
    worst: int = typer.Option(10, "--worst", min=0, help="How many of the worst tokens to list."),
    context_tokens: int = typer.Option(12, "--context-tokens", min=0, help="Tokens of context decoded before each worst token."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write the PNG plots beside report.json."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing report directory."),
    as_json: bool = json_option("the report"),
    config: Path | None = config_option(),
) -> None:
    diff = LogprobDiff(DiffConfig(
        inputs=list(inputs), checkpoint=checkpoint, out=out, against=against, against_server=against_server,
        dtype=dtype, against_dtype=against_dtype, device=device, against_device=against_device,
        deterministic_topk=deterministic_topk, against_topk=against_topk, batch_size=batch_size,
        against_batch_size=against_batch_size, indexer=indexer, beta=beta, eps_low=eps_low, eps_high=eps_high,
        fail_above=list(fail_above), worst=worst, context_tokens=context_tokens, plots=plots,
    ))
    report = diff.measure()
    options = effective_options(ctx)
    with staged_output_dir(out, overwrite=overwrite, complete_marker="stage.json", stage=STAGE,
                           options=options, ctx=ctx) as staging:
        if staging is None:
            raise UsageError(f"--out {out} already holds a report; pass --overwrite to replace it")
        diff.write(staging, options)
    print_summary(report, as_json=as_json, human=diff_table(report, out))
    diff.check_gates()
