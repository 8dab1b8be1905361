"""recipes/gspo.toml and recipes/dapo.toml (issue 46): the recipe loader reads their variants, and
train-grpo trains one step with each on judged shards of the tiny model, recording the settings in
stage.json; a variant name it does not know is one line naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_train_grpo import _judged

from glmpost.toml import load_recipe

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {
    "gspo.toml": {"policy-loss": "gspo", "eps-low": 3e-4, "eps-high": 4e-4, "loss-normalization": "segment"},
    "dapo.toml": {"eps-low": 0.2, "eps-high": 0.28, "loss-normalization": "dapo", "loss-denominator": "action"},
}


@pytest.fixture(scope="module")
def judged(tiny_checkpoint, tmp_path_factory):
    from conftest import run_glmpost

    return _judged(run_glmpost, tiny_checkpoint, tmp_path_factory.mktemp("variant-recipes"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_recipe_loads_checks_and_trains_a_step(glmpost_cli, tiny_checkpoint, judged, tmp_path, name, monkeypatch):
    recipe = ROOT / "recipes" / name
    section = load_recipe(recipe)["train-grpo"]
    assert {key: section[key] for key in EXPECTED[name]} == EXPECTED[name]
    monkeypatch.chdir(ROOT)
    checked = glmpost_cli("recipe", "check", Path("recipes") / name, "--json")
    assert checked.exit_code == 0 and json.loads(checked.stdout)["ok"], checked.stderr
    out = tmp_path / "policy"
    result = glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", out, "--config", recipe,
                         "--epochs", "1", "--mini-batches", "1", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["policy_version"] == 1 and summary["steps"] == 1 and summary["loss"] == summary["loss"]  # not NaN
    options = json.loads((out / "v000001" / "stage.json").read_text())["options"]
    assert {key: options[key.replace("-", "_")] for key in EXPECTED[name]} == EXPECTED[name]


def test_an_unknown_variant_is_one_line_naming_the_flag(glmpost_cli, tiny_checkpoint, judged, tmp_path):
    for flag, value in (("--policy-loss", "sapo"), ("--importance-correction", "icepop"), ("--advantage-scaling", "std")):
        result = glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "x", flag, value)
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
        assert f"{flag} '{value}' is not one of" in result.stderr and not (tmp_path / "x").exists()
    lonely = glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "x",
                         "--loss-normalization", "dr_grpo")
    assert lonely.exit_code == 2 and "--dr-grpo-max-tokens" in lonely.stderr
