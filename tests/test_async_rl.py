"""Asynchronous RL as real processes over spools: ``rollout --follow | judge --follow | train-grpo
--follow`` on the tiny model. Versions advance, stale trajectories are dropped and counted, the
rollout switches to the trainer's new versions, and after ``kill -9`` of the trainer and of the
rollout and a restart of each, every trajectory id published was trained at most once and none is
lost (the ledger checks it)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from glmpost.checkpoints import CheckpointRoot, read_manifest, tokenizer_revision
from glmpost.formats import ShardReader
from glmpost.spool.spool import Spool

GLMPOST = [sys.executable, "-m", "glmpost.commands.app"]


def _start(*args, log: Path) -> subprocess.Popen:
    return subprocess.Popen([*GLMPOST, *map(str, args)], stdout=subprocess.DEVNULL, stderr=open(log, "ab"),
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait(what, condition, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _all_shards(spool: Spool) -> list[Path]:
    return [p for area in (spool.ready_dir, spool.done_dir, *spool.claimed_dir.glob("*")) for p in area.glob("*.msgpack.zst")]


def test_rollout_judge_and_trainer_over_spools_survive_kill_9(tiny_checkpoint, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{d}", "prompt": f"count: {d}", "domain": "count", "task": {"digit": str(d)}}) + "\n"
                               for d in range(4)))
    revision = tokenizer_revision(tiny_checkpoint)
    rolled, judged = Spool(tmp_path / "rolled", tokenizer_revision=revision), Spool(tmp_path / "judged", tokenizer_revision=revision)
    root, logs = tmp_path / "policy", tmp_path / "logs"
    logs.mkdir()
    rollout = ["rollout", prompts, "--checkpoint", tiny_checkpoint, "--follow", rolled.path, "--reload-root", root,
               "--group-size", "4", "--max-new-tokens", "6", "--stop-token-ids", "none", "--prompts-per-shard", "2"]
    # The followers end with their input (end of stream); the idle timeout is only a safety net.
    judge = ["judge", "--follow", rolled.path, "--out", judged.path, "--checkpoint", tiny_checkpoint, "--poll-s", "0.1",
             "--idle-timeout", "600", "--lease-s", "5"]
    train = ["train-grpo", "--follow", judged.path, "--checkpoint", tiny_checkpoint, "--out", root, "--follow-records", "8",
             "--max-version-lag", "8", "--max-staleness", "1", "--poll-s", "0.1", "--lease-s", "3", "--idle-timeout", "600"]

    # Phase 1: two rounds (4 shards of 8 trajectories at v0) land before the trainer starts, so it
    # trains v1 (lag 0) and v2 (lag 1), then drops the lag-2 ones (--max-staleness 1) and counts them.
    # The rollout closes its stream after its last round, the judge then stops and closes its own,
    # and the trainer stops once it has taken everything.
    assert subprocess.run([*GLMPOST, *map(str, rollout), "--max-rounds", "2"], capture_output=True).returncode == 0
    assert rolled.closed()
    judging = subprocess.run([*GLMPOST, *map(str, judge), "--json"], capture_output=True, text=True, timeout=600)
    assert judging.returncode == 0 and json.loads(judging.stdout)["stopped_by"] == "end_of_stream", judging.stderr
    assert len(_all_shards(judged)) == 4 and judged.closed()
    trainer = subprocess.run([*GLMPOST, *map(str, train), "--json"], capture_output=True, text=True, timeout=600)
    assert trainer.returncode == 0, trainer.stderr
    summary = json.loads(trainer.stdout)
    assert summary["versions"] == [1, 2] and summary["dropped_records"] == 16 and summary["stopped_by"] == "end_of_stream"

    # Phase 2: rollout rounds 2-5 run while the trainer trains; each is killed -9 once and restarted.
    # Restarting its producers, the orchestrator opens their streams again first (as bin/async-rl
    # does): a follower that started on a closed, drained input would stop at once.
    assert len(rolled.reopen()) == 1 and len(judged.reopen()) == 1
    producing = _start(*rollout, "--max-rounds", "6", log=logs / "rollout.log")
    judging = _start(*judge, log=logs / "judge.log")
    training = _start(*train, log=logs / "train.log")
    _wait("v3", lambda: 3 in CheckpointRoot(root).versions())
    os.kill(training.pid, signal.SIGKILL)
    training.wait()
    _wait("a rollout shard of round 3", lambda: any("-r00003-" in p.name for p in _all_shards(rolled)))
    os.kill(producing.pid, signal.SIGKILL)
    producing.wait()
    producing = _start(*rollout, "--max-rounds", "6", log=logs / "rollout.log")
    training = _start(*train, log=logs / "train.log")
    assert producing.wait(timeout=300) == 0, (logs / "rollout.log").read_text()[-2000:]
    assert judging.wait(timeout=300) == 0, (logs / "judge.log").read_text()[-2000:]  # end of stream: no signal
    assert training.wait(timeout=300) == 0, (logs / "train.log").read_text()[-2000:]  # idle only after 600 s: the end

    # Nothing lost: every rollout shard was judged and every judged shard committed by the trainer.
    produced = {p.name for p in _all_shards(rolled)}
    assert len(produced) == 12 and {p.name for p in judged.done_dir.glob("*.msgpack.zst")} == produced
    published_ids = [r["id"] for p in judged.done_dir.glob("*.msgpack.zst") for r in ShardReader(p)]
    assert len(published_ids) == len(set(published_ids)) == 96
    ledger = judged.ledger()
    assert sorted(e["shard"] for e in ledger) == sorted(produced)  # each shard committed once
    trained = [i for e in ledger if e["version"] >= 0 for i in e["ids"]]
    dropped = [i for e in ledger if e["version"] < 0 for i in e["ids"]]
    assert len(trained) == len(set(trained)) and set(trained) | set(dropped) == set(published_ids)  # at most once, none lost
    versions = CheckpointRoot(root).versions()
    assert versions == list(range(1, len(versions) + 1)) and len(versions) >= 4
    # The rollout switched to the trainer's versions: later trajectories were sampled at v >= 1.
    sampled_at = {int(r["policy_versions"].max()) for p in judged.done_dir.glob("*-r0000[45]-*") for r in ShardReader(p)}
    assert max(sampled_at) >= 1


def test_bin_async_rl_runs_the_three_stages_from_one_recipe(tiny_checkpoint, tmp_path):
    root = Path(__file__).resolve().parents[1]
    script = root / "bin" / "async-rl"
    usage = subprocess.run([script, "recipes/tiny-async-rl.toml"], cwd=root, capture_output=True, text=True)
    assert usage.returncode == 2 and "usage: bin/async-rl RECIPE PROMPTS" in usage.stderr
    run_dir = tmp_path / "async"
    done = subprocess.run([script, "recipes/tiny-async-rl.toml", "recipes/data/count-train.jsonl", "--checkpoint", tiny_checkpoint,
                           "--run-dir", run_dir, "--max-rounds", "1"], cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert all(f"{stage} done" in done.stderr for stage in ("rollout", "judge", "train-grpo"))
    judged = Spool(run_dir / "judged", tokenizer_revision=tokenizer_revision(tiny_checkpoint), create=False)
    # 10 prompts, 2 per shard: 5 shards of 16; four made two versions of --follow-records 32, and the
    # fifth, the end of the stream, one more update of its own: every shard was taken.
    depth = judged.depth()
    assert (depth.ready, depth.claimed, depth.done) == (0, 0, 5)
    assert sorted(e["shard"] for e in judged.ledger()) == sorted(p.name for p in judged.done_dir.glob("*.msgpack.zst"))
    assert CheckpointRoot(run_dir / "policy").versions()[:1] == [1]


def test_bin_async_rl_trains_with_sao_when_the_recipe_has_a_train_sao_section(tiny_checkpoint, tmp_path):
    root = Path(__file__).resolve().parents[1]
    recipe = tmp_path / "async-sao.toml"  # tiny-async-rl.toml's trainer settings, for train-sao
    recipe.write_text((root / "recipes" / "tiny-async-rl.toml").read_text().replace("[train-grpo]", "[train-sao]"))
    run_dir = tmp_path / "async"
    done = subprocess.run([root / "bin" / "async-rl", recipe, "recipes/data/count-train.jsonl", "--checkpoint", tiny_checkpoint,
                           "--run-dir", run_dir, "--max-rounds", "1"], cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert all(f"{stage} done" in done.stderr for stage in ("rollout", "judge", "train-sao"))
    policies = CheckpointRoot(run_dir / "policy").versions()
    assert policies and CheckpointRoot(run_dir / "critic").versions() == [0, *policies]  # a critic with every version
    assert read_manifest(CheckpointRoot(run_dir / "policy").version_dir(policies[-1])).stage == "train-sao"


def test_bin_async_rl_with_dynamic_sampling_trains_informative_groups_only(tiny_checkpoint, tmp_path):
    """DAPO's dynamic sampling over spools: the judge leaves out the groups whose rewards are all
    equal, so the trainer's --follow-records batches hold informative groups only while the rollout
    samples on (over-sampling); at the tiny model's start most count groups are all-zero."""
    root = Path(__file__).resolve().parents[1]
    recipe = tmp_path / "async-dapo.toml"
    recipe.write_text((root / "recipes" / "tiny-async-rl.toml").read_text().replace("[judge]", "[judge]\ndynamic-sampling = true"))
    run_dir = tmp_path / "async"
    done = subprocess.run([root / "bin" / "async-rl", recipe, "recipes/data/count-train.jsonl", "--checkpoint", tiny_checkpoint,
                           "--run-dir", run_dir, "--max-rounds", "2"], cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    revision = tokenizer_revision(tiny_checkpoint)
    rolled = [r for p in _all_shards(Spool(run_dir / "rolled", tokenizer_revision=revision, create=False)) for r in ShardReader(p)]
    judged = [r for p in _all_shards(Spool(run_dir / "judged", tokenizer_revision=revision, create=False)) for r in ShardReader(p)]
    groups: dict = {}
    for record in judged:
        groups.setdefault(record["group_id"], []).append(record["reward"])
    assert len(rolled) == 2 * 10 * 8 and 0 < len(judged) < len(rolled)  # some groups were left out, some kept
    assert all(max(rewards) > min(rewards) for rewards in groups.values())  # every kept group can teach
    policy = CheckpointRoot(run_dir / "policy")
    trained = {i for v in policy.versions()
               for ids in read_manifest(policy.version_dir(v)).extra["spool"]["shards"].values() for i in ids}
    assert trained and trained <= {r["id"] for r in judged}


def test_bin_async_rl_serve_puts_a_server_and_the_weight_sync_between_trainer_and_rollout(tiny_checkpoint, tmp_path):
    root = Path(__file__).resolve().parents[1]
    run_dir = tmp_path / "async"
    done = subprocess.run([root / "bin" / "async-rl", "recipes/tiny-async-rl.toml", "recipes/data/count-train.jsonl", "--checkpoint",
                           tiny_checkpoint, "--run-dir", run_dir, "--serve", "--max-rounds", "2"], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert all(f"{stage} done" in done.stderr for stage in ("rollout", "judge", "train-grpo", "sync-weights"))
    trained = CheckpointRoot(run_dir / "policy").versions()
    served = [json.loads(line) for line in (run_dir / "served" / "metrics.jsonl").read_text().splitlines()]
    assert trained and {line.get("sync/policy_version") for line in served} & set(trained)  # the server was moved to trained versions
    rolled = Spool(run_dir / "rolled", tokenizer_revision=tokenizer_revision(tiny_checkpoint), create=False)
    stamps = {int(v) for path in _all_shards(rolled) for r in ShardReader(path) for v in set(r["policy_versions"].tolist()) if v >= 0}
    assert 0 in stamps and stamps <= {0, *trained}  # every token carries the weight version the server reported
    server = int(re.search(r"serve started \(pid (\d+)\)", done.stderr).group(1))
    _wait("the server to exit", lambda: not _alive(server), timeout=30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_stops_every_stage_of_bin_async_rl(tiny_checkpoint, tmp_path):
    root = Path(__file__).resolve().parents[1]
    run_dir = tmp_path / "async"
    script = subprocess.Popen([root / "bin" / "async-rl", "recipes/tiny-async-rl.toml", "recipes/data/count-train.jsonl",
                               "--checkpoint", tiny_checkpoint, "--run-dir", run_dir], cwd=root, stderr=subprocess.PIPE, text=True)
    _wait("the first version", lambda: (run_dir / "policy" / "LATEST").is_file())
    script.send_signal(signal.SIGTERM)
    _, stderr = script.communicate(timeout=240)
    assert script.returncode == 0, stderr
    stages = [int(pid) for pid in re.findall(r"started \(pid (\d+)\)", stderr)]
    assert len(stages) == 3 and all(f"{stage} done" in stderr for stage in ("rollout", "judge", "train-grpo"))
    assert not [pid for pid in stages if _alive(pid)]  # the signal reached the stages themselves
    rolled = Spool(run_dir / "rolled", tokenizer_revision=tokenizer_revision(tiny_checkpoint), create=False)
    assert rolled.depth().claimed == 0  # the judge returned what it held


def test_the_slurm_template_runs_producer_and_trainer_roles(tiny_checkpoint, tmp_path):
    """bin/slurm/async-rl.sbatch as two jobs sharing a run folder (run here with bash, one after the other)."""
    root = Path(__file__).resolve().parents[1]
    template = root / "bin" / "slurm" / "async-rl.sbatch"
    env = {**os.environ, "GLMPOST_PYTHON": sys.executable, "ASYNC_MAX_ROUNDS": "1"}  # each role ends with its input
    args = ["recipes/tiny-async-rl.toml", "recipes/data/count-train.jsonl", str(tiny_checkpoint), str(tmp_path / "run")]
    for role in ("producer", "trainer"):
        done = subprocess.run(["bash", template, role, *args], cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
    # 5 judged shards of 16, --follow-records 32: two versions, and the stream's last shard a third.
    assert CheckpointRoot(tmp_path / "run" / "policy").versions() == [1, 2, 3]
    bad = subprocess.run(["bash", template, "nobody", *args], cwd=root, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "role must be all, producer or trainer" in bad.stderr


def test_max_queued_holds_the_producer_until_the_consumer_catches_up(tiny_checkpoint, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{d}", "prompt": f"count: {d}"}) + "\n" for d in range(4)))
    revision = tokenizer_revision(tiny_checkpoint)
    spool, downstream = Spool(tmp_path / "rolled", tokenizer_revision=revision), Spool(tmp_path / "judged", tokenizer_revision=revision)
    downstream_shard = None
    producing = subprocess.Popen([*GLMPOST, "rollout", str(prompts), "--checkpoint", str(tiny_checkpoint), "--follow", str(spool.path),
                                  "--group-size", "2", "--max-new-tokens", "4", "--prompts-per-shard", "2", "--max-queued", "2",
                                  "--queue", str(downstream.path), "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _wait("two shards", lambda: len(_all_shards(spool)) == 2, timeout=120)
        # A consumer moves one along to the downstream spool: still two waiting, so the producer waits.
        (first,) = spool.claim("judge", limit=1)
        downstream_shard = downstream.publish_path(first.name)
        downstream_shard.write_bytes(first.read_bytes())
        spool.commit("judge", [first], version=-1, ids={})
        time.sleep(3)
        assert len(_all_shards(spool)) == 2
        (waiting,) = downstream.claim("trainer")
        downstream.commit("trainer", [waiting], version=1, ids={})  # the trainer caught up: one more part
        _wait("a third shard", lambda: len(_all_shards(spool)) == 3, timeout=60)
    finally:
        producing.send_signal(signal.SIGTERM)
        out, err = producing.communicate(timeout=120)
    assert producing.returncode == 0, err
    summary = json.loads(out)
    assert summary["stopped_by"] == "SIGTERM" and summary["idle_fraction"] > 0


def test_max_server_lag_holds_the_producer_until_sync_weights_moves_the_server(tiny_checkpoint, tmp_path):
    """A server still sampling v0 while the policy root is at v2: with --max-server-lag 1 the rollout
    samples nothing (it says whom it waits for) until sync-weights moves the server to v2."""
    from serve_process import start_server, stop_server
    from test_eval import _publish_copy

    (tmp_path / "policy").mkdir()
    policy = CheckpointRoot(tmp_path / "policy")
    for version in (1, 2):
        _publish_copy(policy.path, tiny_checkpoint, version)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{d}", "prompt": f"count: {d}"}) + "\n" for d in range(4)))
    spool = Spool(tmp_path / "rolled", tokenizer_revision=tokenizer_revision(tiny_checkpoint))
    server, url = start_server(tiny_checkpoint)  # serves v0
    log = tmp_path / "rollout.log"
    try:
        producing = subprocess.Popen([*GLMPOST, "rollout", str(prompts), "--checkpoint", str(policy.path), "--follow",
                                      str(spool.path), "--engine", "sglang", "--server", url, "--group-size", "2",
                                      "--max-new-tokens", "4", "--prompts-per-shard", "2", "--max-rounds", "1",
                                      "--max-server-lag", "1", "--json"], stdout=subprocess.PIPE, stderr=open(log, "w"),
                                     text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        _wait("the rollout to wait", lambda: "waiting for the servers to sample v1 or newer" in log.read_text())
        time.sleep(2)
        assert not _all_shards(spool) and producing.poll() is None  # held: nothing sampled at v0
        assert f"{url} at v0" in log.read_text()
        synced = subprocess.run([*GLMPOST, "sync-weights", "--checkpoint", str(policy.path), "--out", str(tmp_path / "served"),
                                 "--server", url], capture_output=True, text=True, timeout=300)
        assert synced.returncode == 0, synced.stderr
        out, _ = producing.communicate(timeout=300)
    finally:
        if producing.poll() is None:
            producing.kill()
        stop_server(server)
    assert producing.returncode == 0, log.read_text()
    assert json.loads(out)["idle_fraction"] > 0
    stamps = {int(v) for path in _all_shards(spool) for r in ShardReader(path) for v in r["policy_versions"].tolist()}
    assert len(_all_shards(spool)) == 2 and stamps == {2}
    (metrics_file,) = (spool.path / "producers").glob("*/metrics.jsonl")
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [line["rollout/server_lag"] for line in metrics] == [0, 0]
