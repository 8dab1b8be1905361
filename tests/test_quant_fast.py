"""The chunked quantizer (glmpost.quant.core._quantize) equals the spec written out literally
(_quantize_reference) bit for bit: codes, stored scales and the STE mask, for every scheme, over
shapes whose dims do and do not divide the group/block, fp32/bf16/fp16 masters, many seeds, and the
edge values (all-zero groups, ±absmax, .5 ties, -0.0, subnormals). Chunk sizes are shrunk so that
every test crosses chunk boundaries, partial chunks and partial 128x128 blocks."""

from __future__ import annotations

import pytest
import torch

from glmpost.quant import core, make_spec, pack_int32, quantize_weight
from glmpost.quant.core import (
    _abs_max,
    _quantize,
    _quantize_reference,
    quantize_weight_packed,
)
from glmpost.quant.formats import encode_layer, encode_weight

SPECS = {
    "w4a16-g8": make_spec("w4a16", group_size=8),
    "w4a16-g32": make_spec("w4a16", group_size=32),
    "w4a16-g128": make_spec("w4a16", group_size=128),
    "w4a16-channel": make_spec("w4a16", group_size=-1),
    "w4a16-g32-fp32scale": make_spec("w4a16", group_size=32, scale_dtype=torch.float32),
    "w8a16": make_spec("w8a16"),
    "w8a8-dynamic": make_spec("w8a8-dynamic"),
    "fp8-block": make_spec("fp8-block"),
}
# (3, 256, 128): whole 128x128 blocks, one block row per chunk (fp8's block-row path)
SHAPES = [(256, 256), (136, 264), (2, 130, 200), (1, 8), (129, 1000), (3, 5, 384), (3, 256, 128)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bits(t: torch.Tensor | None):
    if t is None:
        return None
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _assert_same(fast, ref):
    for a, b in zip(fast, ref):
        if a is None or b is None:
            assert a is None and b is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b))


def _applies(spec, shape) -> bool:
    if spec.granularity == "group" and shape[-1] % spec.group_size:
        return False
    return not (spec.code_kind == "int" and spec.bits == 4 and shape[-1] % 8)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4096 elements: many chunks per tensor, a partial last one, fp8 column chunks
    narrower than the row (so a partial 128-column block sits at a chunk's edge)."""
    monkeypatch.setattr(core, "_CHUNK_ELEMS", 4096)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as sync-weights runs it (and thousands of tiny ops stay fast on shared cores)
    yield
    torch.set_num_threads(threads)


def _weight(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    w.view(-1)[:: 97] *= 40  # outliers: groups with very different ranges
    return w.to(dtype)


@pytest.mark.parametrize("name", SPECS)
def test_fast_path_equals_reference_over_shapes_dtypes_and_seeds(name, small_chunks):
    spec = SPECS[name]
    for seed in range(3):
        for shape in SHAPES:
            if not _applies(spec, shape):
                continue
            for dtype in DTYPES:
                w = _weight(shape, dtype, seed)
                for need_mask in (False, True):
                    _assert_same(_quantize(w, spec, need_mask), _quantize_reference(w, spec, need_mask))


@pytest.mark.parametrize("name", SPECS)
def test_fast_path_equals_reference_at_default_chunk_size(name):
    spec = SPECS[name]
    for seed in range(3):
        # (3, 256, 512): fp8 chunks of 4 block rows that span two of the 3 matrices
        for shape in [(512, 1024), (300, 520), (2, 256, 136), (3, 256, 512)]:
            if _applies(spec, shape):
                w = _weight(shape, torch.bfloat16, seed)
                for need_mask in (False, True):
                    _assert_same(_quantize(w, spec, need_mask), _quantize_reference(w, spec, need_mask))


def _edge_weight(dtype) -> torch.Tensor:
    """Rows of hand-made groups of 8: zeros, -0.0, ±absmax, exact .5 ties, subnormals."""
    rows = [
        [0.0] * 8,  # all-zero group: tiny scale, codes 0
        [-0.0] * 8,
        [7.0, -7.0, 0.5, 1.5, 2.5, -2.5, 3.5, -0.5],  # scale 1: ties round half to even (0, 2, 2, -2, 4, -0)
        [14.0, 1.0, 3.0, -5.0, 7.0, -9.0, 11.0, 13.0],  # scale 2: w/s = .5, 1.5, -2.5, 3.5, -4.5, ... ties
        [1e-40, -1e-40, 0.0, 3e-41, 0.0, 0.0, 0.0, 0.0],  # fp32 subnormal absmax: scale clamps to tiny
        [-3.0, 3.0, 3.0, -3.0, 0.0, 0.0, 1.5, -1.5],  # absmax at both signs
        [448.0, -448.0, 224.0, 0.0, 1.0, -1.0, 100.0, 447.0],
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
    ]
    w = torch.tensor(rows, dtype=torch.float32)
    return torch.cat([w] * 16, dim=1).to(dtype)  # 8 x 128: groups of 8 repeat, one fp8 block wide


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fast_path_equals_reference_on_edge_values(name, dtype, small_chunks):
    spec = SPECS[name]
    w = _edge_weight(dtype)
    for need_mask in (False, True):
        _assert_same(_quantize(w, spec, need_mask), _quantize_reference(w, spec, need_mask))


def test_fp8_fast_path_needs_no_clamp_on_any_block_scale():
    """The chunked fp8 path skips the reference's clamp to +-448: w / (absmax / 448) exceeds 448 by
    rounding only, far below 464 where e4m3fn's cast stops rounding to 448. Blocks whose absmax
    spans 2^-140 .. 2^120 (fp32 subnormals included), with inf and NaN blocks, equal the reference."""
    spec = SPECS["fp8-block"]
    g = torch.Generator().manual_seed(0)
    absmax = torch.exp2(torch.empty(64).uniform_(-140, 120, generator=g)) * (1 + torch.rand(64, generator=g))
    quotient = absmax / (absmax / 448.0).clamp_min(torch.finfo(torch.float32).tiny)
    assert quotient.max().item() < 448.0 * (1 + 2**-20)
    blocks = torch.rand(64, 128, 128, generator=g) * 2 - 1
    blocks = blocks / blocks.abs().amax(dim=(1, 2), keepdim=True) * absmax.view(-1, 1, 1)  # absmax reached
    w = blocks.reshape(8, 8, 128, 128).permute(0, 2, 1, 3).reshape(1024, 1024).contiguous()
    w[0, 5], w[200, 300], w[900, 1000] = float("inf"), float("-inf"), float("nan")
    (codes, scale, _), (ref_codes, ref_scale, _) = _quantize(w, spec), _quantize_reference(w, spec)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32))  # bitwise: NaN scales too
    assert scale.isnan().sum() == 1 and scale.isinf().sum() == 2


def test_half_ties_round_to_even_in_the_fast_path():
    """Hand-computed: group absmax 7 (int4) gives scale 1, so codes are round-half-even of w."""
    spec = make_spec("w4a16", group_size=8, scale_dtype=torch.float32)
    w = torch.tensor([[7.0, -7.0, 0.5, 1.5, 2.5, -2.5, 3.5, -0.5]])
    codes, scale = quantize_weight(w, spec)
    assert scale.tolist() == [[1.0]]
    assert codes.tolist() == [[7, -7, 0, 2, 2, -2, 4, 0]]


def test_abs_max_by_sign_cleared_bits_is_exact_for_every_bf16_and_fp16_value():
    """Every 16-bit pattern that is not NaN: the integer-view absmax equals float abs().amax()."""
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
        x = x[~torch.isnan(x)]
        x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]
        x = x[: (x.numel() // 64) * 64].reshape(-1, 64)
        scratch = torch.empty(4 * x.numel(), dtype=torch.uint8)
        got = _abs_max(x, -1, scratch)
        assert got.dtype == dtype
        assert torch.equal(got.float(), x.float().abs().amax(dim=-1))
        assert not torch.signbit(got).any()  # -0.0 comes out as +0.0, as abs makes it


def test_abs_max_of_fp32_extremes():
    x = torch.tensor([[-0.0, 0.0], [1e-45, -1e-45], [-3.4e38, 1.0], [float("-inf"), 2.0]])
    got = _abs_max(x, -1, torch.empty(4 * x.numel(), dtype=torch.uint8))
    assert got.tolist() == [0.0, 1e-45, 3.4e38, float("inf")] or torch.equal(got, x.abs().amax(-1))
    assert torch.equal(got, x.abs().amax(-1))


@pytest.mark.parametrize("name", ["w4a16-g8", "w4a16-g32", "w4a16-channel", "w4a16-g32-fp32scale", "w8a16"])
def test_packed_quantizer_equals_pack_of_codes(name, small_chunks):
    spec = SPECS[name]
    for seed in range(4):
        for shape in [(64, 256), (136, 264), (2, 40, 32)]:
            if not _applies(spec, shape):
                continue
            for dtype in DTYPES:
                w = _weight(shape, dtype, seed)
                codes, scale = _quantize_reference(w, spec)[:2]
                packed, packed_scale = quantize_weight_packed(w, spec)
                assert torch.equal(packed, pack_int32(codes, spec.bits))
                assert torch.equal(packed_scale, scale) and packed_scale.dtype == scale.dtype
    w = _edge_weight(torch.bfloat16)
    codes, scale = _quantize_reference(w, SPECS["w4a16-g8"])[:2]
    assert torch.equal(quantize_weight_packed(w, SPECS["w4a16-g8"])[0], pack_int32(codes, 4))


@pytest.mark.parametrize("name", ["w4a16-g32", "w8a16", "w8a8-dynamic", "fp8-block"])
def test_encode_weight_equals_encode_layer_of_quantize_weight(name):
    spec = SPECS[name]
    w = _weight((136, 256), torch.bfloat16, 7)
    codes, scale = quantize_weight(w, spec)
    expected = encode_layer("m", codes, scale, spec)
    got = encode_weight("m", w, spec)
    assert list(got) == list(expected)
    for key in expected:
        assert got[key].dtype == expected[key].dtype and torch.equal(_bits(got[key]), _bits(expected[key]))


def test_fake_quant_forward_and_ste_unchanged_by_chunking(small_chunks):
    """QAT's forward runs the chunked path too: its output is dequant of the reference codes."""
    spec = SPECS["w4a16-g32"]
    w = _weight((96, 128), torch.float32, 3).requires_grad_(True)
    out = core.fake_quant(w, spec)
    codes, scale, _ = _quantize_reference(w, spec)
    assert torch.equal(out.detach(), core.dequant(codes, scale, spec, w.dtype))
    out.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))
