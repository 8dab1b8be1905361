"""LoRA versions deployed (issue 45, "Deployment"): the merge into a full checkpoint (PEFT's, in float32,
stored in the base's dtype), ``glmpost quantize`` of a LoRA version (``--scheme none``: the merged
float checkpoint on demand; any scheme, msModelSlim included, on the merged weights), and ``qat``
refusing a LoRA version in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from glmpost.checkpoints import read_manifest
from glmpost.kernel.loading import load_model
from glmpost.kernel.lora_merge import full_weights, merge_lora_version
from glmpost.quant.formats import load_quantized_state, read_tensors
from test_lora_versions import make_lora_version

ROOT = Path(__file__).resolve().parents[1]
CLOSE = 1e-5  # float32: merged and unmerged differ by rounding only


@pytest.fixture(scope="module")
def lora_version(tiny_checkpoint, tmp_path_factory) -> Path:
    return make_lora_version(tiny_checkpoint, tmp_path_factory.mktemp("lora") / "v000001", seed=5, version=7)


def _logits(checkpoint: Path) -> torch.Tensor:
    model = load_model(checkpoint, dtype=torch.float32)
    ids = torch.arange(3, 3 + 2 * 20).reshape(2, 20) % 500
    with torch.no_grad():
        return model(ids).logits


def test_the_merged_checkpoint_computes_what_base_plus_adapter_computes(lora_version, tiny_checkpoint, tmp_path):
    merged = merge_lora_version(lora_version, tmp_path / "merged")
    unmerged, full, base = _logits(lora_version), _logits(merged), _logits(tiny_checkpoint)
    assert (full - unmerged).abs().max().item() <= CLOSE
    assert (base - unmerged).abs().max().item() > 1e-2  # the adapter changes the model: the check can fail
    assert not (merged / "adapter_config.json").exists() and (merged / "config.json").is_file()
    manifest = read_manifest(merged)
    assert manifest.policy_version == 7 and manifest.lora_base is None and manifest.parent == str(lora_version)
    assert manifest.extra["merged_from"] == {"lora_version": str(lora_version), "base": str(tiny_checkpoint.resolve()),
                                             "dtype": "float32"}
    # every adapted tensor moved, the others are the base's bit for bit
    before, after = read_tensors(tiny_checkpoint), read_tensors(merged)
    assert set(before) == set(after)
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert any(".mlp.experts." in name for name in changed) and any("kv_b_proj" in name for name in changed)
    assert not any("embed_tokens" in name or "indexer" in name or name.endswith("mlp.gate.weight") for name in changed)


def test_full_weights_merges_in_scratch_and_removes_it(lora_version, tiny_checkpoint, tmp_path):
    out = tmp_path / "deployed"
    with full_weights(tiny_checkpoint, scratch_beside=out) as source:
        assert source == tiny_checkpoint.resolve() or source == tiny_checkpoint
    with full_weights(lora_version, scratch_beside=out, layout_only=True) as source:
        assert source == tiny_checkpoint.resolve()
    with full_weights(lora_version, scratch_beside=out) as source:
        assert source.parent == tmp_path and source.name.startswith(".deployed.merged-")
        assert read_manifest(source).extra["merged_from"]["lora_version"] == str(lora_version)
    assert not source.exists()


def test_quantize_scheme_none_of_a_lora_version_writes_the_merged_checkpoint(glmpost_cli, lora_version, tmp_path):
    out = tmp_path / "merged"
    result = glmpost_cli("quantize", lora_version, "--out", out, "--scheme", "none", "--json")
    assert result.exit_code == 0, result.stderr
    assert "a LoRA version; merging it" in result.stderr
    assert (_logits(out) - _logits(lora_version)).abs().max().item() <= CLOSE
    manifest = read_manifest(out)
    assert manifest.stage == "quantize" and manifest.policy_version == 7 and manifest.parent == str(lora_version)
    assert manifest.extra["merged_from"]["lora_version"] == str(lora_version)
    assert not list(tmp_path.glob(".merged.merged-*"))  # the scratch merge is gone
    again = glmpost_cli("quantize", lora_version, "--out", out, "--scheme", "none", "--json")
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["skipped"] and "merging" not in again.stderr  # a rerun merges nothing


def test_quantize_of_a_lora_version_equals_quantize_of_its_merge(glmpost_cli, lora_version, tmp_path):
    merged = merge_lora_version(lora_version, tmp_path / "merged")
    for scheme, options in (("w4a16", ("--group-size", "16")), ("w8a8-dynamic", ("--format", "msmodelslim"))):
        direct, via = tmp_path / f"{scheme}-direct", tmp_path / f"{scheme}-via"
        for src, out in ((lora_version, direct), (merged, via)):
            result = glmpost_cli("quantize", src, "--out", out, "--scheme", scheme, *options)
            assert result.exit_code == 0, result.stderr
        a, b = load_quantized_state(direct), load_quantized_state(via)
        assert set(a) == set(b) and all(torch.equal(a[name], b[name]) for name in a), scheme
        assert read_manifest(direct).extra["merged_from"]["lora_version"] == str(lora_version)
    assert (tmp_path / "w8a8-dynamic-direct" / "quant_model_description.json").is_file()


def test_a_bad_option_is_refused_before_the_merge(glmpost_cli, lora_version, tmp_path):
    result = glmpost_cli("quantize", lora_version, "--out", tmp_path / "q", "--scheme", "w8a8-dynamic", "--group-size", "16")
    assert result.exit_code == 2 and "--group-size" in result.stderr and "merging" not in result.stderr


def test_qat_refuses_a_lora_version_in_one_line(glmpost_cli, lora_version, tmp_path):
    result = glmpost_cli("qat", ROOT / "recipes" / "data" / "count-demo.jsonl", "--checkpoint", lora_version,
                         "--out", tmp_path / "qat", "--scheme", "w4a16")
    assert result.exit_code == 2
    line = result.stderr.strip().splitlines()[-1]
    assert "is a LoRA version" in line and "glmpost quantize" in line and "Traceback" not in result.stderr
    assert not list((tmp_path / "qat").glob("v*"))
