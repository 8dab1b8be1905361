"""The KV owner contract of ``rollout --follow`` (brief: "多轮会话的 DP routing 与 KV Cache owner 同步迁移或显式
失效"): a weight switch between the turns of a trajectory either recomputes the trajectory's cache under
the new weights or keeps the old weights' cache and records which turns used it; every action token
carries the version that sampled it; ``diff-logprobs`` shows the mismatch the stale cache causes.

The switch is made to happen between turns deterministically: the environment moves the root's
``LATEST`` to v1 on its first step, so turn 0 is sampled at v0 and the rest at v1.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_agentic import STOPS, Countdown

from glmpost.checkpoints import CheckpointManifest, CheckpointRoot, tokenizer_revision, write_manifest
from glmpost.formats import ShardReader, resolve_shard_paths
from glmpost.kernel.loading import load_model


class SwitchOnFirstStep(Countdown):
    """Countdown that points ``root``'s LATEST at ``version`` on its first step."""

    def __init__(self, root: str, version: int, turns: int = 3):
        super().__init__(turns)
        self.root, self.version = CheckpointRoot(root), version

    def step(self, action):
        if self.root.latest() != self.version:
            self.root.set_latest(self.version)
        return super().step(action)


class SyncOnFirstStep(Countdown):
    """Countdown whose first step anywhere in this process tells the server at ``url`` to load
    ``model_path`` as ``version`` (what ``sync-weights`` does), mid-trajectory."""

    synced: set = set()

    def __init__(self, url: str, model_path: str, version: int, turns: int = 3):
        super().__init__(turns)
        self.url, self.model_path, self.version = url, model_path, version

    def step(self, action):
        from glmpost.kernel.sglang_client import SGLangClient

        if self.url not in SyncOnFirstStep.synced:
            SyncOnFirstStep.synced.add(self.url)
            SGLangClient(self.url).update_weights_from_disk(self.model_path, weight_version=str(self.version))
        return super().step(action)


@pytest.fixture(scope="module")
def two_versions(tiny_checkpoint, tmp_path_factory):
    """A root holding v0 (the tiny model) and v1 (its weights perturbed), LATEST at v0."""
    root = tmp_path_factory.mktemp("kv") / "policy"
    shutil.copytree(tiny_checkpoint, root / "v000000")
    model = load_model(tiny_checkpoint, dtype="float32")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * parameter.std().nan_to_num(0.02) * torch.randn(parameter.shape, generator=generator))
    v1 = root / "v000001"
    model.save_pretrained(v1)
    for path in tiny_checkpoint.iterdir():
        if path.is_file() and not (v1 / path.name).exists():
            shutil.copy2(path, v1 / path.name)
    write_manifest(v1, CheckpointManifest(policy_version=1, tokenizer_revision=tokenizer_revision(tiny_checkpoint), stage="test",
                                          parent=str(root / "v000000")))
    return root


def _rollout(glmpost_cli, root, tmp_path, policy: str, *engine):
    CheckpointRoot(root).set_latest(0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{d}", "prompt": f"count: {d}", "task": {"digit": d}}) + "\n" for d in range(4)))
    spool = tmp_path / f"spool-{policy}"
    env = engine or ("--env", "test_kv_owner:SwitchOnFirstStep", "--env-options", json.dumps({"root": str(root), "version": 1}))
    result = glmpost_cli("rollout", prompts, "--checkpoint", root, "--follow", spool, "--max-rounds", "1", *env,
                         "--env-workers", "1", "--kv-on-switch", policy, "--group-size", "2", "--max-new-tokens", "16",
                         "--max-turns", "4", "--stop-token-ids", STOPS, "--temperature", "0.8", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    if not engine:
        assert summary["switches_between_turns"] == 1 and summary["policy_versions"] == [0, 1]
    records = [r for path in resolve_shard_paths([spool / "ready"]) for r in ShardReader(path)]
    multi = [r for r in records if len({s["turn"] for s in r["segments"]}) > 1]
    assert len(multi) >= 4  # most trajectories outlive the switch
    return spool, records, multi


def _turn_versions(record) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for segment in record["segments"]:
        if segment["kind"] == "action":
            out.setdefault(segment["turn"], set()).update(record["policy_versions"][segment["start"] : segment["end"]].tolist())
    return out


def _engine_split(glmpost_cli, root, spool, tmp_path, name):
    result = glmpost_cli("diff-logprobs", spool / "ready", "--checkpoint", root, "--by-version", root, "--out", tmp_path / name,
                         "--no-plots", "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_keep_records_the_stale_turns_and_diff_logprobs_measures_them(glmpost_cli, two_versions, tmp_path):
    spool, records, multi = _rollout(glmpost_cli, two_versions, tmp_path, "keep")
    for record in multi:
        versions = _turn_versions(record)
        assert versions[0] == {0} and all(versions[t] == {1} for t in versions if t > 0)  # each turn its own version
        assert "@v0s" in record["group_id"]  # the version its part (and group) started with
        stale = record["extra"]["kv_cache"]["stale_turns"]
        assert [e["turn"] for e in stale] == sorted(t for t in versions if t > 0)
        assert all(e["version"] == 1 and e["cache_version"] == 0 for e in stale)
    report = _engine_split(glmpost_cli, two_versions, spool, tmp_path, "diff")
    fresh, stale = report["by_version"]["engine_by_kv_cache"]["fresh"], report["by_version"]["engine_by_kv_cache"]["stale"]
    # Turn 0 at v0 re-scored by v0: float rounding. Later turns at v1 re-scored by v1 over the whole
    # trajectory, but sampled attending to v0's keys and values: the stale cache's mismatch.
    assert fresh["engine_max_abs"] < 1e-3
    assert stale["engine_mean_abs"] > max(1e-2, 50 * fresh["engine_max_abs"])
    assert report["by_kv_cache"]["stale"]["tokens"] == stale["tokens"]
    table = glmpost_cli("diff-logprobs", spool / "ready", "--checkpoint", two_versions, "--by-version", two_versions,
                        "--out", tmp_path / "table", "--no-plots")
    assert "kv-stale" in table.stdout and "engine on a stale KV cache" in table.stdout


def test_recompute_samples_later_turns_on_the_new_weights_cache(glmpost_cli, two_versions, tmp_path):
    spool, records, multi = _rollout(glmpost_cli, two_versions, tmp_path, "recompute")
    for record in multi:
        versions = _turn_versions(record)
        assert versions[0] == {0} and all(versions[t] == {1} for t in versions if t > 0)
        assert "kv_cache" not in record["extra"]
    split = _engine_split(glmpost_cli, two_versions, spool, tmp_path, "diff")["by_version"]
    assert list(split["engine_by_kv_cache"]) == ["fresh"]
    assert split["engine_max_abs"] < 1e-3  # every token re-scored by the weights that sampled it, history included


def test_an_unknown_kv_policy_is_one_error(glmpost_cli, tiny_checkpoint, tmp_path):
    result = glmpost_cli("rollout", tmp_path / "p.jsonl", "--checkpoint", tiny_checkpoint, "--follow", tmp_path / "s",
                         "--kv-on-switch", "maybe")
    assert result.exit_code == 2 and "--kv-on-switch must be one of recompute, keep, got 'maybe'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_server_told_by_sync_weights_mid_trajectory_stamps_the_version_it_reports(glmpost_cli, two_versions, tmp_path):
    """``--engine sglang`` against ``glmpost serve``: the rollout does not switch anything itself;
    the server loads v1 when told (as by ``sync-weights``) and flushes its caches, and each turn
    carries the weight version the server answered with ("不把'传输完成'等同于'新策略已生效'")."""
    from serve_process import start_server, stop_server

    server, url = start_server(two_versions / "v000000")
    try:
        env = ("--engine", "sglang", "--server", url, "--env", "test_kv_owner:SyncOnFirstStep", "--env-options",
               json.dumps({"url": url, "model_path": str(two_versions / "v000001"), "version": 1}))
        spool, records, multi = _rollout(glmpost_cli, two_versions, tmp_path, "recompute", *env)
    finally:
        stop_server(server)
    for record in multi:
        versions = _turn_versions(record)
        assert versions[0] == {0} and all(versions[t] == {1} for t in versions if t > 0)
    split = _engine_split(glmpost_cli, two_versions, spool, tmp_path, "diff")["by_version"]
    assert split["versions_scored"] == [0, 1] and split["engine_max_abs"] < 1e-3  # the server flushed its v0 caches
