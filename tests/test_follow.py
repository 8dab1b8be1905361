"""``train-grpo --follow``: consume a spool as shards land, one version per batch, every trajectory
id trained at most once (duplicates skipped, an interrupted commit finished, not retrained)."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from glmpost.checkpoints import CheckpointRoot, read_manifest, tokenizer_revision
from glmpost.formats import ShardReader, ShardWriter, resolve_shard_paths
from glmpost.spool.spool import Spool


def _judged_batch(glmpost_cli, checkpoint, tmp_path, name: str, *rollout_args: str) -> list[Path]:
    """Two judged shards of 8 records (4 prompts x group 4, 2 prompts per shard) with ids unique to
    ``name`` (``rollout_args``: more rollout options)."""
    prompts = tmp_path / f"{name}.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"{name}-q{d}", "prompt": f"count: {d}", "domain": "count",
                                           "task": {"digit": str(d)}}) + "\n" for d in range(4)))
    rollout = tmp_path / f"{name}-rollout"
    result = glmpost_cli("rollout", prompts, "--checkpoint", checkpoint, "--out", rollout, "--group-size", "4",
                         "--max-new-tokens", "6", "--stop-token-ids", "none", "--prompts-per-shard", "2", "--seed", "1",
                         *rollout_args)
    assert result.exit_code == 0, result.stderr
    out = tmp_path / name
    out.mkdir()
    shards = []
    for path in resolve_shard_paths([rollout]):
        reader = ShardReader(path)
        target = out / f"{name}-{path.name}"
        with ShardWriter(target, stage="judge", tokenizer_revision=reader.header["tokenizer_revision"]) as writer:
            for index, record in enumerate(reader):
                reward = float(index % 4) / 4 + float(np.mean(record["response_token_ids"] % 2))
                writer.write({**record, "reward": reward, "rewards": {"correct": reward}})
        shards.append(target)
    return shards


def _publish(spool: Spool, shard: Path, name: str | None = None) -> None:
    """Into ready/ as a producer does: a hidden temporary name, then one rename."""
    target = spool.publish_path(name or shard.name)
    hidden = target.with_name("." + target.name + ".tmp")
    shutil.copyfile(shard, hidden)
    os.rename(hidden, target)


def _ids(shard: Path) -> list[str]:
    return [r["id"] for r in ShardReader(shard)]


def _follow(glmpost_cli, spool, checkpoint, root, *args):
    return glmpost_cli("train-grpo", "--follow", spool, "--checkpoint", checkpoint, "--out", root, "--poll-s", "0.05",
                       "--idle-timeout", "1", "--max-version-lag", "3", "--json", *args)


def test_follow_trains_each_trajectory_once_and_skips_a_republished_one(glmpost_cli, tiny_checkpoint, tmp_path):
    spool = Spool(tmp_path / "spool", tokenizer_revision=tokenizer_revision(tiny_checkpoint))
    first, second = _judged_batch(glmpost_cli, tiny_checkpoint, tmp_path, "a"), _judged_batch(glmpost_cli, tiny_checkpoint, tmp_path, "b")
    for shard in first:
        _publish(spool, shard)
    root = tmp_path / "policy"
    result = _follow(glmpost_cli, spool.path, tiny_checkpoint, root, "--follow-records", "16", "--max-versions", "1")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["versions"] == [1] and summary["stopped_by"] == "max_versions"
    manifest = read_manifest(CheckpointRoot(root).version_dir(1))
    assert manifest.extra["spool"]["shards"] == {s.name: _ids(s) for s in first}  # the commit record
    assert spool.depth().done == 2 and spool.consumed_ids() == set(_ids(first[0]) + _ids(first[1]))

    # A producer that restarted publishes one of the first shards again (same ids), then new work.
    _publish(spool, first[0], "a-again.msgpack.zst")
    for shard in second:
        _publish(spool, shard)
    result = _follow(glmpost_cli, spool.path, tiny_checkpoint, root, "--follow-records", "8", "--max-versions", "2")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["versions"] == [2, 3] and summary["dropped_records"] == 8
    ledger = spool.ledger()
    assert [(e["shard"], e["version"]) for e in ledger][2:] == [("a-again.msgpack.zst", -1), (second[0].name, 2), (second[1].name, 3)]
    trained = [i for e in ledger if e["version"] >= 0 for i in e["ids"]]
    assert len(trained) == len(set(trained)) == 32  # every published trajectory once, the republished one not again
    assert read_manifest(CheckpointRoot(root).version_dir(3)).parent.endswith("v000002")
    follow_lines = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines() if "follow/policy_version" in line]
    assert [line["follow/policy_version"] for line in follow_lines] == [1, 2, 3]
    assert follow_lines[-1]["follow/version_lag/2"] == 8  # sampled at v0, trained from v2

    other = _follow(glmpost_cli, spool.path, tiny_checkpoint, tmp_path / "another-root", "--max-versions", "1")
    assert other.exit_code == 1 and "needs its own spool" in other.stderr and len(other.stderr.strip().splitlines()) == 1


def test_a_follow_run_leaves_the_config_it_was_given_unchanged(glmpost_cli, tiny_checkpoint, tmp_path, monkeypatch):
    """The records' sampling distribution reaches the trainer with each update, never through the
    stage's config: after a follow run of several batches the config equals a copy taken before."""
    import glmpost.commands.train_grpo as command
    from glmpost.rl.follow_session import grpo_follow

    given = {}

    def follow(follow_config, *, config, **kwargs):
        given["config"], given["before"] = config, copy.deepcopy(config)
        return grpo_follow(follow_config, config=config, **kwargs)

    monkeypatch.setattr(command, "grpo_follow", follow)
    spool = Spool(tmp_path / "spool", tokenizer_revision=tokenizer_revision(tiny_checkpoint))
    for shard in _judged_batch(glmpost_cli, tiny_checkpoint, tmp_path, "a", "--temperature", "0.8", "--top-k", "20"):
        _publish(spool, shard)
    root = tmp_path / "policy"
    result = _follow(glmpost_cli, spool.path, tiny_checkpoint, root, "--follow-records", "8")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["versions"] == [1, 2]
    assert vars(given["config"]) == vars(given["before"])  # no field changed, none added
    for version in (1, 2):  # and the trainer took the records' distribution all the same
        stage = json.loads((CheckpointRoot(root).version_dir(version) / "stage.json").read_text())
        assert stage["batches"][0]["log_prob_distribution"] == {"temperature": 0.8, "top_k": 20, "top_p": 1.0}


def test_a_commit_interrupted_after_publishing_is_finished_not_retrained(glmpost_cli, tiny_checkpoint, tmp_path, monkeypatch):
    spool = Spool(tmp_path / "spool", tokenizer_revision=tokenizer_revision(tiny_checkpoint))
    shards = _judged_batch(glmpost_cli, tiny_checkpoint, tmp_path, "a")
    for shard in shards:
        _publish(spool, shard)
    root = tmp_path / "policy"
    real_commit = Spool.commit

    def crash(self, *args, **kwargs):
        raise RuntimeError("killed between publishing v1 and committing its shards")

    monkeypatch.setattr(Spool, "commit", crash)
    with pytest.raises(RuntimeError, match="killed between"):
        _follow(glmpost_cli, spool.path, tiny_checkpoint, root, "--follow-records", "16", "--max-versions", "1")
    assert CheckpointRoot(root).versions() == [1]
    assert spool.depth().ready == 2 and spool.ledger() == []  # the claims went back; the manifest holds the commit
    monkeypatch.setattr(Spool, "commit", real_commit)
    result = _follow(glmpost_cli, spool.path, tiny_checkpoint, root, "--follow-records", "16", "--max-versions", "1")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["versions"] == [] and CheckpointRoot(root).versions() == [1]  # not trained again
    assert [(e["shard"], e["version"]) for e in spool.ledger()] == [(s.name, 1) for s in shards]
    assert spool.depth().done == 2


def _optimizer_steps(version_dir: Path) -> int:
    import torch

    state = torch.load(version_dir / "trainer_state" / "optimizer.pt", weights_only=False)["state"]["state"]
    return int(next(iter(state.values()))["step"])


@pytest.mark.parametrize("reset", [False, True])
def test_publish_every_keeps_the_trainer_in_memory_and_max_steps_stops(glmpost_cli, tiny_checkpoint, tmp_path, reset):
    spool = Spool(tmp_path / "spool", tokenizer_revision=tokenizer_revision(tiny_checkpoint))
    shards = _judged_batch(glmpost_cli, tiny_checkpoint, tmp_path, "a") + _judged_batch(glmpost_cli, tiny_checkpoint, tmp_path, "b")
    for shard in shards:
        _publish(spool, shard)
    root = tmp_path / "policy"
    extra = ["--reset-optimizer"] if reset else []
    result = _follow(glmpost_cli, spool.path, tiny_checkpoint, root, "--follow-records", "8", "--publish-every", "2",
                     "--max-steps", "3", *extra)
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    # Updates 1-2 make v1; the third stops the run at --max-steps and is published, not lost.
    assert summary["versions"] == [1, 2] and summary["updates"] == 3 and summary["stopped_by"] == "max_steps"
    versions = CheckpointRoot(root)
    first, second = read_manifest(versions.version_dir(1)), read_manifest(versions.version_dir(2))
    assert list(first.extra["spool"]["shards"]) == [s.name for s in shards[:2]]
    assert list(second.extra["spool"]["shards"]) == [shards[2].name] and second.parent.endswith("v000001")
    assert first.extra["trained_records"] == 16 and second.extra["trained_records"] == 8
    stage = json.loads((versions.version_dir(1) / "stage.json").read_text())
    assert stage["updates"] == 2 and len(stage["batches"]) == 2
    steps_per_update = int(first.step) // 2
    assert steps_per_update >= 1
    # AdamW's state carries over within a version and across publishes, unless --reset-optimizer.
    assert _optimizer_steps(versions.version_dir(1)) == 2 * steps_per_update
    assert _optimizer_steps(versions.version_dir(2)) == (1 if reset else 3) * steps_per_update
    assert spool.depth().ready == 1 and [e["version"] for e in spool.ledger()] == [1, 1, 2]

    # A run that goes idle before --publish-every is reached publishes what it trained.
    result = _follow(glmpost_cli, spool.path, tiny_checkpoint, root, "--follow-records", "8", "--publish-every", "5", *extra)
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["versions"] == [3] and summary["updates"] == 1 and summary["stopped_by"] == "idle"
    trained = [i for e in spool.ledger() for i in e["ids"]]
    assert len(trained) == len(set(trained)) == 32 and spool.depth().done == 4


def test_a_wholly_stale_batch_is_dropped_with_its_lengths_and_rewards(glmpost_cli, tiny_checkpoint, tmp_path):
    spool = Spool(tmp_path / "spool", tokenizer_revision=tokenizer_revision(tiny_checkpoint))
    shards = _judged_batch(glmpost_cli, tiny_checkpoint, tmp_path, "a")
    _publish(spool, shards[0])
    root = tmp_path / "policy"
    assert _follow(glmpost_cli, spool.path, tiny_checkpoint, root, "--follow-records", "8", "--max-versions", "1").exit_code == 0
    _publish(spool, shards[1])  # sampled at v0, trained from v1: one version too old for --max-staleness 0
    result = _follow(glmpost_cli, spool.path, tiny_checkpoint, root, "--follow-records", "8", "--max-staleness", "0")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["versions"] == [] and summary["stale_dropped"] == 8 and summary["dropped_records"] == 8
    records = list(ShardReader(shards[1]))
    line = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines() if "follow/dropped_shards" in x][-1]
    assert line["follow/stale_dropped"] == 8
    assert line["follow/stale_dropped_response_length_mean"] == pytest.approx(np.mean([len(r["response_token_ids"]) for r in records]))
    assert line["follow/stale_dropped_reward_mean"] == pytest.approx(np.mean([r["reward"] for r in records]))
    assert [e["version"] for e in spool.ledger()] == [1, -1]


def test_follow_refuses_inputs_and_an_empty_invocation(glmpost_cli, tiny_checkpoint, tmp_path):
    both = glmpost_cli("train-grpo", str(tmp_path), "--follow", tmp_path / "spool", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "r")
    assert both.exit_code == 2 and "drop the INPUTS" in both.stderr
    neither = glmpost_cli("train-grpo", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "r")
    assert neither.exit_code == 2 and "--follow SPOOL" in neither.stderr


@pytest.fixture(autouse=True)
def _no_stray_signal_handlers():
    import signal

    before = signal.getsignal(signal.SIGTERM)
    yield
    assert signal.getsignal(signal.SIGTERM) == before


def test_diff_logprobs_by_version_separates_the_engine_from_the_lag(glmpost_cli, tiny_checkpoint, tmp_path):
    shards = _judged_batch(glmpost_cli, tiny_checkpoint, tmp_path, "a")
    root = tmp_path / "policy"
    trained = glmpost_cli("train-grpo", *map(str, shards), "--checkpoint", tiny_checkpoint, "--out", root, "--lr", "3e-3")
    assert trained.exit_code == 0, trained.stderr
    result = glmpost_cli("diff-logprobs", *map(str, shards), "--checkpoint", root, "--by-version", root, "--out", tmp_path / "d",
                         "--no-plots", "--json")
    assert result.exit_code == 0, result.stderr
    split = json.loads(result.stdout)["by_version"]
    assert split["current_version"] == 1 and split["versions_scored"] == [0] and list(split["by_lag"]) == ["1"]
    lag1 = split["by_lag"]["1"]
    assert lag1["tokens"] == 16 * 6
    # Same weights (v0, the root's first parent), two engines: float rounding only; one update: the lag.
    assert lag1["engine_max_abs"] < 1e-4 and lag1["icepop_kept"] == 1.0
    assert lag1["lag_mean_abs"] > 100 * lag1["engine_max_abs"]
    table = glmpost_cli("diff-logprobs", *map(str, shards), "--checkpoint", root, "--by-version", root, "--out", tmp_path / "t", "--no-plots")
    assert "lag 1: 96 tokens, engine mean|d|" in table.stdout
    refused = glmpost_cli("diff-logprobs", *map(str, shards), "--checkpoint", root, "--by-version", root, "--against", tiny_checkpoint,
                          "--out", tmp_path / "r")
    assert refused.exit_code == 2 and "--by-version splits the mismatch against the rollout log-probs" in refused.stderr


def test_score_teacher_and_opd_merge_follow_spools(glmpost_cli, tiny_checkpoint, wide_checkpoint, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"o{d}", "prompt": f"count: {d}"}) + "\n" for d in range(8)))
    rollout = tmp_path / "rollout"
    assert glmpost_cli("rollout", prompts, "--checkpoint", wide_checkpoint, "--out", rollout, "--group-size", "1",
                       "--max-new-tokens", "6", "--stop-token-ids", "none", "--prompts-per-shard", "4").exit_code == 0
    revision = tokenizer_revision(wide_checkpoint)
    rolled, scored = Spool(tmp_path / "rolled", tokenizer_revision=revision), tmp_path / "scored"
    for shard in resolve_shard_paths([rollout]):
        _publish(rolled, shard)
    result = glmpost_cli("score-teacher", "--follow", rolled.path, "--teacher", wide_checkpoint, "--out", scored,
                         "--poll-s", "0.05", "--idle-timeout", "1", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["shards"] == 2 and rolled.depth().done == 2
    scored_spool = Spool(scored, tokenizer_revision=revision, create=False)
    assert all("teacher_log_probs" in r for p in scored_spool.ready_dir.glob("*.msgpack.zst") for r in ShardReader(p))
    root = tmp_path / "student"
    result = glmpost_cli("opd-merge", "--follow", scored, "--checkpoint", wide_checkpoint, "--out", root, "--follow-records", "4",
                         "--max-version-lag", "1", "--poll-s", "0.05", "--idle-timeout", "1", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["versions"] == [1, 2]
    assert len(scored_spool.consumed_ids()) == 8 and scored_spool.depth().done == 2
    assert set(read_manifest(CheckpointRoot(root).version_dir(2)).extra["spool"]["shards"]) == {"rollout-00001.msgpack.zst"}
    refused = glmpost_cli("score-teacher", str(rollout), "--follow", rolled.path, "--teacher", wide_checkpoint, "--out", scored)
    assert refused.exit_code == 2 and "drop the SHARDS" in refused.stderr


def test_sigterm_publishes_the_updates_since_the_last_version(glmpost_cli, tiny_checkpoint, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    spool = Spool(tmp_path / "spool", tokenizer_revision=tokenizer_revision(tiny_checkpoint))
    shards = _judged_batch(glmpost_cli, tiny_checkpoint, tmp_path, "a")
    _publish(spool, shards[0])
    root = tmp_path / "policy"
    log = tmp_path / "trainer.log"
    trainer = subprocess.Popen([sys.executable, "-m", "glmpost.commands.app", "train-grpo", "--follow", str(spool.path),
                                "--checkpoint", str(tiny_checkpoint), "--out", str(root), "--poll-s", "0.05",
                                "--follow-records", "8", "--publish-every", "10", "--max-version-lag", "3", "--json"],
                               stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    deadline = time.monotonic() + 240
    while "update 1 " not in log.read_text():
        assert trainer.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    _publish(spool, shards[1])  # lands after the update: claimed or still ready when the signal comes
    trainer.send_signal(signal.SIGTERM)
    out, _ = trainer.communicate(timeout=240)
    assert trainer.returncode == 0, log.read_text()
    summary = json.loads(out)
    assert summary["stopped_by"] == "SIGTERM" and summary["versions"] == [1]
    manifest = read_manifest(CheckpointRoot(root).version_dir(1))
    assert shards[0].name in manifest.extra["spool"]["shards"]  # the update trained before the signal, published
    trained = [i for e in spool.ledger() for i in e["ids"]]
    assert set(_ids(shards[0])) <= set(trained) and len(trained) == len(set(trained))
    depth = spool.depth()
    assert depth.claimed == 0 and depth.ready + depth.done == 2  # nothing left claimed, nothing lost
