"""LoRA versions (issue 45, part 1): the directory format (PEFT's adapter files plus ``glmpost.json``
naming the base by path and content hash), its refusals, its place in a checkpoint root (LATEST,
``--keep``, locks), the loader (base + adapter, unmerged, as PEFT computes it), and every stage that
loads a policy taking one through the real CLI: rollout, diff-logprobs, eval, score-teacher, judge.

Adapters are PEFT models of the tiny GLM-5 (every default target: MLA projections, the dense and
shared-expert MLPs, the routed experts) with ``lora_B`` drawn from a fixed seed instead of PEFT's
zeros, so that they change the output.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glmpost.checkpoints import (
    MANIFEST,
    CheckpointError,
    CheckpointManifest,
    CheckpointRoot,
    NextVersion,
    read_manifest,
    resolve_checkpoint,
    tokenizer_revision,
)
from glmpost.config import ConfigError
from glmpost.formats import ShardReader
from glmpost.kernel.loading import load_model, load_tokenizer, load_weights
from glmpost.kernel.lora import (
    LoraSettings,
    default_targets,
    is_lora_version,
    peft_config,
    read_lora_base,
    resolve_targets,
    write_lora_version,
)
from glmpost.kernel.lora_versions import HASH_SIDECAR, base_weights_hash
from glmpost.locks import OutputLocked, output_lock
from glmpost.weight_sync.sync import prune

ROOT = Path(__file__).resolve().parents[1]
B_STD = 0.02  # lora_B's draw: the size of the tiny model's own weights (initializer_range)
CLOSE = 1e-5  # fp32 closure bound (issue 45)


def make_lora_version(base: Path, out: Path, *, seed: int, version: int = 1, targets=None, task_type="CAUSAL_LM") -> Path:
    """A LoRA version of ``base`` (rank 4, alpha 8) written by ``write_lora_version``: ``lora_A`` as
    PEFT initialises it, ``lora_B`` ~ N(0, B_STD), both from ``seed``."""
    from peft import get_peft_model
    from transformers import AutoModelForSequenceClassification

    base_dir = resolve_checkpoint(base)
    if task_type == "CAUSAL_LM":
        model = load_weights(base_dir, torch.float32)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(str(base_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, peft_config(LoraSettings(4, 8.0, targets), model, task_type=task_type))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * B_STD)
    manifest = CheckpointManifest(policy_version=version, tokenizer_revision=tokenizer_revision(base_dir), stage="test",
                                  parent=str(base_dir))
    write_lora_version(out, peft_model, base=base_dir, manifest=manifest)
    return out


def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)


def one_line_error(result) -> str:
    assert result.exit_code != 0 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr


@pytest.fixture(scope="module")
def lora(tiny_checkpoint, tmp_path_factory) -> Path:
    return make_lora_version(tiny_checkpoint, tmp_path_factory.mktemp("lora") / "v-lora", seed=1)


# --------------------------------------------------------------------------------------------
# settings and targets


def test_settings_refuse_dropout_and_bad_values():
    assert LoraSettings(8, 16.0).check().scale == 2.0 and not LoraSettings().enabled
    for settings, words in ((LoraSettings(4, 8.0, dropout=0.05), "--lora-dropout 0.05: only 0"),
                            (LoraSettings(-1), "--lora-rank -1"), (LoraSettings(4, 0), "--lora-alpha 0"),
                            (LoraSettings(4, 8.0, targets=()), "--lora-targets ()")):
        with pytest.raises(ConfigError) as caught:
            settings.check()
        assert words in str(caught.value) and "\n" not in str(caught.value)


def _tiny_from_config(model_type: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, **extra)
    return AutoModelForCausalLM.from_config(config)


def test_default_targets_per_architecture(tiny_checkpoint):
    glm5 = load_weights(tiny_checkpoint, torch.float32)
    assert default_targets(glm5) == ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                     "gate_proj", "up_proj", "down_proj", "experts")
    for model_type in ("qwen3", "llama"):
        assert default_targets(_tiny_from_config(model_type)) == ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "up_proj", "down_proj")
    moe = _tiny_from_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    assert default_targets(moe) == ("q_proj", "k_proj", "v_proj", "o_proj", "experts")
    assert resolve_targets(LoraSettings(4), moe)[1] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    # PEFT would move gate_proj/up_proj/down_proj of a GLM-5 onto the experts (dropping the dense and
    # shared-expert MLPs): they are named by their weights instead.
    modules, parameters = resolve_targets(LoraSettings(4), glm5)
    assert sorted(modules) == ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"]
    assert parameters == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "gate_proj.weight", "up_proj.weight",
                          "down_proj.weight"]
    for targets, words in ((("q_proj",), "'q_proj': no linear layer of glm_moe_dsa"), (("experts",), "qwen3 has no fused MoE")):
        with pytest.raises(ConfigError, match=words.split(":")[0]) as caught:
            resolve_targets(LoraSettings(4, targets=targets), glm5 if "q_proj" in targets else _tiny_from_config("qwen3"))
        assert words in str(caught.value)


def test_every_default_layer_is_adapted_and_reloads_unchanged(lora):
    config = json.loads((lora / "adapter_config.json").read_text())
    assert config["lora_dropout"] == 0.0 and config["r"] == 4 and config["lora_alpha"] == 8
    assert not {"gate_proj", "up_proj", "down_proj"} & set(config["target_modules"])  # PEFT's MoE rewrite has nothing to do
    with safe_open(str(lora / "adapter_model.safetensors"), "pt") as f:
        names = set(f.keys())
    layer = "base_model.model.model.layers"
    for adapted in ("0.self_attn.q_a_proj", "0.self_attn.kv_b_proj", "0.mlp.gate_proj", "0.mlp.down_proj",
                    "1.mlp.shared_experts.up_proj", "1.mlp.experts", "1.mlp.experts.base_layer"):
        assert f"{layer}.{adapted}.lora_A.weight" in names and f"{layer}.{adapted}.lora_B.weight" in names
    assert not any("indexer" in n or ".gate.lora" in n for n in names)  # never the DSA indexer nor the router


# --------------------------------------------------------------------------------------------
# the version directory


def _hash_by_hand(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in [directory / "config.json", *sorted(directory.glob("*.safetensors"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return "sha256:" + digest.hexdigest()


def test_version_directory_format(lora, tiny_checkpoint):
    files = sorted(p.name for p in lora.iterdir())
    assert {"adapter_config.json", "adapter_model.safetensors", MANIFEST, "tokenizer.json"} <= set(files)
    assert "config.json" not in files and "model.safetensors" not in files  # the base is never copied
    manifest = read_manifest(lora)
    assert manifest.policy_version == 1 and manifest.tokenizer_revision == tokenizer_revision(tiny_checkpoint)
    assert manifest.lora_base == {"path": str(tiny_checkpoint.resolve()), "hash": _hash_by_hand(tiny_checkpoint)}
    assert json.loads((lora / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_checkpoint.resolve())
    assert "lora_base" not in json.loads((tiny_checkpoint / MANIFEST).read_text())  # full versions: unchanged JSON
    assert is_lora_version(lora) and not is_lora_version(tiny_checkpoint)
    assert read_lora_base(lora) == tiny_checkpoint.resolve() and resolve_checkpoint(lora) == lora
    tokenizer, revision = load_tokenizer(lora)
    base_tokenizer, base_revision = load_tokenizer(tiny_checkpoint)
    assert revision == base_revision and tokenizer.encode("count: 3 3") == base_tokenizer.encode("count: 3 3")


def test_loaded_model_is_pefts_base_plus_adapter(wide_checkpoint, tmp_path):
    """The loader applies the adapter as ``PeftModel.from_pretrained`` does (fp32, every position and
    token of the vocabulary), under transformers' attention and glmpost's native GLM-5 attention (its
    absorbed ``kv_b_proj`` read through the adapted layer). ``index_topk`` 64 >= the length: no top-k ties."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = make_lora_version(wide_checkpoint, tmp_path / "lora", seed=3)
    ids = torch.randint(1, 512, (3, 40), generator=torch.Generator().manual_seed(0))
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(wide_checkpoint, dtype=torch.float32), adapter).eval()
    expected = log_probs(peft, ids)
    reference = log_probs(load_model(adapter, dtype=torch.float32, attention="reference"), ids)
    native = log_probs(load_model(adapter, dtype=torch.float32), ids)
    base = log_probs(load_model(wide_checkpoint, dtype=torch.float32, attention="reference"), ids)
    assert float((reference - expected).abs().max()) <= 1e-6
    assert float((native - expected).abs().max()) <= CLOSE
    assert float((base - expected).abs().max()) > 1e-2  # the adapter matters
    # Merging (W + scale B A once) would agree in fp32 too, but only to rounding (module docstring of loading).
    merged = log_probs(peft.merge_and_unload(), ids)
    assert float((merged - expected).abs().max()) <= CLOSE


def test_base_missing_changed_or_not_full_is_refused_in_one_line(glmpost_cli, tiny_checkpoint, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_checkpoint, base)
    adapter = make_lora_version(base, tmp_path / "lora", seed=2)
    os.utime(base / "model.safetensors")  # new time stamps (a copy, a touch): hashed again, still the same weights
    assert read_lora_base(adapter) == base.resolve() and (base / HASH_SIDECAR).is_file()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "q", "prompt": "count: 1"}) + "\n")
    tensors = load_file(base / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 1.01
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="changed") as caught:
        load_model(adapter)
    assert str(adapter) in str(caught.value) and str(base.resolve()) in str(caught.value)
    error = one_line_error(glmpost_cli("rollout", prompts, "--checkpoint", adapter, "--out", tmp_path / "ro"))
    assert f"LoRA version {adapter}: its base {base.resolve()} changed" in error
    shutil.rmtree(base)
    error = one_line_error(glmpost_cli("rollout", prompts, "--checkpoint", adapter, "--out", tmp_path / "ro"))
    assert f"LoRA version {adapter}: its base {base.resolve()} is missing" in error
    raw = tmp_path / "raw"
    raw.mkdir()
    shutil.copy(adapter / "adapter_config.json", raw)
    with pytest.raises(CheckpointError, match="a PEFT adapter without glmpost.json"):
        resolve_checkpoint(raw)


def test_write_refuses_a_lora_base_and_another_tokenizer_revision(tiny_checkpoint, lora, tmp_path):
    from peft import get_peft_model

    model = load_weights(tiny_checkpoint, torch.float32)
    peft_model = get_peft_model(model, peft_config(LoraSettings(2, 4.0, ("o_proj",)), model))
    manifest = CheckpointManifest(policy_version=1, tokenizer_revision="sha256:0000000000000000", stage="test")
    with pytest.raises(CheckpointError, match="differs from its base"):
        write_lora_version(tmp_path / "lora", peft_model, base=tiny_checkpoint, manifest=manifest)
    with pytest.raises(CheckpointError, match=f"its base {lora} is itself a LoRA version"):
        write_lora_version(tmp_path / "lora", peft_model, base=lora, manifest=manifest)
    assert not (tmp_path / "lora").exists()


# --------------------------------------------------------------------------------------------
# in a checkpoint root


def _publish(root: CheckpointRoot, staging: Path, version: int, **kwargs) -> Path:
    return root.publish(staging, version, **kwargs)


def test_root_latest_keep_and_locks_treat_lora_versions_as_versions(tiny_checkpoint, tmp_path):
    root = CheckpointRoot(tmp_path / "root")
    with output_lock(root.path, stage="test"):
        with pytest.raises(OutputLocked):  # one writer per root, whatever kind of version it writes
            with output_lock(root.path, stage="other"):
                pass
        staging = tmp_path / "root" / ".staging-v000000"
        shutil.copytree(tiny_checkpoint, staging)
        _publish(root, staging, 0)
        base = root.version_dir(0)
        for version in (1, 2, 3):
            make_lora_version(base, tmp_path / "root" / f".staging-v{version:06d}", seed=version, version=version)
            _publish(root, tmp_path / "root" / f".staging-v{version:06d}", version, move_latest=version < 3)
        assert root.latest() == 2 and root.repair_latest() == ("v000002", 3)  # a crash before LATEST moved
    assert root.versions() == [0, 1, 2, 3] and resolve_checkpoint(root.path) == root.version_dir(3)
    plan = NextVersion.plan(root.path, root.path)
    assert (plan.parent, plan.version) == (root.version_dir(3), 4)
    assert prune(root.path, 1) == [1, 2]  # v000000 stays: the base of the kept v000003
    assert root.versions() == [0, 3]
    model = load_model(root.path)
    assert model.glmpost_adapter == str(root.version_dir(3))


# --------------------------------------------------------------------------------------------
# every stage that loads a policy, through the CLI


@pytest.fixture(scope="module")
def rollout(lora, tmp_path_factory) -> Path:
    from conftest import run_glmpost

    tmp = tmp_path_factory.mktemp("lora-rollout")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{d}", "prompt": "count: " + " ".join(str(d) * (1 + d % 3))}) + "\n"
                               for d in range(6)))
    result = run_glmpost("rollout", prompts, "--checkpoint", lora, "--out", tmp / "rollout", "--group-size", "2",
                         "--max-new-tokens", "12", "--stop-token-ids", "none")
    assert result.exit_code == 0, result.stderr
    return tmp / "rollout"


def _records(directory: Path) -> list[dict]:
    return [r for path in sorted(directory.glob("*.msgpack.zst")) for r in ShardReader(path)]


def _diff(glmpost_cli, records: Path, checkpoint: Path, out: Path) -> dict:
    result = glmpost_cli("diff-logprobs", records, "--checkpoint", checkpoint, "--out", out, "--dtype", "fp32", "--no-plots", "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)["overall"]


def test_rollout_of_a_lora_version_closes_under_diff_logprobs(glmpost_cli, rollout, lora, tiny_checkpoint, tmp_path):
    records = _records(rollout)
    assert len(records) == 12 and {int(v) for r in records for v in r["policy_versions"] if v >= 0} == {1}
    same = _diff(glmpost_cli, rollout, lora, tmp_path / "same")
    print(f"rollout of a LoRA version vs the same version: max |delta| {same['max_abs']:.3g} over {same['tokens']} tokens")
    assert same["tokens"] == 6 * 2 * 12 and same["max_abs"] <= CLOSE and same["sample_agreement"] == 1.0
    base = _diff(glmpost_cli, rollout, tiny_checkpoint, tmp_path / "base")
    print(f"rollout of a LoRA version vs its base: max |delta| {base['max_abs']:.3g}")
    assert base["max_abs"] > 1e-2  # the adapter matters: far beyond rounding


def test_lora_teacher_scores_its_own_rollout(glmpost_cli, rollout, lora, tiny_checkpoint, tmp_path):
    """A LoRA teacher's log-probs of tokens it sampled itself (temperature 1, no filter) are the
    rollout's; its base's are not."""
    teacher = {}
    for name, checkpoint in (("lora", lora), ("base", tiny_checkpoint)):
        result = glmpost_cli("score-teacher", rollout, "--out", tmp_path / name, "--teacher", checkpoint)
        assert result.exit_code == 0, result.stderr
        teacher[name] = np.concatenate([r["teacher_log_probs"] for r in _records(tmp_path / name)])
    sampled = np.concatenate([r["rollout_log_probs"] for r in _records(rollout)])
    same, base = (float(np.max(np.abs(teacher[name] - sampled))) for name in ("lora", "base"))
    print(f"LoRA teacher vs its rollout: max |delta| {same:.3g}; its base: {base:.3g}")
    assert same <= CLOSE and base > 1e-2


def test_eval_of_a_lora_version(glmpost_cli, lora, tmp_path):
    result = glmpost_cli("eval", ROOT / "recipes" / "data" / "count-train.jsonl", "--checkpoint", lora, "--out", tmp_path / "eval",
                         "--n", 2, "--limit", 3, "--max-new-tokens", 4, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["policy_version"] == 1 and (tmp_path / "eval" / "report.json").is_file()


def test_judge_reward_models_from_lora_versions(glmpost_cli, rollout, lora, tiny_checkpoint, tmp_path):
    """A LoRA generative judge and a LoRA ORM (a PEFT adapter of a sequence classifier) score the
    rollout; each differs from its base."""
    from test_rewards import build_tiny_orm

    orm = build_tiny_orm(tmp_path / "orm", tiny_checkpoint)
    orm_lora = make_lora_version(orm, tmp_path / "orm-lora", seed=4, targets=("q_proj", "v_proj", "down_proj"), task_type=None)
    outputs = {}
    for name, (judge, scorer) in {"lora": (lora, orm_lora), "base": (tiny_checkpoint, orm)}.items():
        result = glmpost_cli("judge", rollout, "--out", tmp_path / f"judged-{name}", "--checkpoint", lora,
                             "--reward", f"name=orm,source=orm,checkpoint={scorer}",
                             "--reward", f'{{name = "judge", source = "judge", checkpoint = "{judge}", max_new_tokens = 6}}')
        assert result.exit_code == 0, result.stderr
        records = _records(tmp_path / f"judged-{name}")
        outputs[name] = ([r["rewards"]["orm"] for r in records],
                         [r["reward_info"]["components"]["judge"].get("output") for r in records])
    assert all(0 < v < 1 for v in outputs["lora"][0]) and not any(math.isnan(v) for v in outputs["lora"][0])
    assert outputs["lora"][0] != outputs["base"][0] and outputs["lora"][1] != outputs["base"][1]
