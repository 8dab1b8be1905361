"""`glmpost score-teacher`: routing, payloads, exact token ids, rerun skips, refusals with no partial output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from serve_process import start_server, stop_server

from glmpost.formats import ShardReader, write_shard
from glmpost.kernel.loading import load_model
from glmpost.kernel.logprobs import sequence_log_probs

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


# Measured on this CPU: the served and the local teacher log-probs (and top-k) are bit-identical
# (max difference 0.0, sampled and topk payloads), with the server batching 4 requests in flight.
# 1e-5 nats leaves room for other kernels' reduction orders while any off-by-one position,
# temperature or wrong teacher moves them by >= 1e-2.
SERVED_ATOL = 1e-5


def test_sglang_engine_against_a_real_server_writes_the_local_engines_values(glmpost_cli, rollouts, tmp_path):
    teacher = tmp_path / "teacher"  # another seed: teacher and student differ, the tokenizer is the same
    assert glmpost_cli("init-model", "--out", teacher, "--seed", "1", "--index-topk", "64").exit_code == 0
    proc, url = start_server(teacher)
    try:
        for payload in ("sampled", "topk"):
            local, remote = tmp_path / f"local-{payload}", tmp_path / f"remote-{payload}"
            flags = ["--teacher", teacher, "--payload", payload, "--topk", "4", "--json"]
            result = glmpost_cli("score-teacher", rollouts, "--out", local, *flags)
            assert result.exit_code == 0, result.stderr
            result = glmpost_cli("score-teacher", rollouts, "--out", remote, *flags, "--engine", "sglang",
                                 "--server", url, "--batch-size", "4")
            assert result.exit_code == 0, result.stderr
            assert json.loads(result.stdout)["records"] == 16
            pairs = list(zip(_records(local), _records(remote)))
            assert len(pairs) == 16
            worst = 0.0
            for a, b in pairs:
                assert a["id"] == b["id"]
                np.testing.assert_array_equal(a["response_token_ids"], b["response_token_ids"])
                assert b["teacher"]["engine"] == "sglang" and b["teacher"]["checkpoint"] == a["teacher"]["checkpoint"]
                assert {k: v for k, v in a["teacher"].items() if k != "engine"} == {k: v for k, v in b["teacher"].items() if k != "engine"}
                np.testing.assert_allclose(b["teacher_log_probs"], a["teacher_log_probs"], rtol=0, atol=SERVED_ATOL)
                worst = max(worst, float(np.abs(b["teacher_log_probs"] - a["teacher_log_probs"]).max()))
                # The teacher differs from the student that sampled: the values are the teacher's.
                assert np.abs(a["teacher_log_probs"] - a["rollout_log_probs"]).max() > 1e-2
                if payload == "topk":
                    np.testing.assert_array_equal(b["teacher_topk_ids"], a["teacher_topk_ids"])
                    np.testing.assert_allclose(b["teacher_topk_log_probs"], a["teacher_topk_log_probs"], rtol=0, atol=SERVED_ATOL)
                    worst = max(worst, float(np.abs(b["teacher_topk_log_probs"] - a["teacher_topk_log_probs"]).max()))
                else:
                    assert "teacher_topk_ids" not in b
            print(f"{payload}: max |served - local| = {worst:.2e}")
    finally:
        stop_server(proc)
