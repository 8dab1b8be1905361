"""recipes/tiny-qat-int4-sft.toml runs end to end on the CPU: QAT lowers the held-out loss, and the
checkpoint `glmpost quantize` makes from the same recipe dequantizes to the QAT forward bit for bit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import tomllib
import torch

from glmpost.quant import fake_quant, make_spec
from glmpost.quant.formats import load_quantized_state, read_tensors

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-qat-int4-sft.toml"
DATA = ROOT / "recipes" / "data"


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: two per process thrash on the shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield {**os.environ, "OMP_NUM_THREADS": "1"}
    torch.set_num_threads(before)


def test_tiny_qat_recipe_trains_and_deploys_bit_exact(glmpost_cli, tiny_checkpoint, tmp_path):
    recipe = tomllib.loads(RECIPE.read_text())
    assert {k: recipe["quantize"][k] for k in ("scheme", "group-size", "targets")} == \
        {k: recipe["qat"][k] for k in ("scheme", "group-size", "targets")}  # one spec for both stages
    root = tmp_path / "root"
    trained = glmpost_cli("qat", DATA / "sft-train.jsonl", "--checkpoint", tiny_checkpoint, "--out", root,
                          "--eval", DATA / "sft-heldout.jsonl", "--config", RECIPE, "--json")
    assert trained.exit_code == 0, trained.stderr
    summary = json.loads(trained.stdout)
    assert summary["scheme"] == "w4a16" and summary["steps"] == 20 and summary["quantized_layers"] == 18
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 3.0  # 6.2 -> ~0.6 with fake quant on
    deployed = tmp_path / "deploy"
    converted = glmpost_cli("quantize", root, "--out", deployed, "--config", RECIPE, "--json")
    assert converted.exit_code == 0, converted.stderr
    assert json.loads(converted.stdout)["layers"] == 28  # 16 Linears + 4 experts x (gate, up, down)
    spec = make_spec("w4a16", group_size=recipe["qat"]["group-size"])
    master, on_disk = read_tensors(root / "v000001"), load_quantized_state(deployed)
    layers = [json.loads(line)["layer"] for line in (deployed / "metrics.jsonl").read_text().splitlines()]
    for module in layers:
        assert torch.equal(on_disk[f"{module}.weight"], fake_quant(master[f"{module}.weight"], spec)), module
