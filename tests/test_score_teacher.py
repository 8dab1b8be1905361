"""`glmpost score-teacher`: routing, payloads, exact token ids, rerun skips, refusals with no partial output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from glmpost.checkpoints import load_model
from glmpost.formats import ShardReader, write_shard
from glmpost.logprobs import sequence_log_probs

DATA = Path(__file__).resolve().parents[1] / "recipes" / "data"


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory, wide_checkpoint):
    from tests.conftest import run_glmpost

    out = tmp_path_factory.mktemp("st") / "rollouts"
    result = run_glmpost("rollout", DATA / "opd-prompts.jsonl", "--checkpoint", wide_checkpoint, "--out", out,
                         "--group-size", "1", "--max-new-tokens", "5", "--stop-token-ids", "none", "--limit", "16")
    assert result.exit_code == 0, result.stderr
    return out


def _records(directory: Path) -> list[dict]:
    return [r for path in sorted(directory.glob("*.msgpack.zst")) for r in ShardReader(path)]


def test_routes_by_domain_and_scores_exact_ids_at_temperature_one(glmpost_cli, rollouts, wide_checkpoint, tiny_checkpoint, tmp_path):
    out = tmp_path / "scored"
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[score-teacher]\npayload = "topk"\ntopk = 3\n[score-teacher.routes]\necho = "{wide_checkpoint}"\n')
    result = glmpost_cli("score-teacher", rollouts, "--out", out, "--config", recipe,
                         "--default-teacher", wide_checkpoint, "--batch-size", "3", "--chunk-size", "2", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["records"] == 16 and set(summary["teachers"]) == {"echo", "*"}
    records = _records(out)
    model = load_model(wide_checkpoint)
    for record in records:
        assert record["teacher"]["payload"] == "topk" and record["teacher"]["temperature"] == 1.0
        assert record["teacher"]["route"] == ("echo" if record["domain"] == "echo" else "*")
        ids = torch.tensor(np.concatenate([record["prompt_token_ids"], record["response_token_ids"]]))[None].long()
        with torch.no_grad():
            reference = sequence_log_probs(model, ids).log_probs[0, len(record["prompt_token_ids"]) - 1 :]
            full = torch.log_softmax(model(input_ids=ids).logits[0, len(record["prompt_token_ids"]) - 1 : -1].float(), -1)
        np.testing.assert_allclose(record["teacher_log_probs"], reference.numpy(), atol=1e-5)
        assert record["teacher_topk_ids"].shape == (5, 3)
        np.testing.assert_array_equal(record["teacher_topk_ids"], full.topk(3).indices.numpy())
    # A rerun keeps the complete shards.
    again = glmpost_cli("score-teacher", rollouts, "--out", out, "--config", recipe, "--default-teacher", wide_checkpoint, "--json")
    assert again.exit_code == 0 and json.loads(again.stdout)["skipped"] == 1


def test_observation_tokens_get_no_teacher_signal(glmpost_cli, rollouts, wide_checkpoint, tmp_path):
    records = _records(rollouts)[:2]
    record = dict(records[0])
    record["observation_mask"] = np.array([False, True, True, False, False])
    record["action_mask"] = ~record["observation_mask"]
    record["rollout_log_probs"] = np.where(record["action_mask"], record["rollout_log_probs"], np.nan).astype(np.float32)
    src = tmp_path / "in"
    src.mkdir()
    write_shard(src / "obs.msgpack.zst", [record], stage="rollout", tokenizer_revision=record["tokenizer_revision"])
    result = glmpost_cli("score-teacher", src, "--out", tmp_path / "out", "--teacher", wide_checkpoint)
    assert result.exit_code == 0, result.stderr
    (scored,) = _records(tmp_path / "out")
    assert np.isnan(scored["teacher_log_probs"][1:3]).all() and np.isfinite(scored["teacher_log_probs"][[0, 3, 4]]).all()


def test_refusals_leave_no_output(glmpost_cli, rollouts, wide_checkpoint, tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    # A missing route names the domain.
    result = glmpost_cli("score-teacher", rollouts, "--out", out, "--route", f"echo={wide_checkpoint}")
    assert result.exit_code == 2 and "'flip'" in result.stderr and "no teacher route" in result.stderr
    assert not out.exists()
    # A teacher whose tokenizer differs: both revisions in the message.
    foreign = tmp_path / "foreign"
    shutil.copytree(wide_checkpoint, foreign)
    config = json.loads((foreign / "tokenizer_config.json").read_text())
    config["model_max_length"] = 123
    (foreign / "tokenizer_config.json").write_text(json.dumps(config))
    (foreign / "glmpost.json").unlink()
    result = glmpost_cli("score-teacher", rollouts, "--out", out, "--teacher", foreign)
    assert result.exit_code == 1 and result.stderr.count("sha256:") == 2 and "tokenizer" in result.stderr
    # A teacher with another vocabulary size.
    wider = tmp_path / "wider"
    model = load_model(wide_checkpoint)
    model.resize_token_embeddings(model.config.vocab_size + 64)
    model.save_pretrained(wider)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (wide_checkpoint / name).exists():
            shutil.copy(wide_checkpoint / name, wider / name)
    result = glmpost_cli("score-teacher", rollouts, "--out", out, "--teacher", wider, "--student", wide_checkpoint)
    assert result.exit_code == 1 and "vocabulary" in result.stderr and str(model.config.vocab_size) in result.stderr
    # A teacher that does not load.
    broken = tmp_path / "broken"
    shutil.copytree(wide_checkpoint, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not weights")
    result = glmpost_cli("score-teacher", rollouts, "--out", out, "--teacher", broken)
    assert result.exit_code == 1 and "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_opd_merge_refuses_unscored_shards(glmpost_cli, rollouts, wide_checkpoint, tmp_path):
    result = glmpost_cli("opd-merge", rollouts, "--checkpoint", wide_checkpoint, "--out", tmp_path / "student")
    assert result.exit_code == 1 and "score-teacher" in result.stderr
    assert not (tmp_path / "student").exists()
