"""One ``glmpost quantize`` run: a float checkpoint to a packed deployment checkpoint, or a quantized
checkpoint back to the float checkpoint it stands for (``scheme`` none).

    check the settings -> resolve the checkpoint -> refuse an input that is already quantized
    -> plan the layers (every shape checked) -> write the caller's staging directory -> the summary

The writing itself is :mod:`glmpost.quant.writer` (:func:`~glmpost.quant.writer.plan_checkpoint`,
:func:`~glmpost.quant.writer.quantize_checkpoint`); the reader back to float is
:func:`glmpost.quant.formats.dequantize_checkpoint`.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from glmpost.checkpoints import resolve_checkpoint
from glmpost.config import ConfigError, setting, shared
from glmpost.errors import GlmpostError
from glmpost.quant.formats import check_format, default_format, dequantize_checkpoint, is_quantized_checkpoint
from glmpost.quant.spec import GroupSizeSetting, make_spec
from glmpost.quant.targets import LayerSelection
from glmpost.quant.writer import plan_checkpoint, quantize_checkpoint
from glmpost.stage import MetricsWriter, log, write_stage_json

STAGE = "quantize"


@dataclass
class QuantizeConfig(GroupSizeSetting, LayerSelection):
    """The settings of one offline quantization: the options of ``glmpost quantize`` (``group_size`` is
    the one ``sync-weights`` and ``qat`` have too, the layer selection ``qat``'s); refusals name these fields."""

    checkpoint: Optional[Path] = None  # a version directory or a root (its LATEST)
    out: Optional[Path] = None  # the output directory, as messages name it (the caller stages it)
    scheme: str = "none"  # one of glmpost.quant.spec.SCHEMES
    fmt: Optional[str] = setting(
        None, "compressed-tensors (int schemes), fp8 (fp8-block) or msmodelslim (w8a8-dynamic for vLLM-Ascend); "
        "default by scheme.", flag="--format")
    report: bool = setting(False, "Print a per-layer table of SQNR and max abs error (stderr with --json).")
    overwrite: bool = shared("overwrite")


class OfflineQuantization:
    """One run. Building it checks the settings, resolves the checkpoint and plans the layers; then
    :meth:`dequantize` (a quantized input with ``scheme`` none) or :meth:`write` into a staging
    directory, and :meth:`summary`."""

    def __init__(self, config: QuantizeConfig):
        self.config = c = config
        self.spec, self.fmt = self.checked_scheme(c)
        self.src = resolve_checkpoint(c.checkpoint)
        if self.src.resolve() == c.out.resolve():
            raise ConfigError("{out} {out_dir} is the input checkpoint", out_dir=c.out)
        try:
            self.model_config = json.loads((self.src / "config.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError) as exc:
            raise GlmpostError(f"{self.src}/config.json: cannot read ({exc})") from None
        self.method = is_quantized_checkpoint(self.src, self.model_config)
        if self.method is not None and c.scheme != "none":
            raise ConfigError("checkpoint {src} is already quantized ({method}); quantize its float parent, "
                              "or pass {scheme} none to dequantize it", src=self.src, method=self.method)
        self.files, self.plan = ([], None) if self.dequantizing else plan_checkpoint(
            self.src, self.spec, targets=c.targets, include=c.include, exclude=c.exclude)

    @staticmethod
    def checked_scheme(config: QuantizeConfig):
        """The settings' ``(spec, format)``, or the refusal naming the option at fault (before any
        checkpoint is read)."""
        spec = make_spec(config.scheme, group_size=config.group_size)
        fmt = config.fmt or default_format(config.scheme)
        if config.scheme != "none":
            check_format(config.scheme, fmt)
        return spec, fmt

    @property
    def dequantizing(self) -> bool:
        """The input is quantized (and ``scheme`` is none): the run writes the float checkpoint it stands for."""
        return self.method is not None

    def dequantize(self) -> tuple[dict[str, Any], str]:
        """Write the float checkpoint into ``out`` (the old output stays until the new one is
        complete); ``(summary, human line)``."""

        out = self.config.out
        if out.exists() and not self.config.overwrite:
            raise ConfigError("{out} {out_dir} exists; pass {overwrite} to replace it", out_dir=out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fresh = out.with_name(f".{out.name}.dequantized")
        shutil.rmtree(fresh, ignore_errors=True)
        dequantize_checkpoint(self.src, fresh)
        shutil.rmtree(out, ignore_errors=True)
        fresh.rename(out)
        return ({"out": str(out), "dequantized_from": self.method, "checkpoint": str(self.src)},
                f"{out}: float checkpoint dequantized from {self.src} ({self.method})")

    def write(self, staging: Path, options: dict[str, Any]):
        """Write the quantized checkpoint, ``metrics.jsonl`` (a row per layer) and ``stage.json``
        (recording ``options``) into ``staging``; the :class:`~glmpost.quant.writer.QuantizeResult`."""

        c = self.config
        log(f"quantizing {len(self.plan.chosen)} layer(s) of {self.src} with {c.scheme}"
            + (f" ({self.fmt})" if c.scheme != "none" else ""))
        with MetricsWriter(staging / "metrics.jsonl") as metrics:
            result = quantize_checkpoint(self.src, staging, self.files, self.plan, self.spec, self.fmt,
                                         model_config=self.model_config, on_row=lambda row: metrics.write(**row))
        write_stage_json(staging, STAGE, options, quantized_layers=len(self.plan.chosen))
        return result

    def summary(self, result) -> tuple[dict[str, Any], str]:
        """``(summary, human line)`` of a written checkpoint."""
        c = self.config
        finite = [r["sqnr_db"] for r in result.rows if r["sqnr_db"] is not None and math.isfinite(r["sqnr_db"])]
        summary = {
            "out": str(c.out), "scheme": c.scheme, "format": self.fmt if c.scheme != "none" else None,
            "layers": result.layers, "bytes_in": result.bytes_in, "bytes_out": result.bytes_out,
            "min_sqnr_db": min(finite) if finite else None, "policy_version": result.policy_version,
        }
        human = (
            f"{c.out}: {c.scheme} {result.layers} layer(s), {result.bytes_in / 2**20:.2f} MiB -> {result.bytes_out / 2**20:.2f} MiB"
            + (f", min SQNR {min(finite):.1f} dB" if finite else "")
            + f", policy version {result.policy_version}"
        )
        return summary, human


def layer_table(rows: list[dict[str, Any]]) -> str:
    """The per-layer table of ``report``: layer, shape, SQNR (``exact`` when lossless), max abs error."""
    width = max([len(r["layer"]) for r in rows] + [5])
    lines = [f"{'layer':<{width}}  {'shape':>12}  {'SQNR dB':>8}  {'max abs err':>11}"]
    for r in rows:
        sq = "exact" if r["sqnr_db"] is None else f"{r['sqnr_db']:.2f}"
        lines.append(f"{r['layer']:<{width}}  {'x'.join(map(str, r['shape'])):>12}  {sq:>8}  {r['max_abs_err']:>11.3e}")
    return "\n".join(lines) + "\n"
