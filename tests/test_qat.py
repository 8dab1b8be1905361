"""``glmpost qat``: SFT with the quantizer's fake quant; what `glmpost quantize` deploys equals the QAT forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from glmpost.checkpoints import read_manifest
from glmpost.kernel.loading import load_model
from glmpost.quant.formats import load_quantized_state
from glmpost.quant.qat import apply_fake_quant
from glmpost.quant.spec import make_spec

DATA = Path(__file__).resolve().parents[1] / "recipes" / "data"
QAT = ["--lr", "3e-3", "--epochs", "2", "--batch-size", "16", "--micro-batch-size", "8"]


def _qat_weights(checkpoint: Path, spec) -> dict[str, torch.Tensor]:
    """The weights the QAT forward uses, under their on-disk (per-expert) names."""
    model = load_model(checkpoint)
    apply_fake_quant(model, spec)
    weights = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(".experts") and hasattr(module, "gate_up_proj"):
                gate_up, down = module.gate_up_proj, module.down_proj  # fake-quantized views
                rows = gate_up.shape[1] // 2
                for e in range(gate_up.shape[0]):
                    weights[f"{name}.{e}.gate_proj.weight"] = gate_up[e, :rows]
                    weights[f"{name}.{e}.up_proj.weight"] = gate_up[e, rows:]
                    weights[f"{name}.{e}.down_proj.weight"] = down[e]
            elif isinstance(module, torch.nn.Linear):
                weights[f"{name}.weight"] = module.weight
    return weights


def test_deployed_int4_weights_equal_the_qat_forward_bit_for_bit(glmpost_cli, tiny_checkpoint, tmp_path):
    trained = glmpost_cli("qat", DATA / "sft-train.jsonl", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "root",
                          "--scheme", "w4a16", "--group-size", "16", *QAT, "--eval", DATA / "sft-heldout.jsonl", "--json")
    assert trained.exit_code == 0, trained.stderr
    summary = json.loads(trained.stdout)
    assert summary["policy_version"] == 1 and summary["quantized_layers"] == 16 and summary["steps"] == 10  # kv_b_proj: float
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    version = tmp_path / "root" / "v000001"
    assert read_manifest(version).extra["quantization"]["group_size"] == 16

    deployed = tmp_path / "deployed"
    result = glmpost_cli("quantize", version, "--out", deployed, "--scheme", "w4a16", "--group-size", "16")
    assert result.exit_code == 0, result.stderr
    on_disk = load_quantized_state(deployed, dtype=torch.float32)
    qat_forward = _qat_weights(version, make_spec("w4a16", group_size=16))
    quantized = [n for n in qat_forward if not n.startswith(("lm_head", "model.embed_tokens")) and ".indexer." not in n]
    assert len(quantized) == 28  # 16 linear layers + 4 experts x (gate, up, down)
    for name in quantized:
        assert torch.equal(on_disk[name], qat_forward[name]), name


def test_scheme_none_is_plain_sft_and_bad_options_are_refused(glmpost_cli, tiny_checkpoint, tmp_path):
    plain = glmpost_cli("qat", DATA / "sft-train.jsonl", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "root",
                        "--scheme", "none", *QAT, "--eval", DATA / "sft-heldout.jsonl", "--json")
    assert plain.exit_code == 0, plain.stderr
    summary = json.loads(plain.stdout)
    assert summary["quantized_layers"] == 0 and summary["eval_loss_after"] < summary["eval_loss_before"] - 1.0
    lines = [json.loads(line) for line in (tmp_path / "root" / "v000001" / "metrics.jsonl").read_text().splitlines()]
    assert [m["sft/step"] for m in lines if "sft/step" in m] == list(range(10))

    cases = {
        ("--scheme", "fp8-block"): "QAT supports none, w4a16, w8a16, w8a8-dynamic",
        ("--scheme", "w4a16", "--group-size", "32"): "--group-size 32 does not divide its input dim 48",
        ("--scheme", "int3"): "--scheme 'int3': unknown scheme",
        ("--exclude", "nothing-like-this"): "--exclude 'nothing-like-this' matches no quantizable layer",
        ("--include", "nothing-like-this"): "--include 'nothing-like-this' matches no quantizable layer",
        ("--scheme", "w4a16", "--group-size", "12"): "--group-size 12: must be a positive multiple of 8",
        ("--targets", "attention"): "--targets 'attention'",
    }
    for options, message in cases.items():
        result = glmpost_cli("qat", DATA / "sft-train.jsonl", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "bad", *options)
        assert result.exit_code == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "bad").exists()
    prompts_only = glmpost_cli("qat", DATA / "count-train.jsonl", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "bad")
    assert prompts_only.exit_code == 1 and "no response to learn" in prompts_only.stderr


def _on_disk_names(qat_names: list[str], experts: int) -> list[str]:
    """QAT's target names (fused ``experts.gate_up_proj`` / ``experts.down_proj`` parameters) as the
    checkpoint's per-expert module names, sorted."""
    names = []
    for name in qat_names:
        parent = name.rpartition(".")[0]
        if name.endswith(".experts.gate_up_proj"):
            names += [f"{parent}.{e}.{p}" for e in range(experts) for p in ("gate_proj", "up_proj")]
        elif name.endswith(".experts.down_proj"):
            names += [f"{parent}.{e}.down_proj" for e in range(experts)]
        else:
            names.append(name)
    return sorted(names)


@pytest.mark.parametrize("selection", [[], ["--targets", "moe-only", "--include", "kv_b_proj"]], ids=["default", "moe-only+kv_b"])
def test_qat_selects_exactly_the_layers_quantize_deploys(glmpost_cli, tiny_checkpoint, tmp_path, selection):
    """The same selection options pick the same layers in ``qat`` (recorded in the version's manifest)
    and ``quantize`` (its per-layer metrics); by default neither touches kv_b_proj (SGLang's loader)."""
    spec = ["--scheme", "w4a16", "--group-size", "16", *selection]
    trained = glmpost_cli("qat", DATA / "sft-train.jsonl", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "root",
                          *spec, "--epochs", "1", "--batch-size", "80", "--micro-batch-size", "40")
    assert trained.exit_code == 0, trained.stderr
    deployed = tmp_path / "deployed"
    result = glmpost_cli("quantize", tiny_checkpoint, "--out", deployed, *spec)
    assert result.exit_code == 0, result.stderr
    quantized = [json.loads(line)["layer"] for line in (deployed / "metrics.jsonl").read_text().splitlines()]
    experts = json.loads((tiny_checkpoint / "config.json").read_text())["n_routed_experts"]
    trained_names = read_manifest(tmp_path / "root" / "v000001").extra["qat_targets"]
    assert _on_disk_names(trained_names, experts) == sorted(quantized)
    assert any("kv_b_proj" in m for m in quantized) == ("kv_b_proj" in selection)
