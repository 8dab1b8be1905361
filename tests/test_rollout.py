"""``glmpost rollout``: exact evidence per action, reproducible shards, splits and resumption, refusals."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from glmpost.checkpoints import CheckpointRoot
from glmpost.formats import ShardReader, read_shard, resolve_shard_paths
from glmpost.kernel.engine import filter_logits
from glmpost.kernel.loading import load_model
from glmpost.kernel.logprobs import sequence_log_probs


def _prompts(tmp_path, count=5):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{d}", "prompt": f"count: {d}", "domain": "count", "task": {"digit": str(d)}}) + "\n" for d in range(count)))
    return path


def _records(directory):
    return [r for p in resolve_shard_paths([directory]) for r in ShardReader(p)]


def _same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], np.ndarray):
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key], equal_nan=True), key
        else:
            assert a[key] == b[key], key


def test_rollout_records_every_field_and_reproduces_bit_for_bit(glmpost_cli, tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    prompts = _prompts(tmp_path)
    args = ["rollout", prompts, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "a", "--group-size", "3",
            "--max-new-tokens", "6", "--stop-token-ids", "none", "--seed", "7", "--prompts-per-shard", "2"]
    first = glmpost_cli(*args, "--json")
    assert first.exit_code == 0, first.stderr
    summary = json.loads(first.stdout)
    assert summary["records"] == 15 and summary["shards_written"] == 3 and summary["truncation_rate"] == 1.0
    shards = sorted((tmp_path / "a").glob("*.msgpack.zst"))
    saved = {p.name: p.read_bytes() for p in shards}
    assert glmpost_cli(*args, "--overwrite").exit_code == 0
    assert {p.name: p.read_bytes() for p in shards} == saved  # same seed, same bytes

    records = _records(tmp_path / "a")
    record = records[0]
    assert record["id"] == "q0@v0s7/0" and record["group_id"] == "q0@v0s7" and record["prompt_id"] == "q0"
    assert record["domain"] == "count" and record["task"] == {"digit": "0"}
    assert record["status"] == "truncated" and record["response_token_ids"].shape == (6,)
    assert record["action_mask"].all() and not record["observation_mask"].any()
    assert (record["policy_versions"] == 0).all() and (record["rollout_log_probs"] < 0).all()
    assert record["sampling"]["seed"] == 7 and record["sampling"]["group_size"] == 3
    assert record["segments"] == [{"start": 0, "end": 6, "kind": "action", "turn": 0}]
    assert len({r["group_id"] for r in records}) == 5
    assert len({r["response_token_ids"].tobytes() for r in records}) > 1
    metrics = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["rollout/truncation_rate"] == 1.0 and metrics[0]["rollout/tokens_per_s"] > 0


def test_samples_do_not_depend_on_batch_size_or_split(glmpost_cli, tiny_checkpoint, tmp_path):
    # Each sequence draws from its own generator, and the deterministic DSA top-k makes its logits
    # independent of how much left padding its batch gives it.
    prompts = _prompts(tmp_path)
    common = ["--checkpoint", tiny_checkpoint, "--group-size", "2", "--max-new-tokens", "5", "--stop-token-ids", "none",
              "--prompts-per-shard", "1"]
    assert glmpost_cli("rollout", prompts, *common, "--out", tmp_path / "whole", "--batch-size", "16").exit_code == 0
    for index in range(2):
        result = glmpost_cli("rollout", prompts, *common, "--out", tmp_path / "split", "--batch-size", "3",
                             "--shard-index", index, "--num-shards", 2)
        assert result.exit_code == 0, result.stderr
    whole = {r["id"]: r for r in _records(tmp_path / "whole")}
    split = {r["id"]: r for r in _records(tmp_path / "split")}
    assert whole.keys() == split.keys() and len(whole) == 10
    for key in whole:
        assert np.array_equal(whole[key]["response_token_ids"], split[key]["response_token_ids"])
        np.testing.assert_allclose(whole[key]["rollout_log_probs"], split[key]["rollout_log_probs"], atol=1e-5)


def test_rerun_writes_only_missing_shards(glmpost_cli, tiny_checkpoint, tmp_path):
    prompts = _prompts(tmp_path)
    args = ["rollout", prompts, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "r", "--group-size", "2",
            "--max-new-tokens", "4", "--prompts-per-shard", "2", "--json"]
    assert glmpost_cli(*args).exit_code == 0
    shards = sorted((tmp_path / "r").glob("*.msgpack.zst"))
    kept = {p.name: p.stat().st_mtime_ns for p in shards}
    before = read_shard(shards[1]).records
    shards[1].unlink()
    rerun = json.loads(glmpost_cli(*args).stdout)
    assert rerun["shards_written"] == 1 and rerun["shards_skipped"] == 2
    assert shards[0].stat().st_mtime_ns == kept[shards[0].name]
    for a, b in zip(before, read_shard(shards[1]).records):
        _same(a, b)
    changed = glmpost_cli(*args[:-1], "--seed", "5")
    assert changed.exit_code == 2 and "was written with --seed 0, now 5" in changed.stderr


def test_stop_tokens_complete_and_policy_version_comes_from_latest(glmpost_cli, tiny_checkpoint, tmp_path):
    root = CheckpointRoot(tmp_path / "root")
    staged = tmp_path / "v3"
    shutil.copytree(tiny_checkpoint, staged)
    manifest = json.loads((staged / "glmpost.json").read_text())
    (staged / "glmpost.json").write_text(json.dumps({**manifest, "policy_version": 3}))
    root.publish(staged, 3)
    every_id = ",".join(str(i) for i in range(512))
    result = glmpost_cli("rollout", _prompts(tmp_path, 2), "--checkpoint", root.path, "--out", tmp_path / "o",
                         "--group-size", "2", "--stop-token-ids", every_id)
    assert result.exit_code == 0, result.stderr
    for record in _records(tmp_path / "o"):
        assert record["status"] == "completed" and len(record["response_token_ids"]) == 1
        assert record["policy_versions"].tolist() == [3] and record["group_id"].endswith("@v3s0")
    # LATEST moves on: the shards in --out belong to v3, so they are not silently kept for v4.
    staged = tmp_path / "v4"
    shutil.copytree(root.version_dir(3), staged)
    (staged / "glmpost.json").write_text(json.dumps({**manifest, "policy_version": 4}))
    root.publish(staged, 4)
    stale = glmpost_cli("rollout", _prompts(tmp_path, 2), "--checkpoint", root.path, "--out", tmp_path / "o",
                        "--group-size", "2", "--stop-token-ids", every_id)
    assert stale.exit_code == 2 and "was written with policy_version 3, now 4" in stale.stderr


def test_rollout_log_probs_equal_the_trainers_when_dsa_selects_every_key(glmpost_cli, wide_checkpoint, tmp_path):
    # With index_topk >= sequence length the DSA indexer selects every key on both paths, so the
    # engine's incremental log-probs and a full-sequence forward agree (shared/notes: mismatch 0).
    checkpoint = wide_checkpoint
    assert glmpost_cli("rollout", _prompts(tmp_path, 3), "--checkpoint", checkpoint, "--out", tmp_path / "o",
                       "--group-size", "2", "--max-new-tokens", "8", "--stop-token-ids", "none",
                       "--temperature", "0.8").exit_code == 0
    model = load_model(checkpoint)
    for record in _records(tmp_path / "o"):
        ids = torch.tensor([record["prompt_token_ids"].tolist() + record["response_token_ids"].tolist()])
        result = sequence_log_probs(model, ids, response_start=len(record["prompt_token_ids"]), temperature=0.8)
        recomputed = result.log_probs[0, -len(record["response_token_ids"]):]
        np.testing.assert_allclose(recomputed.detach().numpy(), record["rollout_log_probs"], atol=2e-5)


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top_k = filter_logits(logits, temperature=1.0, top_k=2, top_p=1.0)
    assert torch.isinf(top_k[0, 2:]).all() and torch.isfinite(top_k[0, :2]).all()
    # top_p 0.75: 0.5 + 0.3 reaches it; the token crossing the threshold is kept.
    top_p = filter_logits(logits, temperature=1.0, top_k=0, top_p=0.75)
    assert torch.isfinite(top_p[0, :2]).all() and torch.isinf(top_p[0, 2:]).all()
    kept = torch.softmax(top_p, dim=-1)[0, :2]
    assert kept.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8])
    assert torch.equal(filter_logits(logits, temperature=2.0, top_k=0, top_p=1.0), logits / 2.0)


def test_bad_prompts_are_clear_errors(glmpost_cli, tiny_checkpoint, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    result = glmpost_cli("rollout", empty, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "o")
    assert result.exit_code == 1 and result.stderr.strip() == f"glmpost: error: {empty}: no prompts (the file is empty)"
    long = glmpost_cli("rollout", _prompts(tmp_path, 1), "--checkpoint", tiny_checkpoint, "--out", tmp_path / "o",
                       "--max-new-tokens", "510")
    assert long.exit_code == 1 and "prompt 'q0'" in long.stderr and "exceeds the model's context of 512 tokens" in long.stderr
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "count: 1"}\n{"prompt": 3}\n')
    bad = glmpost_cli("rollout", broken, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "o")
    assert bad.exit_code == 1 and f"{broken}:2: needs a string 'prompt' or a 'messages' list" in bad.stderr
    stops = glmpost_cli("rollout", _prompts(tmp_path, 1), "--checkpoint", tiny_checkpoint, "--out", tmp_path / "o",
                        "--stop-token-ids", "a,b")
    assert stops.exit_code == 2 and "--stop-token-ids 'a,b'" in stops.stderr
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").glob("*.msgpack.zst"))
    assert all("Traceback" not in r.stderr for r in (result, long, bad, stops))


def test_local_records_say_their_seeds_reproduce_and_what_their_log_probs_are_of(glmpost_cli, tiny_checkpoint, tmp_path):
    result = glmpost_cli("rollout", _prompts(tmp_path, 1), "--checkpoint", tiny_checkpoint, "--out", tmp_path / "o",
                         "--group-size", "2", "--max-new-tokens", "3", "--top-k", "20")
    assert result.exit_code == 0, result.stderr
    for record in _records(tmp_path / "o"):
        assert record["sampling"]["seed_reproducible"] is True and record["sampling"]["log_prob_kind"] == "sampled"
    options = json.loads((tmp_path / "o" / "stage.json").read_text())["options"]
    assert "api_key" not in options and options["server_log_prob_kind"] == "auto"
    bad = glmpost_cli("rollout", _prompts(tmp_path, 1), "--checkpoint", tiny_checkpoint, "--out", tmp_path / "b",
                      "--server-log-prob-kind", "filtered")
    assert bad.exit_code == 2 and "--server-log-prob-kind must be auto or one of sampled" in bad.stderr
    key = glmpost_cli("rollout", _prompts(tmp_path, 1), "--checkpoint", tiny_checkpoint, "--out", tmp_path / "b",
                      "--engine", "sglang", "--server", "127.0.0.1:1", "--api-key", "two words")
    assert key.exit_code == 2 and "--api-key: an API key must be printable" in key.stderr and "two words" not in key.stderr
