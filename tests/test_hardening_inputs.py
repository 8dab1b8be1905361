"""Hardening, inputs (issue 30): bad options, recipes and files are refused in one line naming the
option, recipe section or file (and line), before any work and without writing anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_train_grpo import _judged


def _one_line(result, exit_code: int = 2) -> str:
    assert result.exit_code == exit_code, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


@pytest.mark.parametrize("args, message", [
    (["rollout", "P", "--temperature", "inf"], "Invalid value for '--temperature': inf is not a finite number"),
    (["rollout", "P", "--temperature", "nan"], "Invalid value for '--temperature'"),
    (["rollout", "P", "--top-p", "0"], "Invalid value for '--top-p': 0.0 is not > 0"),
    (["rollout", "P", "--top-p", "1.5"], "Invalid value for '--top-p'"),
    (["train-grpo", "P", "--temperature", "-1"], "Invalid value for '--temperature': -1.0 is not > 0"),
    (["train-grpo", "P", "--advantage-eps", "-1"], "Invalid value for '--advantage-eps': -1.0 is not > 0"),
    (["train-grpo", "P", "--resume", "--overwrite"], "--resume continues an interrupted run and --overwrite starts it over"),
    (["sync-weights", "--timeout", "0"], "Invalid value for '--timeout': 0.0 is not > 0"),
    (["sync-weights", "--timeout", "-5"], "Invalid value for '--timeout': -5.0 is not > 0"),
    (["sync-weights", "--backoff", "-1"], "Invalid value for '--backoff'"),
    (["sync-weights", "--retries", "-1"], "Invalid value for '--retries'"),
])
def test_an_option_out_of_its_range_is_refused_before_any_work(glmpost_cli, tiny_checkpoint, tmp_path, args, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "count: 1"}\n')
    args = [str(prompts) if a == "P" else a for a in args]
    if args[0] == "sync-weights":
        args = ["sync-weights", str(tiny_checkpoint), *args[1:]]
    else:
        args = [*args, "--checkpoint", str(tiny_checkpoint)]
    result = glmpost_cli(*args, "--out", tmp_path / "out")
    assert message in _one_line(result)
    assert not (tmp_path / "out").exists()


def test_more_mini_batches_than_examples_is_refused_before_the_model_loads(glmpost_cli, tiny_checkpoint, tmp_path):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    result = glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "root", "--mini-batches", "17")
    assert "--mini-batches 17 is more than this update's 16 example(s)" in _one_line(result)
    assert not (tmp_path / "root").exists()  # no staging left to block the next run
    assert glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "root",
                       "--mini-batches", "16").exit_code == 0


def test_a_misspelled_recipe_section_or_a_bad_recipe_value_names_the_recipe(glmpost_cli, tiny_checkpoint, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "count: 1"}\n')
    recipe = tmp_path / "recipe.toml"
    run = ["rollout", prompts, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "out", "--config", recipe]
    recipe.write_text("[rolout]\ntemperature = 0.5\n")
    assert f"recipe {recipe}: unknown section [rolout] (known: " in _one_line(glmpost_cli(*run))
    recipe.write_text("[shards.improt]\nlevel = 3\n")  # inside a group too
    assert "unknown section [shards.improt]" in _one_line(glmpost_cli(*run))
    recipe.write_text("[rollout]\ntemperature = -0.5\n")
    assert f"recipe {recipe}: [rollout] temperature = -0.5: " in _one_line(glmpost_cli(*run))
    recipe.write_text("[rollout]\ngroup-size = \"many\"\n")
    assert f"recipe {recipe}: [rollout] group-size = 'many': " in _one_line(glmpost_cli(*run))
    recipe.write_text("[rollout]\ntemperature = inf\n")  # a parse-time bound (commands.options.bounded) too
    assert "[rollout] temperature = inf: inf is not a finite number" in _one_line(glmpost_cli(*run))
    recipe.write_bytes("[rollout]\n# caf\u00e9\n".encode("latin-1"))
    assert f"recipe {recipe}: not UTF-8 text (byte 15: invalid continuation byte)" in _one_line(glmpost_cli(*run))
    recipe.write_text("[rollout]\ngroup-size = 1\n[pipeline]\nstages = [\"rl\"]\n")  # known sections: it runs
    assert glmpost_cli(*run, "--max-new-tokens", "2").exit_code == 0
    assert not (tmp_path / ".out.lock").exists()


@pytest.mark.parametrize("stage", ["rollout", "shards import"])
def test_prompts_that_are_not_utf8_name_the_file_line_and_byte(glmpost_cli, tiny_checkpoint, tmp_path, stage):
    prompts = tmp_path / "p.jsonl"
    lines = [json.dumps({"id": "a", "prompt": "count: 1"}), '{"id": "b", "prompt": "caf\u00e9"}']
    prompts.write_bytes(("\n".join(lines) + "\n").encode("latin-1"))
    first = len(lines[0]) + 1
    result = glmpost_cli(*stage.split(), prompts, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "out")
    offset = first + lines[1].index("\u00e9")
    assert f"{prompts}:2: not UTF-8 text (byte {offset} of the file: invalid continuation byte)" in _one_line(result, 1)
    assert not Path(tmp_path / "out").exists()


def _llama(tiny_checkpoint, tmp_path) -> Path:
    """A one-layer Llama sharing the tiny checkpoint's tokenizer: a model with no GLM-5 attention."""
    import shutil

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from glmpost.checkpoints import TOKENIZER_FILES

    llama = tmp_path / "llama"
    vocab = len(AutoTokenizer.from_pretrained(str(tiny_checkpoint)))
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(llama)
    for name in TOKENIZER_FILES:
        if (tiny_checkpoint / name).is_file():
            shutil.copy2(tiny_checkpoint / name, llama / name)
    return llama


def test_diff_logprobs_indexer_on_a_model_without_one_is_one_line(glmpost_cli, tiny_checkpoint, tmp_path):
    llama = _llama(tiny_checkpoint, tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "count: 1"}\n')
    assert glmpost_cli("rollout", prompts, "--checkpoint", llama, "--out", tmp_path / "r", "--max-new-tokens", "3").exit_code == 0
    result = glmpost_cli("diff-logprobs", tmp_path / "r", "--checkpoint", llama, "--against", llama, "--indexer",
                         "--out", tmp_path / "d")
    assert "--indexer compares DSA indexer selections, but" in _one_line(result) and "(LlamaForCausalLM) has no DSA indexer" in result.stderr
    assert not (tmp_path / "d").exists()


def test_stage_json_records_the_attention_that_ran(glmpost_cli, tiny_checkpoint, tmp_path, monkeypatch):
    """``--attention native`` on a model without GLM-5 attention: its own attention runs, the log says
    so and stage.json records ``transformers``; a GLM-5 model records the path asked for."""
    from glmpost.kernel import loading

    monkeypatch.setattr(loading, "_SAID_REFERENCE", set())  # the log comes once per process and architecture
    llama = _llama(tiny_checkpoint, tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "count: 1"}\n')
    ran, logs = {}, {}
    for name, checkpoint, attention in (("llama", llama, "native"), ("glm5", tiny_checkpoint, "reference")):
        result = glmpost_cli("rollout", prompts, "--checkpoint", checkpoint, "--out", tmp_path / name, "--max-new-tokens", "3",
                             "--attention", attention)
        assert result.exit_code == 0, result.stderr
        ran[name], logs[name] = json.loads((tmp_path / name / "stage.json").read_text()), result.stderr
        assert ran[name]["options"]["attention"] == attention
    assert ran["llama"]["attention_ran"] == "transformers" and ran["glm5"]["attention_ran"] == "reference"
    assert "LlamaForCausalLM has no GLM-5 attention for --attention native" in logs["llama"]
    assert "no GLM-5 attention" not in logs["glm5"]
    result = glmpost_cli("diff-logprobs", tmp_path / "llama", "--checkpoint", llama, "--against", llama, "--out", tmp_path / "d")
    assert result.exit_code == 0, result.stderr
    assert json.loads((tmp_path / "d" / "stage.json").read_text())["attention_ran"] == "transformers"
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    assert report["path_a"]["attention"] == report["path_b"]["attention"] == "transformers"


def test_a_checkpoint_with_nan_weights_is_blamed_and_nothing_is_written(glmpost_cli, tiny_checkpoint, tmp_path):
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_checkpoint, damaged)
    weights = load_file(damaged / "model.safetensors")
    name = sorted(k for k in weights if ".mlp." in k)[0]
    weights[name][0, 0] = np.nan
    save_file(weights, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "count: 1"}\n')
    result = glmpost_cli("rollout", prompts, "--checkpoint", damaged, "--out", tmp_path / "out")
    assert f"{damaged}: weight {name} holds 1+ NaN or infinite value(s)" in _one_line(result, 1)
    assert not (tmp_path / "out").exists()


def test_integer_ids_and_domains_are_kept_as_text_and_other_types_refused(glmpost_cli, tiny_checkpoint, tmp_path):
    from glmpost.formats import ShardReader, resolve_shard_paths

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 7, "domain": 3, "prompt": "count: 1"}\n')
    assert glmpost_cli("rollout", prompts, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "r", "--max-new-tokens", "2",
                       "--group-size", "1").exit_code == 0
    [record] = [r for path in resolve_shard_paths([tmp_path / "r"]) for r in ShardReader(path)]
    assert record["id"].startswith("7@") and record["domain"] == "3"
    for bad in ('{"id": 1.5, "prompt": "x"}', '{"id": true, "prompt": "x"}', '{"domain": null, "prompt": "x"}'):
        prompts.write_text(bad + "\n")
        result = glmpost_cli("rollout", prompts, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "bad")
        assert f"{prompts}:1: '" in _one_line(result, 1) and "must be a string (or an integer" in result.stderr
