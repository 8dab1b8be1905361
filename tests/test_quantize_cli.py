"""``glmpost quantize``: packed checkpoints whose dequantized weights equal the QAT forward bit for bit."""

from __future__ import annotations

import json
import math

import pytest
import torch

from glmpost.quant import fake_quant, make_spec, unpack_int4
from glmpost.quant.formats import load_quantized_state, read_tensors

SKIPPED = ("embed_tokens", "lm_head", ".mlp.gate.", ".indexer.", ".kv_b_proj.")
KV_B = ["model.layers.0.self_attn.kv_b_proj", "model.layers.1.self_attn.kv_b_proj"]


def _quantize(glmpost_cli, src, out, *args):
    result = glmpost_cli("quantize", src, "--out", out, *args)
    assert result.exit_code == 0, result.stderr
    return result


def _layers(out):
    return [json.loads(line)["layer"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_bit_exact(src, out, spec, dtype=None):
    original = read_tensors(src)
    deployed = load_quantized_state(out)
    layers = _layers(out)
    assert layers
    for module in layers:
        w = original[f"{module}.weight"]
        assert torch.equal(deployed[f"{module}.weight"], fake_quant(w, spec)), module
        assert deployed[f"{module}.weight"].dtype == (dtype or w.dtype)
    for name, t in original.items():  # everything else is copied unchanged
        if name[: -len(".weight")] not in layers:
            assert torch.equal(deployed[name], t), name
    assert set(deployed) == set(original)
    return layers


def test_w4a16_pack_quantized_checkpoint(glmpost_cli, tiny_checkpoint, tmp_path):
    out = tmp_path / "w4"
    result = _quantize(glmpost_cli, tiny_checkpoint, out, "--scheme", "w4a16", "--group-size", "16", "--json", "--report")
    summary = json.loads(result.stdout)
    assert summary["scheme"] == "w4a16" and summary["format"] == "compressed-tensors"
    assert "SQNR dB" in result.stderr  # --report table (stderr because stdout carries --json)
    spec = make_spec("w4a16", group_size=16)
    layers = _assert_bit_exact(tiny_checkpoint, out, spec)
    assert summary["layers"] == len(layers)
    assert not [m for m in layers if any(s in m + "." for s in SKIPPED)]
    assert any(".mlp.experts.3.down_proj" in m for m in layers)  # routed experts are quantized
    assert any(".mlp.shared_experts." in m for m in layers)

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["strategy"], weights["group_size"], weights["symmetric"]) == (4, "group", 16, True)
    assert "lm_head" in qc["ignore"] and "model.layers.0.self_attn.indexer.wk" in qc["ignore"]
    assert set(KV_B) <= set(qc["ignore"])

    saved = read_tensors(out)
    m = "model.layers.0.mlp.down_proj"  # [64, 128]
    assert saved[f"{m}.weight_packed"].dtype == torch.int32
    assert tuple(saved[f"{m}.weight_packed"].shape) == (64, 16)
    assert tuple(saved[f"{m}.weight_scale"].shape) == (64, 8)
    assert saved[f"{m}.weight_shape"].tolist() == [64, 128]
    assert f"{m}.weight" not in saved
    assert unpack_int4(saved[f"{m}.weight_packed"]).abs().max() <= 8

    manifest = json.loads((out / "glmpost.json").read_text())
    parent = json.loads((tiny_checkpoint / "glmpost.json").read_text())
    assert manifest["stage"] == "quantize" and manifest["policy_version"] == parent["policy_version"]
    assert manifest["tokenizer_revision"] == parent["tokenizer_revision"]
    assert (out / "tokenizer.json").read_bytes() == (tiny_checkpoint / "tokenizer.json").read_bytes()
    stage = json.loads((out / "stage.json").read_text())
    assert stage["stage"] == "quantize" and stage["options"]["scheme"] == "w4a16"
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        assert row["sqnr_db"] > 15 and row["max_abs_err"] > 0


def test_fp8_block_checkpoint_with_partial_blocks(glmpost_cli, tiny_checkpoint, tmp_path):
    out = tmp_path / "fp8"
    result = _quantize(glmpost_cli, tiny_checkpoint, out, "--scheme", "fp8-block", "--report")
    assert "SQNR dB" in result.stdout
    _assert_bit_exact(tiny_checkpoint, out, make_spec("fp8-block"))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert qc["activation_scheme"] == "dynamic"
    saved = read_tensors(out)
    for m, blocks in (("model.layers.0.mlp.down_proj", (1, 1)), ("model.layers.0.self_attn.q_b_proj", (1, 1))):
        assert saved[f"{m}.weight"].dtype == torch.float8_e4m3fn
        assert saved[f"{m}.weight_scale_inv"].dtype == torch.float32
        assert tuple(saved[f"{m}.weight_scale_inv"].shape) == blocks


@pytest.mark.parametrize("scheme", ["w8a16", "w8a8-dynamic"])
def test_int8_schemes(glmpost_cli, tiny_checkpoint, tmp_path, scheme):
    out = tmp_path / scheme
    _quantize(glmpost_cli, tiny_checkpoint, out, "--scheme", scheme)
    _assert_bit_exact(tiny_checkpoint, out, make_spec(scheme))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["num_bits"] == 8 and group["weights"]["strategy"] == "channel"
    if scheme == "w8a8-dynamic":
        assert qc["format"] == "int-quantized"
        assert group["input_activations"]["strategy"] == "token" and group["input_activations"]["dynamic"] is True
        assert read_tensors(out)["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    else:
        assert qc["format"] == "pack-quantized" and group["input_activations"] is None


def test_moe_only_include_exclude(glmpost_cli, tiny_checkpoint, tmp_path):
    out = tmp_path / "moe"
    _quantize(glmpost_cli, tiny_checkpoint, out, "--scheme", "w4a16", "--group-size", "32", "--targets", "moe-only",
              "--include", r"mlp\.gate$", "--exclude", r"experts\.0\.")
    layers = _layers(out)
    assert all(".mlp.experts." in m or m.endswith(".mlp.gate") for m in layers)
    assert "model.layers.1.mlp.gate" in layers
    assert not [m for m in layers if ".experts.0." in m]
    assert len(layers) == 3 * 3 + 1
    _assert_bit_exact(tiny_checkpoint, out, make_spec("w4a16", group_size=32))


def test_bf16_master_weights(glmpost_cli, tmp_path):
    src = tmp_path / "bf16"
    assert glmpost_cli("init-model", "--out", src, "--dtype", "bfloat16").exit_code == 0
    out = tmp_path / "bf16-w4"
    _quantize(glmpost_cli, src, out, "--scheme", "w4a16", "--group-size", "16")
    _assert_bit_exact(src, out, make_spec("w4a16", group_size=16))
    assert read_tensors(out)["model.layers.0.mlp.down_proj.weight_scale"].dtype == torch.bfloat16


def test_scheme_none_copies(glmpost_cli, tiny_checkpoint, tmp_path):
    out = tmp_path / "none"
    _quantize(glmpost_cli, tiny_checkpoint, out, "--scheme", "none")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    original, copied = read_tensors(tiny_checkpoint), read_tensors(out)
    assert set(original) == set(copied) and all(torch.equal(original[k], copied[k]) for k in original)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--scheme", "w4a16", "--group-size", "48"], "does not divide"),
        (["--scheme", "w4a16"], "does not divide"),  # default group 128 > hidden 64
        (["--scheme", "w3a16"], "unknown scheme"),
        (["--scheme", "w4a16", "--group-size", "16", "--include", "no_such_layer"], "matches no quantizable layer"),
        (["--scheme", "w4a16", "--group-size", "16", "--exclude", "no_such_layer"], "matches no quantizable layer"),
        (["--scheme", "w4a16", "--group-size", "16", "--format", "fp8"], "cannot hold"),
        (["--scheme", "fp8-block", "--format", "msmodelslim"], "--format msmodelslim cannot hold scheme fp8-block"),
        (["--scheme", "w4a16", "--group-size", "16", "--format", "msmodelslim"], "cannot hold scheme w4a16"),
        (["--scheme", "w8a16", "--format", "gguf"], "unknown format"),
        (["--scheme", "w4a16", "--group-size", "16", "--targets", "attention"], "--targets"),
    ],
)
def test_bad_input_is_one_line_and_leaves_no_output(glmpost_cli, tiny_checkpoint, tmp_path, args, message):
    out = tmp_path / "bad"
    result = glmpost_cli("quantize", tiny_checkpoint, "--out", out, *args)
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("glmpost: error:") and message in lines[-1]
    assert "Traceback" not in result.stderr
    assert not out.exists() and not list(tmp_path.glob(".bad*"))


def test_already_quantized_checkpoint_is_refused(glmpost_cli, tiny_checkpoint, tmp_path):
    first = tmp_path / "q"
    _quantize(glmpost_cli, tiny_checkpoint, first, "--scheme", "fp8-block")
    out = tmp_path / "again"
    result = glmpost_cli("quantize", first, "--out", out, "--scheme", "w8a16")
    assert result.exit_code == 2 and "already quantized" in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr and not out.exists()


def test_scheme_none_dequantizes_a_quantized_checkpoint_to_the_qat_forward_weights(glmpost_cli, tiny_checkpoint, tmp_path):
    import torch
    from safetensors.torch import load_file

    from glmpost.kernel.loading import load_model
    from glmpost.quant.formats import load_quantized_state

    packed = tmp_path / "w4"
    _quantize(glmpost_cli, tiny_checkpoint, packed, "--scheme", "w4a16", "--group-size", "16")
    out = tmp_path / "float"
    result = glmpost_cli("quantize", packed, "--out", out, "--scheme", "none", "--json")
    assert result.exit_code == 0, result.stderr
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    saved, expected = load_file(str(out / "model.safetensors")), load_quantized_state(packed)
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in saved)
    original = load_file(str(tiny_checkpoint / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    assert not torch.equal(saved[name], original[name])  # quantized, then dequantized: not the master
    assert load_model(out).model.layers[0].self_attn.o_proj.weight.equal(saved[name])
    again = glmpost_cli("quantize", packed, "--out", out, "--scheme", "none")
    assert again.exit_code == 2 and "--overwrite" in again.stderr


def test_rerun_skips_and_recipe_config(glmpost_cli, tiny_checkpoint, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[quantize]\nscheme = "w4a16"\ngroup-size = 32\ntargets = "moe-only"\n')
    out = tmp_path / "cfg"
    _quantize(glmpost_cli, tiny_checkpoint, out, "--config", recipe)
    stage = json.loads((out / "stage.json").read_text())["options"]
    assert (stage["scheme"], stage["group_size"], stage["targets"]) == ("w4a16", 32, "moe-only")
    again = glmpost_cli("quantize", tiny_checkpoint, "--out", out, "--config", recipe, "--json")
    assert again.exit_code == 0 and json.loads(again.stdout)["skipped"] is True
    assert math.isfinite(min(json.loads(l)["sqnr_db"] for l in (out / "metrics.jsonl").read_text().splitlines()))


def test_in_memory_fused_experts_fake_quant_equal_the_deployed_per_expert_weights(glmpost_cli, tiny_checkpoint, tmp_path):
    """QAT sees GlmMoeDsa's fused 3-D expert parameters; the checkpoint holds per-expert Linears."""
    from glmpost.kernel.loading import load_model

    out = tmp_path / "experts"
    spec = make_spec("w4a16", group_size=16)
    _quantize(glmpost_cli, tiny_checkpoint, out, "--scheme", "w4a16", "--group-size", "16", "--targets", "moe-only")
    deployed = load_quantized_state(out)
    params = dict(load_model(tiny_checkpoint).named_parameters())
    prefix = "model.layers.1.mlp.experts."
    gate_up = fake_quant(params[prefix + "gate_up_proj"].detach(), spec)  # [E, 2I, H]
    down = fake_quant(params[prefix + "down_proj"].detach(), spec)  # [E, H, I]
    for e in range(gate_up.shape[0]):
        p = f"{prefix}{e}."
        both = torch.cat([deployed[p + "gate_proj.weight"], deployed[p + "up_proj.weight"]])
        assert torch.equal(gate_up[e], both)
        assert torch.equal(down[e], deployed[p + "down_proj.weight"])


def test_msmodelslim_w8a8_dynamic_checkpoint(glmpost_cli, tiny_checkpoint, tmp_path):
    """Ascend msModelSlim layout (vLLM-Ascend): per-tensor type map, int8 weight, fp32 scale/offset."""
    from glmpost.quant.formats import MODELSLIM_DESCRIPTION

    out = tmp_path / "ms"
    result = _quantize(glmpost_cli, tiny_checkpoint, out, "--scheme", "w8a8-dynamic", "--format", "msmodelslim", "--json")
    assert json.loads(result.stdout)["format"] == "msmodelslim"
    layers = _assert_bit_exact(tiny_checkpoint, out, make_spec("w8a8-dynamic"))
    assert len(layers) == 26 and not [m for m in layers if any(k in m + "." for k in SKIPPED)]
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    saved = read_tensors(out)
    description = json.loads((out / MODELSLIM_DESCRIPTION).read_text())
    assert description["model_quant_type"] == "W8A8_DYNAMIC"
    assert set(saved) == set(description) - {"model_quant_type", "version", "group_size"}  # every tensor typed
    for m in layers:
        assert saved[f"{m}.weight"].dtype == torch.int8
        for suffix in ("weight", "weight_scale", "weight_offset"):
            assert description[f"{m}.{suffix}"] == "W8A8_DYNAMIC"
        rows = saved[f"{m}.weight"].shape[0]
        assert saved[f"{m}.weight_scale"].dtype == torch.float32 and tuple(saved[f"{m}.weight_scale"].shape) == (rows, 1)
        assert not saved[f"{m}.weight_offset"].any()
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.gate.weight", "model.norm.weight"):
        assert description[name] == "FLOAT" and saved[name].dtype == torch.float32
    # an expert's gate/up/down share one type (vLLM-Ascend fuses them and checks it)
    assert {description[f"model.layers.1.mlp.experts.0.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")} == {"W8A8_DYNAMIC"}
    again = glmpost_cli("quantize", out, "--out", tmp_path / "again", "--scheme", "w8a16")
    assert again.exit_code == 2 and "already quantized (msmodelslim)" in again.stderr


def test_msmodelslim_bf16_master(glmpost_cli, tmp_path):
    src = tmp_path / "bf16"
    assert glmpost_cli("init-model", "--out", src, "--dtype", "bfloat16").exit_code == 0
    out = tmp_path / "ms"
    _quantize(glmpost_cli, src, out, "--scheme", "w8a8-dynamic", "--format", "msmodelslim")
    _assert_bit_exact(src, out, make_spec("w8a8-dynamic"))
    scale = read_tensors(out)["model.layers.0.mlp.down_proj.weight_scale"]
    assert scale.dtype == torch.float32 and torch.equal(scale.bfloat16().float(), scale)  # a bf16 value, held exactly


def test_failed_conversion_leaves_no_partial_output(glmpost_cli, tiny_checkpoint, tmp_path):
    """A weight that cannot be quantized (inf) is found while the output is being written: the error
    is one line and neither the output nor its staging directory is left behind."""
    from safetensors.torch import save_file

    src = tmp_path / "broken"
    src.mkdir()
    for item in tiny_checkpoint.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            (src / item.name).write_bytes(item.read_bytes())
    tensors = read_tensors(tiny_checkpoint)
    tensors["model.layers.1.mlp.shared_experts.up_proj.weight"][3, 5] = float("inf")  # a late layer
    save_file(tensors, str(src / "model.safetensors"))
    out = tmp_path / "out"
    result = glmpost_cli("quantize", src, "--out", out, "--scheme", "w4a16", "--group-size", "16")
    assert result.exit_code == 1, result.stderr
    assert "shared_experts.up_proj.weight holds 1+ NaN or infinite value(s)" in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr and not out.exists() and not list(tmp_path.glob(".out*"))
    (src / "model.safetensors").write_bytes((tiny_checkpoint / "model.safetensors").read_bytes()[:4096])  # truncated
    truncated = glmpost_cli("quantize", src, "--out", out, "--scheme", "w8a16")
    assert truncated.exit_code == 1 and "cannot read safetensors" in truncated.stderr and not out.exists()


def _packed(saved, module) -> bool:
    """``module`` is stored pack-quantized (int32 words and a scale, no float ``weight``)."""
    return saved[f"{module}.weight_packed"].dtype == torch.int32 and f"{module}.weight" not in saved


def test_default_keeps_kv_b_proj_float_for_the_sglang_loader(glmpost_cli, tiny_checkpoint, tmp_path):
    """SGLang's DeepseekV2 post_load_weights reads kv_b_proj.weight: by default it stays the float master
    weight (and in ``ignore``) while every other target is packed; --include kv_b_proj packs it too."""
    default, included = tmp_path / "default", tmp_path / "included"
    _quantize(glmpost_cli, tiny_checkpoint, default, "--scheme", "w4a16", "--group-size", "16")
    _quantize(glmpost_cli, tiny_checkpoint, included, "--scheme", "w4a16", "--group-size", "16", "--include", "kv_b_proj")
    original, saved = read_tensors(tiny_checkpoint), read_tensors(default)
    layers = _layers(default)
    assert len(layers) == 26 and not set(KV_B) & set(layers)
    assert all(_packed(saved, m) for m in layers)
    for m in KV_B:
        assert f"{m}.weight_packed" not in saved and saved[f"{m}.weight"].dtype == torch.float32
        assert torch.equal(saved[f"{m}.weight"], original[f"{m}.weight"])
    assert set(KV_B) <= set(json.loads((default / "config.json").read_text())["quantization_config"]["ignore"])

    spec = make_spec("w4a16", group_size=16)
    assert _layers(included) == sorted(layers + KV_B)
    assert _assert_bit_exact(tiny_checkpoint, included, spec)
    saved = read_tensors(included)
    assert all(_packed(saved, m) for m in KV_B)
    assert not set(KV_B) & set(json.loads((included / "config.json").read_text())["quantization_config"]["ignore"])


@pytest.mark.parametrize(
    "args, kv_b, count",
    [  # --include overrides --targets and the default skips; --exclude overrides --include
        (["--targets", "moe-only", "--include", "kv_b_proj"], KV_B, 4 * 3 + 2),
        (["--include", "kv_b_proj", "--exclude", r"layers\.0\.self_attn\.kv_b_proj"], KV_B[1:], 26 + 1),
    ],
)
def test_include_and_exclude_combine_with_the_kv_b_proj_skip(glmpost_cli, tiny_checkpoint, tmp_path, args, kv_b, count):
    out = tmp_path / "q"
    _quantize(glmpost_cli, tiny_checkpoint, out, "--scheme", "w4a16", "--group-size", "16", *args)
    layers, saved = _layers(out), read_tensors(out)
    assert len(layers) == count and [m for m in layers if "kv_b_proj" in m] == kv_b
    if "moe-only" in args:
        assert all(".mlp.experts." in m for m in layers if m not in kv_b)
    assert all(_packed(saved, m) for m in layers)
    assert all(saved[f"{m}.weight"].dtype == torch.float32 for m in KV_B if m not in kv_b)


def test_recipe_include_quantizes_kv_b_proj(glmpost_cli, tiny_checkpoint, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[quantize]\nscheme = "w4a16"\ngroup-size = 16\ninclude = ["kv_b_proj"]\n')
    out = tmp_path / "cfg"
    _quantize(glmpost_cli, tiny_checkpoint, out, "--config", recipe)
    assert set(KV_B) <= set(_layers(out)) and all(_packed(read_tensors(out), m) for m in KV_B)
