"""``glmpost init-model``: a deterministic tiny GLM-5 checkpoint that Hugging Face loads, no download."""

from __future__ import annotations

import json

import torch

from glmpost.checkpoints import read_manifest, tokenizer_revision


def test_checkpoint_loads_with_auto_classes_and_has_every_glm5_part(tiny_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    config = model.config
    assert type(model).__name__ == "GlmMoeDsaForCausalLM"
    assert config.q_lora_rank and config.kv_lora_rank  # MLA
    assert config.n_routed_experts == 4 and config.n_shared_experts == 1 and config.mlp_layer_types == ["dense", "sparse"]
    assert config.index_topk == 8  # DSA indexer selects fewer keys than a chat prompt has
    assert len(tokenizer) == config.vocab_size == 512
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "count: 3"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "[gMASK]<sop><|user|>\ncount: 3<|assistant|>\n"
    ids = tokenizer.encode(prompt)
    assert tokenizer.decode(ids) == prompt and len(ids) > config.index_topk
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 512) and torch.isfinite(logits).all()
    manifest = read_manifest(tiny_checkpoint)
    assert manifest.policy_version == 0 and manifest.stage == "init-model" and manifest.parent is None
    assert manifest.tokenizer_revision == tokenizer_revision(tiny_checkpoint)
    stage = json.loads((tiny_checkpoint / "stage.json").read_text())
    assert stage["stage"] == "init-model" and stage["options"]["seed"] == 0
    metrics = json.loads((tiny_checkpoint / "metrics.jsonl").read_text())
    assert metrics["init/parameters"] == sum(p.numel() for p in model.parameters()) and metrics["init/tokenizer_size"] == 512


def test_same_seed_same_bytes_other_seed_other_weights(glmpost_cli, tiny_checkpoint, tmp_path):
    again = tmp_path / "again"
    other = tmp_path / "other"
    assert glmpost_cli("init-model", "--out", again, "--seed", "0").exit_code == 0
    assert glmpost_cli("init-model", "--out", other, "--seed", "1").exit_code == 0
    for name in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja", "generation_config.json"):
        assert (again / name).read_bytes() == (tiny_checkpoint / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (tiny_checkpoint / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_checkpoint / "tokenizer.json").read_bytes()


def test_existing_output_is_skipped_refused_or_replaced(glmpost_cli, tmp_path):
    out = tmp_path / "ckpt"
    assert glmpost_cli("init-model", "--out", out, "--seed", "0").exit_code == 0
    weights = (out / "model.safetensors").read_bytes()
    rerun = glmpost_cli("init-model", "--out", out, "--seed", "0", "--json")
    assert rerun.exit_code == 0 and json.loads(rerun.stdout) == {"out": str(out), "skipped": True}
    # Another seed is another output (issue 13: it used to be skipped, keeping seed 0's weights).
    other = glmpost_cli("init-model", "--out", out, "--seed", "5", "--json")
    assert other.exit_code == 2 and "was written with --seed 0, now 5" in other.stderr
    assert (out / "model.safetensors").read_bytes() == weights
    replaced = glmpost_cli("init-model", "--out", out, "--seed", "5", "--overwrite")
    assert replaced.exit_code == 0 and (out / "model.safetensors").read_bytes() != weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging or trash left behind

    half = tmp_path / "half"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"partial")
    refused = glmpost_cli("init-model", "--out", half)
    assert refused.exit_code == 2
    assert refused.stderr.strip() == f"glmpost: error: --out {half} exists but holds no complete output; pass --overwrite to replace it"
    assert (half / "model.safetensors").read_bytes() == b"partial"


def test_recipe_section_sets_options_and_flags_win(glmpost_cli, tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('[init-model]\nseed = 4\nindex-topk = 3\nset = ["hidden_size=32"]\n')
    from_recipe = glmpost_cli("init-model", "--config", recipe, "--out", tmp_path / "a", "--json")
    assert from_recipe.exit_code == 0, from_recipe.stderr
    summary = json.loads(from_recipe.stdout)
    assert summary["index_topk"] == 3
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["hidden_size"] == 32
    options = json.loads((tmp_path / "a" / "stage.json").read_text())["options"]
    assert options["seed"] == 4 and options["config"] == str(recipe)
    flag_wins = glmpost_cli("init-model", "--config", recipe, "--out", tmp_path / "b", "--index-topk", "5", "--json")
    assert json.loads(flag_wins.stdout)["index_topk"] == 5


def test_bad_options_are_one_line_errors(glmpost_cli, tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("[init-model]\nseeed = 4\n")
    typo = glmpost_cli("init-model", "--config", recipe, "--out", tmp_path / "x")
    assert typo.exit_code == 2 and "unknown key 'seeed' in [init-model]" in typo.stderr
    assert str(recipe) in typo.stderr and "Traceback" not in typo.stderr

    unknown = glmpost_cli("init-model", "--out", tmp_path / "y", "--set", "hiden_size=3")
    assert unknown.exit_code == 2
    assert unknown.stderr.strip() == "glmpost: error: --set: unknown GlmMoeDsaConfig field(s): hiden_size"
    malformed = glmpost_cli("init-model", "--out", tmp_path / "z", "--set", "hidden_size")
    assert malformed.exit_code == 2 and "expected KEY=VALUE" in malformed.stderr
    preset = glmpost_cli("init-model", "--out", tmp_path / "w", "--preset", "huge")
    assert preset.exit_code == 2 and "--preset 'huge': unknown preset (known: tiny-glm5, tiny-glm5-agentic)" in preset.stderr
    assert not any((tmp_path / n).exists() for n in "xyzw")


def test_the_agentic_preset_has_a_longer_context(glmpost_cli, tmp_path):
    result = glmpost_cli("init-model", "--out", tmp_path / "a", "--preset", "tiny-glm5-agentic")
    assert result.exit_code == 0, result.stderr
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["max_position_embeddings"] == 4096
