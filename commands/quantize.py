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

from glmpost.checkpoints import (
    MANIFEST,
    CheckpointManifest,
    model_skeleton,
    read_manifest,
    resolve_checkpoint,
    tokenizer_revision,
    write_manifest,
)
from glmpost.commands.common import (
    MetricsWriter,
    config_option,
    effective_options,
    print_summary,
    staged_output_dir,
)
from glmpost.errors import GlmpostError, UsageError
from glmpost.stage import log, write_json_atomic, write_stage_json

STAGE = "quantize"
_SKIP_FILES = {MANIFEST, "stage.json", "metrics.jsonl", "config.json", "model.safetensors.index.json"}


def _open_weights(path: Path):
    """``safe_open`` with an unreadable or truncated file reported in one line."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), "pt")
    except (SafetensorError, OSError) as exc:
        raise GlmpostError(f"{path}: cannot read safetensors ({exc})") from None


def _sqnr_db(w, wq) -> float | None:
    signal = float(w.double().pow(2).sum())
    noise = float((w.double() - wq.double()).pow(2).sum())
    if noise == 0.0:
        return None  # exact (infinite SQNR; JSON has no inf)
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


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
    as_json: bool = typer.Option(False, "--json", help="Print the result summary as JSON."),
    config: Path | None = config_option(),
) -> None:
    import torch
    from safetensors.torch import save_file

    from glmpost.quant.core import check_shape, dequant, quantize_weight
    from glmpost.quant.formats import (
        MODELSLIM_DESCRIPTION,
        check_format,
        default_format,
        encode_layer,
        is_quantized_checkpoint,
        modelslim_description,
        quantization_config,
    )
    from glmpost.quant.spec import make_spec
    from glmpost.quant.targets import candidates_from_model, select_targets

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
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise GlmpostError(f"checkpoint {src}: no *.safetensors weight files")

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with _open_weights(f) as sf:
            for key in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                shapes[key] = tuple(sf.get_slice(key).get_shape())
    chosen: list[str] = []
    if scheme != "none":
        candidates = candidates_from_model(model_skeleton(src), shapes)
        chosen = select_targets(candidates, targets=targets, include=include, exclude=exclude)
        if not chosen:
            raise UsageError("no layer selected for quantization (check --targets/--include/--exclude)")
        for module in chosen:  # every shape error before anything is written
            check_shape(shapes[f"{module}.weight"], spec, module)
        linear_like = {c.module for c in candidates if c.kind in ("linear", "expert")}
        ignore = sorted(linear_like - set(chosen))
    chosen_set = set(chosen)

    options = effective_options(ctx)
    rows: list[dict] = []
    with staged_output_dir(out, overwrite=overwrite, complete_marker=MANIFEST) as staging:
        if staging is None:
            log(f"{out} already holds a checkpoint; nothing to do (--overwrite replaces it)")
            print_summary({"out": str(out), "skipped": True}, as_json=as_json, human=f"{out}: already complete (skipped)")
            return
        log(f"quantizing {len(chosen)} layer(s) of {src} with {scheme}" + (f" ({fmt})" if scheme != "none" else ""))
        weight_map: dict[str, str] = {}
        bytes_in = bytes_out = 0
        with MetricsWriter(staging / "metrics.jsonl") as metrics:
            for f in files:
                tensors: dict[str, torch.Tensor] = {}
                with _open_weights(f) as sf:
                    for key in sf.keys():  # noqa: SIM118 - safe_open is not a dict  # noqa: SIM118 - safe_open is not a dict
                        t = sf.get_tensor(key)
                        bytes_in += t.numel() * t.element_size()
                        module = key[: -len(".weight")] if key.endswith(".weight") else None
                        if module in chosen_set:
                            if t.numel() and not bool(torch.isfinite(t).all()):  # inf/NaN would give a NaN scale
                                raise GlmpostError(f"{f}: {key} holds inf or NaN; cannot quantize it")
                            codes, scale = quantize_weight(t, spec)
                            wq = dequant(codes, scale, spec, t.dtype)
                            err = float((t.float() - wq.float()).abs().max()) if t.numel() else 0.0
                            row = {"layer": module, "shape": list(t.shape), "sqnr_db": _sqnr_db(t, wq), "max_abs_err": err}
                            rows.append(row)
                            metrics.write(**row)
                            encoded = encode_layer(module, codes, scale, spec, fmt)
                        else:
                            encoded = {key: t}
                        for name, value in encoded.items():
                            tensors[name] = value
                            weight_map[name] = f.name
                            bytes_out += value.numel() * value.element_size()
                save_file(tensors, str(staging / f.name), metadata={"format": "pt"})
        if len(files) > 1 or (src / "model.safetensors.index.json").is_file():
            index = {"metadata": {"total_size": bytes_out}, "weight_map": weight_map}
            write_json_atomic(staging / "model.safetensors.index.json", index)
        for item in sorted(src.iterdir()):
            if item.is_file() and item.name not in _SKIP_FILES and item.suffix != ".safetensors":
                shutil.copy2(item, staging / item.name)
        if fmt == "msmodelslim":  # vLLM-Ascend reads the per-tensor type map, not config.json
            write_json_atomic(staging / MODELSLIM_DESCRIPTION, modelslim_description(weight_map, chosen))
        elif scheme != "none":
            model_config["quantization_config"] = quantization_config(spec, fmt, ignore)
        write_json_atomic(staging / "config.json", model_config)
        parent = read_manifest(src) if (src / MANIFEST).is_file() else None
        revision = tokenizer_revision(staging)
        manifest = CheckpointManifest(
            policy_version=parent.policy_version if parent else 0,
            tokenizer_revision=revision,
            stage=STAGE,
            step=parent.step if parent else 0,
            parent=str(src),
            extra={"scheme": scheme, "format": fmt if scheme != "none" else None, "spec": spec.to_json(), "layers": len(chosen)},
        )
        write_manifest(staging, manifest)
        write_stage_json(staging, STAGE, options, quantized_layers=len(chosen))

    finite = [r["sqnr_db"] for r in rows if r["sqnr_db"] is not None and math.isfinite(r["sqnr_db"])]
    summary = {
        "out": str(out),
        "scheme": scheme,
        "format": fmt if scheme != "none" else None,
        "layers": len(chosen),
        "bytes_in": bytes_in,
        "bytes_out": bytes_out,
        "min_sqnr_db": min(finite) if finite else None,
        "policy_version": manifest.policy_version,
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
        f"{out}: {scheme} {len(chosen)} layer(s), {bytes_in / 2**20:.2f} MiB -> {bytes_out / 2**20:.2f} MiB"
        + (f", min SQNR {min(finite):.1f} dB" if finite else "")
        + f", policy version {manifest.policy_version}"
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
