"""glmpost.quant: one quantizer for QAT's fake quant and the offline format writers (bit exactness)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from glmpost.errors import UsageError
from glmpost.quant import (
    dequant,
    dequant_activation,
    fake_quant,
    make_spec,
    pack_int4,
    pack_int32,
    quantize_activation_per_token,
    quantize_weight,
    unpack_int4,
    unpack_int32,
)
from glmpost.quant.formats import (
    MODELSLIM_DESCRIPTION,
    encode_layer,
    load_quantized_state,
    modelslim_description,
    quantization_config,
)
from glmpost.quant.targets import Candidate, select_targets

SPECS = {
    "w4a16-g32": make_spec("w4a16", group_size=32),
    "w4a16-g128": make_spec("w4a16", group_size=128),
    "w4a16-channel": make_spec("w4a16", group_size=-1),
    "w8a16": make_spec("w8a16"),
    "w8a8-dynamic": make_spec("w8a8-dynamic"),
    "w8a8-dynamic-msmodelslim": make_spec("w8a8-dynamic"),
    "fp8-block": make_spec("fp8-block"),
}
FORMAT = {"fp8-block": "fp8", "w8a8-dynamic-msmodelslim": "msmodelslim"}


def _hard_weight(seed: int, shape: tuple[int, int], dtype: torch.dtype, group: int) -> torch.Tensor:
    """Random weight with an all-zero group, an all-zero row, exact absmax duplicates and sign flips."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * (0.02 + seed % 5)
    w[0, :group] = 0.0  # an all-zero group (and block start)
    w[1] = 0.0  # an all-zero row/channel
    w[2, 3] = w[2, :group].abs().max()  # two elements at the absmax ...
    w[2, 5] = -w[2, 3]  # ... of both signs
    w[3] *= 1e-30  # a group of tiny values (near the eps clamp)
    return w.to(dtype)


def _roundtrip_via_disk(tmp_path, module, w, spec, fmt):
    codes, scale = quantize_weight(w, spec)
    tensors = encode_layer(module, codes, scale, spec, fmt)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    if fmt == "msmodelslim":  # the type map replaces config.json's quantization_config
        (tmp_path / MODELSLIM_DESCRIPTION).write_text(json.dumps(modelslim_description(tensors, [module])))
        (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    else:
        qc = quantization_config(spec, fmt, ignore=[])
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc, "dtype": "float32"}))
    return load_quantized_state(tmp_path, dtype=w.dtype)[f"{module}.weight"], tensors


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_tensors_dequantize_to_the_qat_forward_bit_for_bit(tmp_path, name, dtype):
    spec = SPECS[name]
    fmt = FORMAT.get(name, "compressed-tensors")
    shape = (200, 320) if name == "fp8-block" else (48, 256)  # fp8: partial 128x128 blocks
    for seed in range(12):
        w = _hard_weight(seed, shape, dtype, spec.group_size or 128)
        qat = fake_quant(w, spec)
        assert qat.dtype == dtype
        assert torch.isfinite(qat.float()).all()
        deployed, tensors = _roundtrip_via_disk(tmp_path, "layer", w, spec, fmt)
        assert deployed.dtype == dtype
        assert torch.equal(deployed, qat), f"{name} {dtype} seed {seed}"
        assert torch.equal(qat[1], torch.zeros_like(qat[1]))  # all-zero row stays exactly zero
    if name.startswith("w4a16"):
        assert tensors["layer.weight_packed"].dtype == torch.int32
        assert tuple(tensors["layer.weight_packed"].shape) == (shape[0], shape[1] // 8)
        assert tuple(tensors["layer.weight_scale"].shape) == (shape[0], shape[1] // (spec.group_size or shape[1]))
        assert tensors["layer.weight_scale"].dtype == dtype  # scale stored in the master's dtype
        assert tensors["layer.weight_shape"].tolist() == list(shape)
    if name == "fp8-block":
        assert tensors["layer.weight"].dtype == torch.float8_e4m3fn
        assert tuple(tensors["layer.weight_scale_inv"].shape) == (2, 3)  # ceil(200/128), ceil(320/128)
        assert tensors["layer.weight_scale_inv"].dtype == torch.float32
    if name == "w4a16-channel":
        assert tuple(tensors["layer.weight_scale"].shape) == (shape[0], 1)
    if name == "w8a8-dynamic-msmodelslim":  # vLLM-Ascend's AscendW8A8DynamicLinearMethod layout
        assert tensors["layer.weight"].dtype == torch.int8 and tuple(tensors["layer.weight"].shape) == shape
        for key in ("layer.weight_scale", "layer.weight_offset"):
            assert tensors[key].dtype == torch.float32 and tuple(tensors[key].shape) == (shape[0], 1)
        assert not tensors["layer.weight_offset"].any()
        assert torch.equal(tensors["layer.weight_scale"], quantize_weight(w, spec)[1].float())


def test_fused_expert_tensor_quantizes_like_its_per_expert_slices():
    spec = SPECS["w4a16-g32"]
    fused = torch.randn(4, 64, 96, generator=torch.Generator().manual_seed(1))  # [E, out, in]
    codes, scale = quantize_weight(fused, spec)
    for e in range(4):
        c, s = quantize_weight(fused[e], spec)
        assert torch.equal(codes[e], c) and torch.equal(scale[e], s)
    assert torch.equal(fake_quant(fused, spec)[2], fake_quant(fused[2].clone(), spec))


def test_ties_round_half_to_even_and_absmax_maps_to_qmax():
    spec = make_spec("w4a16", group_size=32)
    for dtype in (torch.float32, torch.bfloat16):
        row = torch.zeros(32)
        # absmax 7 -> scale exactly 1.0 (in fp32 and bf16), so w / scale hits k + 0.5 exactly
        row[:10] = torch.tensor([7.0, 0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5, 4.5])
        row[10] = -7.0
        w = row.unsqueeze(0).to(dtype)
        codes, scale = quantize_weight(w, spec)
        assert scale.dtype == dtype and float(scale) == 1.0
        assert codes[0, :11].tolist() == [7, 0, 2, 2, 4, 0, -2, -2, -4, 4, -7]
        assert torch.equal(fake_quant(w, spec), codes.to(dtype))
    # ties against a non-unit scale: absmax 3.5 -> scale 0.5, w = 0.25 * odd
    w = torch.tensor([[3.5, 0.25, 0.75, 1.25, -0.25, -0.75] + [0.0] * 26])
    codes, scale = quantize_weight(w, spec)
    assert float(scale) == 0.5
    assert codes[0, :6].tolist() == [7, 0, 2, 2, 0, -2]
    # int8 per channel: absmax 127 -> scale 1
    w8 = torch.tensor([[127.0, 0.5, 1.5, -126.5, 2.5]])
    c8, s8 = quantize_weight(w8, make_spec("w8a16"))
    assert float(s8) == 1.0 and c8.tolist() == [[127, 0, 2, -126, 2]]


def test_all_zero_group_uses_the_eps_scale_and_dequantizes_to_zero():
    for dtype in (torch.float32, torch.bfloat16):
        spec = make_spec("w4a16", group_size=32)
        w = torch.zeros(2, 64, dtype=dtype)
        w[1, 40] = 1.0
        codes, scale = quantize_weight(w, spec)
        assert float(scale[0, 0]) == torch.finfo(dtype).tiny
        assert torch.equal(codes[0], torch.zeros(64, dtype=torch.int8))
        out = fake_quant(w, spec)
        assert torch.equal(out[0], torch.zeros(64, dtype=dtype)) and float(out[1, 40]) == 1.0
    c, s = quantize_weight(torch.zeros(130, 130), make_spec("fp8-block"))
    assert (s == torch.finfo(torch.float32).tiny).all() and (c.float() == 0).all()


def test_pack_order_matches_compressed_tensors_hand_example():
    codes = torch.tensor([[-8, -1, 0, 7, 1, 2, 3, 4]], dtype=torch.int8)
    # offset by 8: [0, 7, 8, 15, 9, 10, 11, 12], lowest nibble first -> 0xCBA9F870 as a signed int32
    expected = 0xCBA9F870 - 2**32
    packed = pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.tolist() == [[expected]]
    assert unpack_int4(packed).tolist() == codes.tolist()
    # int8: 4 per word, offset 128, lowest byte first
    c8 = torch.tensor([[-128, -1, 0, 127]], dtype=torch.int8)
    assert pack_int32(c8, 8).tolist() == [[0xFF807F00 - 2**32]]


def test_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(0)
    for bits, lo, hi in ((4, -8, 8), (8, -128, 128)):
        codes = torch.randint(lo, hi, (3, 5, 64), generator=g).to(torch.int8)
        assert torch.equal(unpack_int32(pack_int32(codes, bits), bits), codes)
    with pytest.raises(UsageError):
        pack_int4(torch.zeros(1, 12, dtype=torch.int8))


@pytest.mark.parametrize("name", list(SPECS))
def test_straight_through_gradient_is_the_upstream_gradient(name):
    spec = SPECS[name]
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3), requires_grad=True)
    upstream = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    fake_quant(w, spec).backward(upstream)
    assert torch.equal(w.grad, upstream)
    wb = w.detach().to(torch.bfloat16).requires_grad_(True)
    fake_quant(wb, spec).backward(upstream.to(torch.bfloat16))
    assert torch.equal(wb.grad, upstream.to(torch.bfloat16))


def test_activation_per_token_quantization():
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0))
    x[1, 2] = 0.0
    codes, scale = quantize_activation_per_token(x)
    assert codes.dtype == torch.int8 and tuple(scale.shape) == (3, 5, 1) and scale.dtype == torch.float32
    assert codes.abs().amax(dim=-1).eq(127).sum() == 14  # every non-zero token reaches +-127
    back = dequant_activation(codes, scale)
    assert (back - x).abs().le(scale / 2 + 1e-12).all()
    assert torch.equal(back[1, 2], torch.zeros(64))


def test_spec_errors_and_documented_numerics():
    with pytest.raises(UsageError, match="unknown scheme"):
        make_spec("w3a16")
    with pytest.raises(UsageError, match="multiple of 8"):
        make_spec("w4a16", group_size=12)
    with pytest.raises(UsageError, match="does not divide"):
        quantize_weight(torch.zeros(4, 48), make_spec("w4a16", group_size=32))
    spec = make_spec("w4a16")
    assert (spec.qmin, spec.qmax, spec.group_size) == (-8, 7, 128)
    assert make_spec("none").scheme == "none"
    w = torch.randn(4, 8)
    assert fake_quant(w, make_spec("none")) is w


def test_dequant_matches_codes_times_scale():
    spec = make_spec("w4a16", group_size=32)
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    codes, scale = quantize_weight(w, spec)
    manual = codes.float() * scale.repeat_interleave(32, dim=1)
    assert torch.equal(dequant(codes, scale, spec), manual)


def _cands():
    L = "model.layers.1."
    return [
        Candidate("model.embed_tokens", "embedding"),
        Candidate("lm_head", "linear"),
        Candidate(L + "self_attn.q_a_proj", "linear"),
        Candidate(L + "self_attn.indexer.wk", "linear"),
        Candidate(L + "mlp.gate", "router"),
        Candidate(L + "mlp.shared_experts.up_proj", "linear"),
        Candidate(L + "mlp.experts.0.up_proj", "expert"),
        Candidate(L + "mlp.experts.1.down_proj", "expert"),
    ]


def test_target_selection_rules():
    L = "model.layers.1."
    assert select_targets(_cands()) == sorted(
        [L + "self_attn.q_a_proj", L + "mlp.shared_experts.up_proj", L + "mlp.experts.0.up_proj", L + "mlp.experts.1.down_proj"]
    )
    assert select_targets(_cands(), targets="moe-only") == [L + "mlp.experts.0.up_proj", L + "mlp.experts.1.down_proj"]
    got = select_targets(_cands(), targets="moe-only", include=[r"lm_head", r"mlp\.gate$"], exclude=[r"experts\.1\."])
    assert got == ["lm_head", L + "mlp.experts.0.up_proj", L + "mlp.gate"]
    with pytest.raises(UsageError, match="matches no quantizable layer"):
        select_targets(_cands(), include=["nothing_here"])
    with pytest.raises(UsageError, match="matches no quantizable layer"):
        select_targets(_cands(), exclude=["nothing_here"])
    with pytest.raises(UsageError, match="not a valid regular expression"):
        select_targets(_cands(), include=["("])
    with pytest.raises(UsageError, match="--targets"):
        select_targets(_cands(), targets="attention")


def test_byte_view_packing_equals_the_portable_shift_path(monkeypatch):
    from glmpost.quant import core

    g = torch.Generator().manual_seed(7)
    for bits, lo, hi in ((4, -8, 8), (8, -128, 128)):
        codes = torch.randint(lo, hi, (5, 3, 64), generator=g).to(torch.int8)
        fast = pack_int32(codes, bits)
        with monkeypatch.context() as m:
            m.setattr(core, "sys", type("BigEndian", (), {"byteorder": "big"}))
            slow = core.pack_int32(codes, bits)
            assert torch.equal(core.unpack_int32(slow, bits), codes)
        assert torch.equal(fast, slow)


def test_msmodelslim_ties_absmax_and_zero_rows_on_disk(tmp_path):
    """int8 per channel through the msModelSlim layout: absmax 127 -> scale exactly 1, ties to even,
    -absmax -> -127, an all-zero row -> eps scale and exact zeros; fp32 and bf16 masters."""
    spec = make_spec("w8a8-dynamic")
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.zeros(3, 8, dtype=dtype)
        w[0] = torch.tensor([127.0, 0.5, 1.5, -126.5, 2.5, -0.5, -127.0, 3.5])
        w[2, 1] = -2.0  # absmax at a negative value: -2 -> -127
        deployed, tensors = _roundtrip_via_disk(tmp_path, "m", w, spec, "msmodelslim")
        assert tensors["m.weight"][0].tolist() == [127, 0, 2, -126, 2, 0, -127, 4]
        assert tensors["m.weight"][2, 1] == -127 and not tensors["m.weight"][1].any()
        assert float(tensors["m.weight_scale"][0, 0]) == 1.0
        assert float(tensors["m.weight_scale"][1, 0]) == torch.finfo(dtype).tiny
        assert torch.equal(deployed, fake_quant(w, spec)) and deployed.dtype == dtype
        assert not deployed[1].any()
        description = json.loads((tmp_path / MODELSLIM_DESCRIPTION).read_text())
        assert description["model_quant_type"] == "W8A8_DYNAMIC"
        assert {description[k] for k in ("m.weight", "m.weight_scale", "m.weight_offset")} == {"W8A8_DYNAMIC"}


def test_msmodelslim_reader_refuses_what_it_cannot_reproduce(tmp_path):
    from glmpost.errors import GlmpostError

    spec = make_spec("w8a8-dynamic")
    w = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    _roundtrip_via_disk(tmp_path, "m", w, spec, "msmodelslim")
    tensors = encode_layer("m", *quantize_weight(w, spec), spec, "msmodelslim")
    tensors["m.weight_offset"][2, 0] = 3.0  # asymmetric: not what the one quantizer writes
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(GlmpostError, match="weight_offset is not zero"):
        load_quantized_state(tmp_path)
    description = json.loads((tmp_path / MODELSLIM_DESCRIPTION).read_text())
    (tmp_path / MODELSLIM_DESCRIPTION).write_text(json.dumps({**description, "model_quant_type": "W4A8_DYNAMIC"}))
    with pytest.raises(GlmpostError, match="model_quant_type 'W4A8_DYNAMIC' is not supported"):
        load_quantized_state(tmp_path)
