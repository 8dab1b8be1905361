"""Quantization specs: every numeric choice of a scheme, fixed in one frozen dataclass.

A :class:`QuantSpec` is the single source of truth shared by QAT's fake quant and the offline
quantizer (DESIGN.md §5, "QAT = quantize"). Two code paths that take the same spec produce the
same codes, the same stored scales and therefore the same dequantized weights, bit for bit.

Choices common to the integer schemes (documented once, here):

* **Symmetric, zero-point 0.** No zero-point tensor is stored.
* **Integer range = the full two's-complement range**: int4 is ``-8..7``, int8 ``-128..127``. Not
  ``-7..7``: -8 is a legal code of every int4 kernel and of compressed-tensors' storage (codes are
  stored offset by 8 as unsigned ``0..15``), so the clamp must admit it for any code (e.g. one
  written by another tool) to round-trip. With our scale formula a symmetric weight never *rounds*
  to -8; the clamp is a guard, not a second range.
* **Scale formula**: ``scale = absmax / qmax`` (``qmax = 7`` for int4, ``127`` for int8), computed
  in float32 from the float32 view of the group's absolute maximum. Hence ``±absmax`` maps exactly
  to ``±qmax`` (up to the rounding of the stored scale) and nothing inside the group is clipped.
  (``absmax / 7.5``, which compressed-tensors' minmax observer uses, spends the -8 code but clips
  the positive absmax to 7; we prefer no clipping. Loaders don't care: they only multiply.)
* **Scale dtype**: the scale is cast to ``scale_dtype`` *before* it is used to compute codes; that
  stored value is what both fake quant and dequant multiply by. ``scale_dtype=None`` means "the
  master weight's dtype" (bf16 master → bf16 scale, fp32 master → fp32 scale).
* **eps rule**: before the cast, the float32 scale is clamped to at least
  ``torch.finfo(scale_dtype).tiny`` (the smallest normal number). An all-zero group therefore gets
  that tiny scale and codes 0, and dequantizes to exact zeros; no division by zero, no NaN.
* **Rounding**: ``torch.round`` (round half to even) of ``w.float() / scale.float()``.
* **Clamp order**: round first, then clamp to ``[qmin, qmax]``.
* **Dequant**: ``codes.float() * scale.float()`` in float32, then cast to the output dtype (the
  master weight's dtype).

``fp8-block`` (DeepSeek-V3/SGLang block FP8): blocks of 128x128 (partial blocks at the edges when
a dimension is not a multiple of 128, as SGLang's ceil-div block layout expects),
``scale = absmax / 448`` in float32 (clamped to fp32 tiny), stored float32 as ``weight_scale_inv``;
codes are ``(w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)`` (the cast rounds to
nearest even); dequant ``codes.float() * scale``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from glmpost.config import ConfigError, setting

SCHEMES = ("w4a16", "w8a16", "w8a8-dynamic", "fp8-block", "none")
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


@dataclass(frozen=True)
class QuantSpec:
    """Everything that decides a weight's codes and scales.

    ``granularity``: ``"group"`` (``group_size`` consecutive input-dim elements of one row share a
    scale), ``"channel"`` (one scale per output row) or ``"block"`` (``block_size`` tiles).
    """

    scheme: str
    bits: int
    granularity: str
    group_size: int | None = None
    block_size: tuple[int, int] = (128, 128)
    symmetric: bool = True
    qmin: int = 0
    qmax: int = 0
    scale_dtype: torch.dtype | None = None  # None: the master weight's dtype
    code_kind: str = "int"  # "int" or "float8_e4m3fn"
    activations: str | None = None  # None (weight-only) or "int8-per-token-dynamic"

    def scale_dtype_for(self, weight_dtype: torch.dtype) -> torch.dtype:
        return self.scale_dtype if self.scale_dtype is not None else weight_dtype

    def to_json(self) -> dict:
        return {
            "scheme": self.scheme,
            "bits": self.bits,
            "granularity": self.granularity,
            "group_size": self.group_size,
            "block_size": list(self.block_size) if self.granularity == "block" else None,
            "symmetric": self.symmetric,
            "qmin": self.qmin,
            "qmax": self.qmax,
            "scale_dtype": str(self.scale_dtype).replace("torch.", "") if self.scale_dtype else "weight",
            "scale_formula": "absmax / 448" if self.code_kind != "int" else f"absmax / {self.qmax}",
            "rounding": "half-to-even",
            "activations": self.activations,
        }


CHANNEL = -1  # ``--group-size -1``: one scale per output channel (GPTQ's convention)


@dataclass
class GroupSizeSetting:
    """The w4a16 group size, the same setting in every stage that quantizes (``quantize``,
    ``sync-weights``, ``qat``): their configs inherit it."""

    group_size: int | None = setting(
        None, "w4a16 group size along the input dim (32 or 128; default 128; -1 = one scale per output channel); "
        "it must divide every quantized layer's input dim.")


def make_spec(scheme: str, *, group_size: int | None = None, scale_dtype: torch.dtype | None = None) -> QuantSpec:
    """The spec of a named scheme. ``group_size`` applies to ``w4a16`` only: a positive multiple of 8
    (32 or 128 in practice; default 128), or ``-1`` for one scale per output channel (compressed-tensors
    ``strategy: channel``; coarser, so more sensitive to outlier weights). A refusal names the config
    fields ``scheme`` and ``group_size`` (:class:`~glmpost.config.ConfigError`)."""
    if scheme not in SCHEMES:
        raise ConfigError("{scheme} {value!r}: unknown scheme (known: {known})", value=scheme, known=", ".join(SCHEMES))
    if group_size is not None and scheme != "w4a16":
        raise ConfigError("{group_size} applies to w4a16 only, not {value}", value=scheme)
    if scheme == "w4a16":
        g = 128 if group_size is None else group_size
        if g == CHANNEL:
            return QuantSpec(scheme, 4, "channel", qmin=-8, qmax=7, scale_dtype=scale_dtype)
        if g <= 0 or g % 8:
            raise ConfigError("{group_size} {value}: must be a positive multiple of 8 (e.g. 32 or 128) or -1 (per channel)", value=g)
        return QuantSpec(scheme, 4, "group", group_size=g, qmin=-8, qmax=7, scale_dtype=scale_dtype)
    if scheme in ("w8a16", "w8a8-dynamic"):
        return QuantSpec(
            scheme, 8, "channel", qmin=-128, qmax=127, scale_dtype=scale_dtype,
            activations="int8-per-token-dynamic" if scheme == "w8a8-dynamic" else None,
        )
    if scheme == "fp8-block":
        return QuantSpec(
            scheme, 8, "block", block_size=(128, 128), qmin=-448, qmax=448,
            scale_dtype=torch.float32, code_kind="float8_e4m3fn", activations="fp8-per-token-group-dynamic",
        )
    return QuantSpec("none", 16, "none")


def with_scale_dtype(spec: QuantSpec, dtype: torch.dtype | None) -> QuantSpec:
    return replace(spec, scale_dtype=dtype)
