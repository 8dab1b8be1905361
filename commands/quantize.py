"""Convert a checkpoint into a packed deployment checkpoint (offline quantization).

Schemes: w4a16 (int4 weights, groups of --group-size along the input dim, compressed-tensors
pack-quantized), w8a16 (int8 per output channel, pack-quantized), w8a8-dynamic (int8 per channel
weights, int8 per-token dynamic activations at run time, int-quantized; or with --format msmodelslim
the Ascend msModelSlim W8A8_DYNAMIC layout vLLM-Ascend loads: int8 weight, fp32 weight_scale and
weight_offset, quant_model_description.json), fp8-block (float8_e4m3fn,
128x128 blocks, SGLang/DeepSeek `weight_scale_inv`), none (a plain copy; given a quantized
checkpoint, the float checkpoint it stands for: every quantized layer dequantized). The codes and scales come
from the same function QAT's fake quant uses, so dequantizing the output reproduces the QAT forward
weights bit for bit. Embeddings, lm_head, the MoE router and the DSA indexer stay in float unless
--include names them. Writes DIR/metrics.jsonl (per-layer SQNR and max abs error) and glmpost.json
(policy version kept, stage quantize).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import typer

from glmpost.checkpoints import MANIFEST, resolve_checkpoint
from glmpost.commands.common import config_option, effective_options, print_summary, staged_output_dir
from glmpost.commands.options import json_option
from glmpost.errors import GlmpostError, UsageError
from glmpost.stage import MetricsWriter, log, write_stage_json

STAGE = "quantize"


def quantize(
    ctx: typer.Context,
    checkpoint: Path = typer.Argument(..., help="Checkpoint version directory or root (LATEST)."),
    out: Path = typer.Option(..., "--out", help="Directory to write the quantized checkpoint into."),
    scheme: str = typer.Option(..., "--scheme", help="w4a16, w8a16, w8a8-dynamic, fp8-block or none."),
    group_size: int | None = typer.Option(None, "--group-size", help="w4a16 group size along the input dim (32 or 128; default 128; -1 = one scale per output channel)."),
    fmt: str | None = typer.Option(None, "--format", help="compressed-tensors (int schemes), fp8 (fp8-block) or msmodelslim (w8a8-dynamic for vLLM-Ascend); default by scheme."),
    targets: str = typer.Option("all", "--targets", help="all (every Linear and routed expert) or moe-only (routed experts)."),
    include: list[str] = typer.Option([], "--include", help="Regex of module names to quantize too (overrides the default skips; repeatable)."),
    exclude: list[str] = typer.Option([], "--exclude", help="Regex of module names to keep in float (repeatable)."),
    report: bool = typer.Option(False, "--report", help="Print a per-layer table of SQNR and max abs error (stderr with --json)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
    as_json: bool = json_option(),
    config: Path | None = config_option(),
) -> None:
    from glmpost.quant.formats import check_format, default_format, is_quantized_checkpoint
    from glmpost.quant.spec import make_spec
    from glmpost.quant.writer import plan_checkpoint, quantize_checkpoint

    spec = make_spec(scheme, group_size=group_size)
    fmt = fmt or default_format(scheme)
    if scheme != "none":
        check_format(scheme, fmt)
    src = resolve_checkpoint(checkpoint)
    if src.resolve() == out.resolve():
        raise UsageError(f"--out {out} is the input checkpoint")
    try:
        model_config = json.loads((src / "config.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError) as exc:
        raise GlmpostError(f"{src}/config.json: cannot read ({exc})") from None
    method = is_quantized_checkpoint(src, model_config)
    if method is not None and scheme == "none":
        _dequantize(src, out, method, overwrite=overwrite, as_json=as_json)
        return
    if method is not None:
        raise UsageError(f"checkpoint {src} is already quantized ({method}); quantize its float parent, "
                         "or pass --scheme none to dequantize it")
    files, plan = plan_checkpoint(src, spec, targets=targets, include=include, exclude=exclude)
    options = effective_options(ctx)
    with staged_output_dir(out, overwrite=overwrite, complete_marker=MANIFEST, stage=STAGE, options=options, ctx=ctx) as staging:
        if staging is None:
            log(f"{out} already holds a checkpoint; nothing to do (--overwrite replaces it)")
            print_summary({"out": str(out), "skipped": True}, as_json=as_json, human=f"{out}: already complete (skipped)")
            return
        log(f"quantizing {len(plan.chosen)} layer(s) of {src} with {scheme}" + (f" ({fmt})" if scheme != "none" else ""))
        with MetricsWriter(staging / "metrics.jsonl") as metrics:
            result = quantize_checkpoint(src, staging, files, plan, spec, fmt, model_config=model_config,
                                         on_row=lambda row: metrics.write(**row))
        write_stage_json(staging, STAGE, options, quantized_layers=len(plan.chosen))
    _report(out, scheme, fmt, result, report=report, as_json=as_json)


def _report(out: Path, scheme: str, fmt: str, result, *, report: bool, as_json: bool) -> None:
    rows = result.rows
    finite = [r["sqnr_db"] for r in rows if r["sqnr_db"] is not None and math.isfinite(r["sqnr_db"])]
    summary = {
        "out": str(out), "scheme": scheme, "format": fmt if scheme != "none" else None, "layers": result.layers,
        "bytes_in": result.bytes_in, "bytes_out": result.bytes_out, "min_sqnr_db": min(finite) if finite else None,
        "policy_version": result.policy_version,
    }
    if report:
        width = max([len(r["layer"]) for r in rows] + [5])
        lines = [f"{'layer':<{width}}  {'shape':>12}  {'SQNR dB':>8}  {'max abs err':>11}"]
        for r in rows:
            sq = "exact" if r["sqnr_db"] is None else f"{r['sqnr_db']:.2f}"
            lines.append(f"{r['layer']:<{width}}  {'x'.join(map(str, r['shape'])):>12}  {sq:>8}  {r['max_abs_err']:>11.3e}")
        # the table is a result (stdout), unless stdout carries --json
        (sys.stderr if as_json else sys.stdout).write("\n".join(lines) + "\n")
    human = (
        f"{out}: {scheme} {result.layers} layer(s), {result.bytes_in / 2**20:.2f} MiB -> {result.bytes_out / 2**20:.2f} MiB"
        + (f", min SQNR {min(finite):.1f} dB" if finite else "")
        + f", policy version {result.policy_version}"
    )
    print_summary(summary, as_json=as_json, human=human)


def _dequantize(src: Path, out: Path, method: str, *, overwrite: bool, as_json: bool) -> None:
    """``--scheme none`` on a quantized checkpoint: write the float checkpoint it stands for."""
    from glmpost.quant.formats import dequantize_checkpoint

    if out.exists() and not overwrite:
        raise UsageError(f"--out {out} exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    fresh = out.with_name(f".{out.name}.dequantized")
    shutil.rmtree(fresh, ignore_errors=True)
    dequantize_checkpoint(src, fresh)  # the old output stays until the new one is complete
    shutil.rmtree(out, ignore_errors=True)
    fresh.rename(out)
    print_summary({"out": str(out), "dequantized_from": method, "checkpoint": str(src)}, as_json=as_json,
                  human=f"{out}: float checkpoint dequantized from {src} ({method})")
