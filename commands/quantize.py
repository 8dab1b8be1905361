"""Convert a checkpoint into a packed deployment checkpoint (offline quantization).

Schemes: w4a16 (int4 weights, groups of --group-size along the input dim, compressed-tensors
pack-quantized), w8a16 (int8 per output channel, pack-quantized), w8a8-dynamic (int8 per channel
weights, int8 per-token dynamic activations at run time, int-quantized; or with --format msmodelslim
the Ascend msModelSlim W8A8_DYNAMIC layout vLLM-Ascend loads: int8 weight, fp32 weight_scale and
weight_offset, quant_model_description.json), fp8-block (float8_e4m3fn,
128x128 blocks, SGLang/DeepSeek `weight_scale_inv`), none (a plain copy; given a quantized
checkpoint, the float checkpoint it stands for: every quantized layer dequantized). The codes and scales come
from the same function QAT's fake quant uses, so dequantizing the output reproduces the QAT forward
weights bit for bit. Embeddings, lm_head, the MoE router, the DSA indexer and kv_b_proj stay in float
unless --include names them (--exclude wins over --include); kv_b_proj because SGLang's DeepseekV2/V3
loader (which serves GLM-5) reads kv_b_proj.weight after loading to split it into w_kc / w_vc, which
a packed int4 layer lacks. For SGLang, --targets moe-only (int4 routed experts, the rest in float) is
the safe recipe. Writes DIR/metrics.jsonl (per-layer SQNR and max abs error) and glmpost.json
(policy version kept, stage quantize). A LoRA version is quantized as the full checkpoint it stands for:
merged into its base first (PEFT's merge in float32, stored in the base's dtype), so --scheme none
writes the merged float checkpoint (the deployment merge, on demand; glmpost.json's extra.merged_from
names the LoRA version and its base), and msModelSlim export and qat (on that output) work on merged weights.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from glmpost.checkpoints import MANIFEST
from glmpost.commands.common import config_option, effective_options, print_summary, report_skipped, staged_output_dir
from glmpost.commands.options import config_from, json_option, with_config
from glmpost.kernel.lora_merge import full_weights
from glmpost.quant.offline import STAGE, OfflineQuantization, QuantizeConfig, layer_table


@with_config(QuantizeConfig)
def quantize(
    ctx: typer.Context,
    checkpoint: Path = typer.Argument(..., help="Checkpoint version directory or root (LATEST)."),
    out: Path = typer.Option(..., "--out", help="Directory to write the quantized checkpoint into."),
    scheme: str = typer.Option(..., "--scheme", help="w4a16, w8a16, w8a8-dynamic, fp8-block or none."),
    as_json: bool = json_option(),
    config: Path | None = config_option(),
    **settings: Any,
) -> None:
    overwrite = ctx.params["overwrite"]
    report = ctx.params["report"]
    # A LoRA version is quantized as the full checkpoint it stands for, merged in scratch; an output
    # already complete needs no merge (the run only checks the options, on the base's layout).
    complete = (out / MANIFEST).is_file() and not overwrite
    OfflineQuantization.checked_scheme(config_from(ctx, QuantizeConfig))  # a bad option is refused before a merge
    with full_weights(checkpoint, scratch_beside=out, layout_only=complete) as source:
        _quantize(ctx, config_from(ctx, QuantizeConfig, checkpoint=source), out=out, overwrite=overwrite, report=report,
                  as_json=as_json)


def _quantize(ctx: typer.Context, settings: QuantizeConfig, *, out: Path, overwrite: bool, report: bool, as_json: bool) -> None:
    run = OfflineQuantization(settings)
    if run.dequantizing:
        summary, human = run.dequantize()
        print_summary(summary, as_json=as_json, human=human)
        return
    options = effective_options(ctx)
    with staged_output_dir(out, overwrite=overwrite, complete_marker=MANIFEST, stage=STAGE, options=options) as staging:
        if staging is None:
            report_skipped(out, as_json=as_json)
            return
        result = run.write(staging, options)
    if report:  # the table is a result (stdout), unless stdout carries --json
        (sys.stderr if as_json else sys.stdout).write(layer_table(result.rows))
    summary, human = run.summary(result)
    print_summary(summary, as_json=as_json, human=human)
