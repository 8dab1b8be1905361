"""The one quantizer: codes and scales, dequant, fake quant with a straight-through estimator.

:func:`quantize_weight` is the only function that turns a float weight into ``(codes, scale)``.
QAT's forward uses :func:`fake_quant` = ``dequant(*quantize_weight(w))``; the offline quantizer
(``glmpost quantize``) packs the very same codes and writes the very same scale tensor, so a
loader's ``dequant(unpack(saved))`` reproduces the QAT forward weight bit for bit. All numeric
choices (range, scale formula and dtype, eps, rounding, clamp order) are documented in
:mod:`glmpost.quant.spec`.

Layouts. A weight is ``[..., out, in]`` (a ``nn.Linear`` weight, or a fused 3-D expert tensor
``[experts, out, in]``); leading dims are independent.

* group: ``codes`` int8 ``[..., out, in]``, ``scale`` ``[..., out, in // group_size]``;
* channel: ``codes`` int8 ``[..., out, in]``, ``scale`` ``[..., out, 1]``;
* block (fp8): ``codes`` float8_e4m3fn ``[..., out, in]``, ``scale`` float32
  ``[..., ceil(out / 128), ceil(in / 128)]``.

Symmetric schemes have zero-point 0 and return no zero-point.
"""

from __future__ import annotations

import sys

import torch

from glmpost.config import ConfigError
from glmpost.errors import UsageError
from glmpost.quant.spec import FP8_MAX, QuantSpec

__all__ = [
    "check_shape",
    "dequant",
    "dequant_activation",
    "fake_quant",
    "pack_int4",
    "pack_int32",
    "quantize_activation_per_token",
    "quantize_weight",
    "quantize_weight_packed",
    "unpack_int4",
    "unpack_int32",
]


# Half-way between e4m3's largest finite value 448 and the next step (480) it would have: float
# division can land the block absmax a few ulps above 448; that is rounding, not saturation.
_FP8_SATURATE = 464.0


def check_shape(shape: tuple[int, ...] | torch.Size, spec: QuantSpec, name: str = "weight") -> None:
    """Raise a one-line :class:`UsageError` when ``spec`` cannot quantize a tensor of ``shape`` (a group
    size that does not divide it: a :class:`~glmpost.config.ConfigError` naming ``group_size``)."""
    if len(shape) < 2:
        raise UsageError(f"{name}: cannot quantize a {len(shape)}-D tensor (need [..., out, in])")
    if spec.granularity == "group" and shape[-1] % spec.group_size:
        raise ConfigError("{name}: {group_size} {value} does not divide its input dim {dim} (shape {shape}); "
                          "use a group size that divides it or {exclude} this layer",
                          name=name, value=spec.group_size, dim=shape[-1], shape=list(shape))
    if spec.code_kind == "int" and spec.bits == 4 and shape[-1] % 8:
        raise UsageError(f"{name}: int4 packing needs an input dim that is a multiple of 8, got {shape[-1]} (shape {list(shape)})")


def _scale_from_absmax(absmax: torch.Tensor, divisor: float, scale_dtype: torch.dtype) -> torch.Tensor:
    """float32 ``absmax / divisor``, clamped to the stored dtype's smallest normal, then cast (stored)."""
    scale = absmax.float() / divisor
    return scale.clamp_min(torch.finfo(scale_dtype).tiny).to(scale_dtype)


def _expand_block_scale(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    return scale.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)[..., :rows, :cols]


def _block_absmax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = w.shape[-2:]
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    a = w.detach().float().abs()
    # zero padding of partial edge blocks cannot change an absolute maximum
    a = torch.nn.functional.pad(a, (0, nc * block[1] - cols, 0, nr * block[0] - rows))
    a = a.reshape(*a.shape[:-2], nr, block[0], nc, block[1])
    return a.amax(dim=(-3, -1))


def _quantize_reference(w: torch.Tensor, spec: QuantSpec, need_mask: bool = False):
    """The spec written out literally on whole tensors (see :mod:`glmpost.quant.spec`): the
    definition :func:`_quantize` must equal bit for bit (tests/test_quant_fast.py checks it)."""
    check_shape(tuple(w.shape), spec)
    if spec.granularity == "block":
        rows, cols = w.shape[-2:]
        scale = _scale_from_absmax(_block_absmax(w, spec.block_size), FP8_MAX, torch.float32)
        x = w.detach().float() / _expand_block_scale(scale, spec.block_size, rows, cols)
        in_range = x.abs() < _FP8_SATURATE if need_mask else None  # would round to <= 448 anyway
        codes = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return codes, scale, in_range
    if spec.granularity not in ("group", "channel"):
        raise UsageError(f"scheme {spec.scheme!r} does not quantize weights")
    group = spec.group_size if spec.granularity == "group" else w.shape[-1]
    scale_dtype = spec.scale_dtype_for(w.dtype)
    wg = w.detach().reshape(*w.shape[:-1], w.shape[-1] // group, group).float()
    scale = _scale_from_absmax(wg.abs().amax(dim=-1), float(spec.qmax), scale_dtype)
    q = (wg / scale.float().unsqueeze(-1)).round_()  # a new tensor: round half to even in place, then clamp
    in_range = ((q >= spec.qmin) & (q <= spec.qmax)).reshape(w.shape) if need_mask else None
    codes = q.clamp_(spec.qmin, spec.qmax).to(torch.int8).reshape(w.shape)
    return codes, scale, in_range


# ---- the same arithmetic, chunked ------------------------------------------------------------------
# Brief, "QAT：让模型在量化误差里学习" (训练与推理逐比特一致): speed may not change a single bit. The
# chunked path below runs the reference's elementwise operations (float32 widening, IEEE division by
# the stored scale, round half to even, clamp, cast) on slices small enough to stay in a core's
# cache, reusing two scratch buffers instead of allocating whole-tensor float32 temporaries, and
# broadcasting the scale over a ``[rows, groups, group]`` / ``[rows, blocks, 128]`` view instead of
# padding and ``repeat_interleave``. Every element sees the same operations on the same operands in
# the same order, so the results are identical (tests/test_quant_fast.py compares them bit for bit).

_CHUNK_ELEMS = 1 << 18  # elements per working chunk: 1 MiB of float32, inside one core's L2 (2 MiB here)
_INT_VIEW = {2: (torch.int16, 0x7FFF), 4: (torch.int32, 0x7FFFFFFF)}


def _abs_max(x: torch.Tensor, dim, scratch: torch.Tensor) -> torch.Tensor:
    """Exact ``x.abs().amax(dim)`` in ``x``'s own dtype, by clearing the sign bit of its integer view.

    With the sign bit clear, IEEE bit patterns sort as their values (+0 < subnormals < normals < inf
    < NaN), so the integer maximum *is* the absolute maximum (``-0.0`` becomes ``+0.0`` as ``abs``
    makes it). ``abs`` and ``max`` are exact in every float format, so widening afterwards equals the
    reference's ``x.float().abs().amax()``. float64 (no matching scratch) takes ``abs().amax()``.
    """
    kind = _INT_VIEW.get(x.element_size()) if x.dtype != torch.float64 else None
    if kind is None:
        return x.abs().amax(dim=dim)
    int_dtype, mask = kind
    bits = torch.bitwise_and(x.view(int_dtype), mask, out=scratch.view(int_dtype)[: x.numel()].view(x.shape))
    return bits.amax(dim=dim).view(x.dtype)


def _scratch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 working buffer, integer scratch for :func:`_abs_max`) of ``n`` elements each."""
    return torch.empty(n, dtype=torch.float32), torch.empty(4 * n, dtype=torch.uint8)


def _quantize_groups(w: torch.Tensor, spec: QuantSpec, need_mask: bool, pack: bool = False):
    """group / channel: the reference on ``[rows, groups, group]`` chunks of whole rows. With
    ``pack`` (int4, little-endian hosts) the codes come back as :func:`pack_int32` would pack them,
    computed from the float32 codes of each chunk: byte ``k`` of a row is
    ``(c[2k] + 8) + 16 * (c[2k+1] + 8)``, small integers that float32 holds exactly."""
    cols = w.shape[-1]
    group = spec.group_size if spec.granularity == "group" else cols
    ngroups = cols // group
    scale_dtype = spec.scale_dtype_for(w.dtype)
    wg = w.detach().reshape(-1, ngroups, group)
    rows = wg.shape[0]
    codes = torch.empty(rows, cols // 2, dtype=torch.uint8) if pack else torch.empty(wg.shape, dtype=torch.int8)
    scale = torch.empty(rows, ngroups, dtype=scale_dtype)
    in_range = torch.empty(wg.shape, dtype=torch.bool) if need_mask else None
    step = max(1, _CHUNK_ELEMS // max(cols, 1))
    buf, ibuf = _scratch(min(rows, step) * cols)
    for r0 in range(0, rows, step):
        x = wg[r0:r0 + step]
        s = _scale_from_absmax(_abs_max(x, -1, ibuf), float(spec.qmax), scale_dtype)
        scale[r0:r0 + step] = s
        q = buf[: x.numel()].view(x.shape)
        q.copy_(x).div_(s.float().unsqueeze(-1)).round_()  # float32 w / stored scale, half to even
        if in_range is not None:
            torch.logical_and(q >= spec.qmin, q <= spec.qmax, out=in_range[r0:r0 + step])
        q.clamp_(spec.qmin, spec.qmax)
        if pack:
            pairs = q.view(q.shape[0], cols // 2, 2)
            byte = ibuf.view(torch.float32)[: pairs.shape[0] * (cols // 2)].view(pairs.shape[:2])
            torch.add(pairs[..., 0], pairs[..., 1], alpha=16, out=byte)
            codes[r0:r0 + step] = byte.add_(136)
        else:
            codes[r0:r0 + step] = q
    scale = scale.reshape(*w.shape[:-1], ngroups)
    if pack:
        return codes.view(torch.int32).reshape(*w.shape[:-1], cols // 8), scale, None
    out_mask = in_range.reshape(w.shape) if in_range is not None else None
    return codes.reshape(w.shape), scale, out_mask


def _quantize_blocks(w: torch.Tensor, spec: QuantSpec, need_mask: bool):
    """fp8 128x128 blocks: the reference per block row, on column chunks of whole blocks; a partial
    edge block (a dimension not a multiple of 128) is just a narrower or shorter slice."""
    rows, cols = w.shape[-2:]
    br, bc = spec.block_size
    nr, nc = -(-rows // br), -(-cols // bc)
    w3 = w.detach().reshape(-1, rows, cols)
    codes = torch.empty(w3.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(w3.shape[0], nr, nc, dtype=torch.float32)
    in_range = torch.empty(w3.shape, dtype=torch.bool) if need_mask else None
    width = max(1, _CHUNK_ELEMS // (br * bc)) * bc  # columns per chunk, whole blocks
    if rows % br == 0 and cols % bc == 0 and cols <= width:
        _quantize_block_rows(w3, br, bc, codes, scale, in_range)
        out_mask = in_range.reshape(w.shape) if in_range is not None else None
        return codes.reshape(w.shape), scale.reshape(*w.shape[:-2], nr, nc), out_mask
    buf, ibuf = _scratch(min(rows, br) * min(cols, width))
    for lead in range(w3.shape[0]):
        for i in range(nr):
            r0, r1 = i * br, min(rows, (i + 1) * br)
            for c0 in range(0, cols, width):
                c1 = min(cols, c0 + width)
                x = w3[lead, r0:r1, c0:c1]
                full, tail = (c1 - c0) // bc, (c1 - c0) % bc
                parts = []
                if full:
                    xf = x[:, : full * bc].reshape(r1 - r0, full, bc)
                    parts.append(_abs_max(xf, (0, 2), ibuf))
                if tail:
                    parts.append(_abs_max(x[:, full * bc:], (0, 1), ibuf).reshape(1))
                am = parts[0] if len(parts) == 1 else torch.cat(parts)
                s = _scale_from_absmax(am, FP8_MAX, torch.float32)
                scale[lead, i, c0 // bc: c0 // bc + s.numel()] = s
                q = buf[: x.numel()].view(x.shape).copy_(x)
                if full:
                    q[:, : full * bc].view(r1 - r0, full, bc).div_(s[:full].view(1, full, 1))
                if tail:
                    q[:, full * bc:].div_(s[full])
                if in_range is not None:
                    torch.lt(q.abs(), _FP8_SATURATE, out=in_range[lead, r0:r1, c0:c1])
                # The reference clamps to +-448 before the cast; here no element can exceed it by
                # more than rounding (|w| <= absmax, scale = absmax / 448 rounded), and e4m3fn's
                # cast rounds everything below 464 to at most 448, so the clamp cannot change a bit
                # and is skipped. The cast rounds to nearest even.
                codes[lead, r0:r1, c0:c1] = q
    out_mask = in_range.reshape(w.shape) if in_range is not None else None
    return codes.reshape(w.shape), scale.reshape(*w.shape[:-2], nr, nc), out_mask


def _quantize_block_rows(w3: torch.Tensor, br: int, bc: int, codes: torch.Tensor, scale: torch.Tensor,
                         in_range: torch.Tensor | None) -> None:
    """:func:`_quantize_blocks` when whole blocks tile the matrix and a block row fits a chunk:
    several block rows (of every leading index) per chunk, as ``[k, br, nc, bc]`` views, so a
    narrow matrix takes a few large steps instead of one small step per block row."""
    lead, rows, cols = w3.shape
    nc = cols // bc
    blocks = w3.reshape(lead * rows // br, br, nc, bc)  # block row r of matrix l is row l * nr + r
    out = codes.view(blocks.shape)
    flat_scale = scale.view(-1, nc)
    mask = in_range.view(blocks.shape) if in_range is not None else None
    step = max(1, _CHUNK_ELEMS // (br * cols))
    buf, ibuf = _scratch(min(blocks.shape[0], step) * br * cols)
    for b0 in range(0, blocks.shape[0], step):
        x = blocks[b0:b0 + step]
        s = _scale_from_absmax(_abs_max(x, (1, 3), ibuf), FP8_MAX, torch.float32)
        flat_scale[b0:b0 + step] = s
        q = buf[: x.numel()].view(x.shape).copy_(x).div_(s.view(-1, 1, nc, 1))
        if mask is not None:
            torch.lt(q.abs(), _FP8_SATURATE, out=mask[b0:b0 + step])
        out[b0:b0 + step] = q  # no clamp needed: see _quantize_blocks


def _quantize(w: torch.Tensor, spec: QuantSpec, need_mask: bool = False):
    """``(codes, scale, in_range)``; ``in_range`` (only with ``need_mask``, else None) marks elements
    the clamp did not touch (for the STE). Bit for bit :func:`_quantize_reference`, chunked."""
    check_shape(tuple(w.shape), spec)
    if not w.is_floating_point() or w.device.type != "cpu" or w.numel() == 0:
        return _quantize_reference(w, spec, need_mask)  # accelerators: whole-tensor kernels are the fast path
    if spec.granularity == "block":
        return _quantize_blocks(w, spec, need_mask)
    if spec.granularity not in ("group", "channel"):
        raise UsageError(f"scheme {spec.scheme!r} does not quantize weights")
    return _quantize_groups(w, spec, need_mask)


def quantize_weight(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """THE quantizer: ``(codes, scale)`` of ``w`` under ``spec`` (symmetric: no zero-point)."""
    codes, scale, _ = _quantize(w, spec)
    return codes, scale


def quantize_weight_packed(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pack_int32(codes, spec.bits), scale)`` of ``quantize_weight(w, spec)`` for an integer spec:
    what compressed-tensors ``pack-quantized`` stores, int4 codes packed as they are computed."""
    if spec.code_kind != "int":
        raise UsageError(f"scheme {spec.scheme!r} does not pack integer codes")
    check_shape(tuple(w.shape), spec)
    if spec.bits == 4 and sys.byteorder == "little" and w.is_floating_point() and w.device.type == "cpu" and w.numel():
        packed, scale, _ = _quantize_groups(w, spec, need_mask=False, pack=True)
        return packed, scale
    codes, scale = quantize_weight(w, spec)
    return pack_int32(codes, spec.bits), scale


def dequant(codes: torch.Tensor, scale: torch.Tensor, spec: QuantSpec, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scale`` in float32 (scale broadcast over its group/channel/block), cast to ``dtype``."""
    if spec.granularity == "block":
        rows, cols = codes.shape[-2:]
        return (codes.float() * _expand_block_scale(scale, spec.block_size, rows, cols)).to(dtype)
    n = scale.shape[-1]
    cg = codes.reshape(*codes.shape[:-1], n, codes.shape[-1] // n).float()
    return (cg * scale.float().unsqueeze(-1)).reshape(codes.shape).to(dtype)


class _FakeQuant(torch.autograd.Function):
    """Forward: ``dequant(quantize_weight(w))`` exactly. Backward: straight-through estimator.

    The gradient of round is taken as the identity; the clamp is differentiated as it is: identity
    for elements whose rounded value lies inside ``[qmin, qmax]`` (fp8: ``|w / s| < 464``, i.e. it
    would round to at most 448), zero for elements the clamp saturated. With ``scale = absmax / qmax``
    computed from the same weight nothing saturates (a bf16 scale is off by at most 2**-9, which
    moves ``absmax / scale`` by < 0.25 of a step), so in practice the gradient is exactly the
    upstream gradient; the mask matters only for codes/scales produced otherwise. The scale is a
    constant for autograd (no gradient flows through the absmax).
    """

    @staticmethod
    def forward(ctx, w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
        codes, scale, in_range = _quantize(w, spec, need_mask=True)
        ctx.save_for_backward(in_range)
        return dequant(codes, scale, spec, w.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (in_range,) = ctx.saved_tensors
        return grad * in_range.to(grad.dtype), None


def fake_quant(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The QAT forward weight (same dtype as ``w``), differentiable by the STE; ``none`` is identity."""
    if spec.scheme == "none":
        return w
    return _FakeQuant.apply(w, spec)


# ---- int4 packing (compressed-tensors ``pack-quantized``) -----------------------------------------

def pack_int32(codes: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Signed ``bits``-bit codes ``[..., n]`` (int8) -> int32 ``[..., n // (32 // bits)]``, bits 4 or 8.

    compressed-tensors' ``pack-quantized`` layout: each code is stored offset by ``2**(bits-1)``
    (int4: unsigned 0..15); element ``f * j + i`` of a row (``f = 32 // bits`` values per word) goes
    to bits ``bits * i ..`` of int32 ``j`` (lowest bits first); the uint32 bit pattern is stored as
    int32. ``n`` must be a multiple of ``f`` (group sizes are multiples of 8, so rows are).
    """
    if bits not in (4, 8):
        raise ValueError(f"pack_int32: bits must be 4 or 8, got {bits}")
    factor, offset = 32 // bits, 1 << (bits - 1)
    if codes.shape[-1] % factor:
        raise UsageError(f"int{bits} packing needs a multiple of {factor} values per row, got {codes.shape[-1]}")
    if codes.numel() and (int(codes.min()) < -offset or int(codes.max()) > offset - 1):
        raise ValueError(f"int{bits} codes must lie in {-offset}..{offset - 1}")
    if sys.byteorder == "little":  # bytes of a word, lowest first: same layout, no int64 detour
        u = (codes.to(torch.int8) + offset) if bits == 4 else codes.to(torch.int8)
        u = u.view(torch.uint8) if bits == 4 else u.view(torch.uint8) ^ 0x80  # + offset, mod 256
        if bits == 4:
            u = u[..., 0::2] | (u[..., 1::2] << 4)
        return u.contiguous().view(torch.int32)
    shifts = torch.arange(factor, dtype=torch.int64) * bits
    u = (codes.to(torch.int64) + offset).reshape(*codes.shape[:-1], codes.shape[-1] // factor, factor)
    packed = (u << shifts).sum(dim=-1)  # < 2**32, exact in int64
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_int32(packed: torch.Tensor, bits: int = 4, n: int | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: int32 ``[..., m]`` -> int8 codes ``[..., n]`` (default all)."""
    factor, offset = 32 // bits, 1 << (bits - 1)
    if sys.byteorder == "little":
        b = packed.contiguous().view(torch.uint8)
        if bits == 4:
            b = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * factor)
        codes = (b.to(torch.int16) - offset).to(torch.int8)
        return codes if n is None else codes[..., :n]
    shifts = torch.arange(factor, dtype=torch.int64) * bits
    p = packed.to(torch.int64) & 0xFFFFFFFF
    u = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    codes = (u - offset).to(torch.int8).reshape(*packed.shape[:-1], packed.shape[-1] * factor)
    return codes if n is None else codes[..., :n]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes -> int32, 8 per word, lowest nibble first, offset by 8 (see :func:`pack_int32`)."""
    return pack_int32(codes, 4)


def unpack_int4(packed: torch.Tensor, n: int | None = None) -> torch.Tensor:
    return unpack_int32(packed, 4, n)


# ---- activations (w8a8-dynamic) ----------------------------------------------------------------------


def quantize_activation_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 per-token dynamic activation quantization, as ``w8a8-dynamic`` runs it at inference.

    Each token (a row over the last dim) gets ``scale = absmax / 127`` in float32 (clamped to fp32
    tiny for an all-zero token), computed at run time from that token alone; codes are
    ``clamp(round_half_even(x / scale), -128, 127)`` as int8. Returns ``(codes, scale[..., 1])``;
    ``dequant_activation(codes, scale)`` = ``codes * scale``. The int8 GEMM computes
    ``(x_codes @ w_codes.T) * x_scale * w_scale.T``; weights use :func:`quantize_weight` with the
    per-channel ``w8a8-dynamic`` spec.
    """
    scale = _scale_from_absmax(x.detach().abs().amax(dim=-1, keepdim=True), 127.0, torch.float32)
    codes = torch.round(x.detach().float() / scale).clamp(-128, 127).to(torch.int8)
    return codes, scale


def dequant_activation(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (codes.float() * scale).to(dtype)
