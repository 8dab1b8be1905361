"""The soak tier (issue 47): the asynchronous pipeline of ``bin/async-rl --server URL --engine vllm``
(rollout -> judge -> train-grpo over two spools, sync-weights moving a real vLLM to each new version)
with its writers killed (SIGKILL to the process group, as a crash) and restarted with the same
command at random points of a seeded schedule. Afterwards every trajectory id is trained exactly
once (one version's manifest, one ledger line; none lost, none twice), every version's manifest lists
what it trained, and ``shards verify`` passes on every spool.

Marked ``soak``: ``bin/test`` leaves it out, ``bin/test -m soak`` runs it (tests/README.md). Knobs:
``GLMPOST_SOAK_ROUNDS`` (rounds over the 10 count prompts, 80 trajectories each; default 100),
``GLMPOST_SOAK_KILLS`` (default 6), ``GLMPOST_SOAK_SEED`` (default 0). It prints its figures: kills
survived, records trained, versions, minutes."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import run_glmpost
from test_async_rl import _all_shards
from test_vllm_faults import served  # noqa: F401  (the fixture: a root v000000 and a real vLLM serving it)
from vllm_server import kill_group

from glmpost.checkpoints import CheckpointRoot, read_manifest, tokenizer_revision
from glmpost.formats import ShardReader
from glmpost.formats.schema import UNKNOWN_VERSION
from glmpost.spool.spool import Spool

pytestmark = pytest.mark.soak

ROOT = Path(__file__).resolve().parents[1]
GLMPOST = [sys.executable, "-m", "glmpost.commands.app"]
ROUNDS = int(os.environ.get("GLMPOST_SOAK_ROUNDS", "100"))
KILLS = int(os.environ.get("GLMPOST_SOAK_KILLS", "6"))
SEED = int(os.environ.get("GLMPOST_SOAK_SEED", "0"))
PROMPTS, GROUP, PER_SHARD = 10, 8, 2  # recipes/data/count-train.jsonl, tiny-async-rl.toml's group and parts
STALL_S = 1800  # no progress at all for this long: a hang, not a loaded machine


class Stage:
    """One writer of the pipeline in its own process group, restartable with the same command."""

    def __init__(self, name: str, args: list, logs: Path):
        self.name, self.command, self.log = name, [*GLMPOST, *map(str, args)], logs / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.start()

    def start(self) -> None:
        with open(self.log, "ab") as log:
            log.write(f"--- start {self.starts + 1}\n".encode())
            self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
                                         env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.starts += 1

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL to the whole process group: nothing is flushed, nothing cleaned up."""
        kill_group(self.proc)

    def tail(self) -> str:
        return f"--- {self.log}:\n" + self.log.read_text(errors="replace")[-3000:]


def _sync_loop(policy: Path, served_out: Path, url: str, logs: Path, stop: threading.Event) -> None:
    """bin/async-rl's weight sync: ``sync-weights`` each time the trainer's LATEST moves."""
    synced = None
    while not stop.is_set():
        latest = (policy / "LATEST").read_text().strip() if (policy / "LATEST").is_file() else None
        if latest and latest != synced:
            with open(logs / "sync-weights.log", "ab") as log:
                done = subprocess.run([*GLMPOST, "sync-weights", "--checkpoint", str(policy), "--out", str(served_out),
                                       "--server", url, "--engine", "vllm", "--keep", "2"],
                                      stdout=subprocess.DEVNULL, stderr=log)
            if done.returncode == 0:
                synced = latest
        stop.wait(1)


def test_async_pipeline_with_a_real_vllm_survives_writers_killed_at_random(served, tmp_path):  # noqa: F811
    holder, start_root = served
    server = holder["server"]
    start = CheckpointRoot(start_root).version_dir(CheckpointRoot(start_root).latest())  # what the server serves
    run, logs = tmp_path / "async", tmp_path / "async" / "logs"
    logs.mkdir(parents=True)
    # tiny-async-rl.toml (its rollout waits for the server to sample within one version of LATEST:
    # max-server-lag = 1), the rollout held within 4 waiting shards of the trainer (max-queued): the
    # three stages stay busy together, so a kill at any point of the run meets all of them running. A
    # version every 2 updates: fewer weight syncs (a process start and a conversion each) for the
    # rollout to wait for.
    recipe = tmp_path / "soak.toml"
    recipe.write_text((ROOT / "recipes" / "tiny-async-rl.toml").read_text().replace("[rollout]", "[rollout]\nmax-queued = 4")
                      .replace("publish-every = 1", "publish-every = 2"))
    prompts = ROOT / "recipes" / "data" / "count-train.jsonl"
    revision = tokenizer_revision(start)
    rolled, judged = Spool(run / "rolled", tokenizer_revision=revision), Spool(run / "judged", tokenizer_revision=revision)
    policy = run / "policy"
    # bin/async-rl's three commands (with --server URL --engine vllm), and its weight sync.
    commands = {
        "rollout": ["rollout", prompts, "--config", recipe, "--checkpoint", start, "--follow", rolled.path,
                    "--reload-root", policy, "--queue", judged.path, "--engine", "vllm", "--server", server.url,
                    "--max-rounds", ROUNDS],
        "judge": ["judge", "--config", recipe, "--checkpoint", start, "--follow", rolled.path, "--out", judged.path,
                  "--idle-timeout", STALL_S],
        "train-grpo": ["train-grpo", "--config", recipe, "--checkpoint", start, "--follow", judged.path, "--out", policy,
                       "--idle-timeout", STALL_S],
    }
    expected_shards = ROUNDS * PROMPTS // PER_SHARD
    rng = random.Random(SEED)
    # The schedule: a kill once the trainer has committed a random number of judged shards (distinct
    # points within the first 85% of the run), a random 0-8 s later, of a writer drawn in rounds of
    # all three in random order (each is killed once at least, from 3 kills on).
    points = sorted(rng.sample(range(1, int(expected_shards * 0.85)), KILLS))
    victims: list[str] = []
    while len(victims) < KILLS:
        victims += rng.sample(sorted(commands), len(commands))
    schedule = [(point, rng.uniform(0, 8), victim) for point, victim in zip(points, victims)]

    began = time.monotonic()
    stages = {name: Stage(name, args, logs) for name, args in commands.items()}
    stop_sync = threading.Event()
    sync = threading.Thread(target=_sync_loop, args=(policy, run / "served", server.url, logs, stop_sync), daemon=True)
    sync.start()
    kills: list[dict] = []
    try:
        def progress() -> int:
            return len(judged.ledger())

        def wait_for(point: int) -> None:
            seen, last_move = progress(), time.monotonic()
            while (now := progress()) < point:
                if now != seen:
                    seen, last_move = now, time.monotonic()
                if not any(s.alive() for s in stages.values()):
                    return
                failed = [s for s in stages.values() if not s.alive() and s.proc.returncode != 0]
                assert not failed, "".join(s.tail() for s in failed)
                assert time.monotonic() - last_move < STALL_S, "no progress: " + "".join(s.tail() for s in stages.values())
                time.sleep(0.5)

        for point, delay, victim in schedule:
            wait_for(point)
            time.sleep(delay)
            if not stages[victim].alive():  # it finished its part: another writer still running
                running = [name for name in sorted(stages) if stages[name].alive()]
                if not running:
                    break
                victim = rng.choice(running)
            stage = stages[victim]
            stage.kill()
            kills.append({"stage": victim, "committed_shards": progress(), "rolled_shards": len(_all_shards(rolled)),
                          "versions": len(CheckpointRoot(policy).versions()) if policy.is_dir() else 0,
                          "minute": round((time.monotonic() - began) / 60, 2)})
            print(f"soak: kill -9 {victim} at {kills[-1]}", flush=True)
            stage.start()  # the same command: it continues where the killed one stopped
        for stage in stages.values():  # each ends with its input (end of stream), exit 0
            deadline = time.monotonic() + 3 * STALL_S
            while stage.alive() and time.monotonic() < deadline:
                time.sleep(1)
            assert not stage.alive(), f"{stage.name} did not end: " + stage.tail()
            assert stage.proc.returncode == 0, stage.tail()
    finally:
        stop_sync.set()
        for stage in stages.values():
            if stage.alive():
                stage.kill()
        sync.join(timeout=600)
    minutes = (time.monotonic() - began) / 60

    # Nothing lost, nothing twice: every rolled shard judged, every judged shard committed once, the
    # ids published once each.
    produced = sorted(p.name for p in _all_shards(rolled))
    assert len(produced) == expected_shards, produced
    assert rolled.depth().ready == rolled.depth().claimed == 0
    assert sorted(p.name for p in _all_shards(judged)) == produced
    assert judged.depth().ready == judged.depth().claimed == 0
    published = [r["id"] for p in judged.done_dir.glob("*.msgpack.zst") for r in ShardReader(p)]
    assert len(published) == len(set(published)) == ROUNDS * PROMPTS * GROUP
    ledger = judged.ledger()
    assert sorted(e["shard"] for e in ledger) == produced  # each shard committed exactly once

    # Every version's manifest is its commit record: the shards and ids it trained, the same as the
    # ledger's lines for that version; across versions each id once.
    checkpoints = CheckpointRoot(policy)
    versions = checkpoints.versions()
    assert versions == list(range(1, len(versions) + 1)), versions
    by_version = {v: read_manifest(checkpoints.version_dir(v)).extra for v in versions}
    trained = Counter()
    for version, extra in by_version.items():
        commit = extra["spool"]
        assert Path(commit["path"]).resolve() == judged.path.resolve() and commit["shards"], (version, extra)
        assert {e["shard"]: e["ids"] for e in ledger if e["version"] == version} == commit["shards"], version
        for shard, ids in commit["shards"].items():
            assert sorted(ids) == sorted(r["id"] for r in ShardReader(judged.done_dir / shard)), (version, shard)
            trained.update(ids)
        assert 0 < extra["trained_records"] <= sum(map(len, commit["shards"].values())), (version, extra)
    duplicates = [i for i, n in trained.items() if n > 1]
    assert not duplicates, f"trained more than once: {duplicates[:10]}"
    # The rollout waits for the server to sample within one version of LATEST (max-server-lag = 1 in
    # tiny-async-rl.toml), the queue holds a version's worth: no record is ever too stale to train.
    dropped = [i for e in ledger if e["version"] < 0 for i in e["ids"]]
    assert not dropped, f"{len(dropped)} records dropped (stale): {dropped[:10]}"
    assert set(trained) == set(published)  # every id trained, exactly once

    # Every shard in every spool reads back whole.
    for spool in (rolled, judged):
        verified = run_glmpost("shards", "verify", f"{spool.path}/**/*.msgpack.zst", "--json")
        assert verified.exit_code == 0, verified.stderr
        assert json.loads(verified.stdout)["shards"] == expected_shards

    # The weight sync moved the real vLLM to trained versions, and the tokens carry them.
    synced = [json.loads(line) for line in (run / "served" / "metrics.jsonl").read_text().splitlines()]
    assert {line.get("sync/policy_version") for line in synced} & set(versions)
    # A rollout that switched to a version the server was not synced to yet (sync-weights lags the
    # trainer) stamps its tokens -1, unknown (formats/SPEC.md), never a version nobody confirmed.
    first = read_manifest(start).policy_version
    stamps = Counter(int(v) for p in _all_shards(rolled) for r in ShardReader(p) for v in set(r["policy_versions"].tolist()))
    assert set(stamps) <= {UNKNOWN_VERSION, first, *versions} and set(stamps) & set(versions), stamps

    assert len(kills) == KILLS, kills
    figures = {"kills_survived": len(kills), "by_stage": dict(Counter(k["stage"] for k in kills)),
               "records_published": len(published), "records_trained": len(trained), "records_dropped": len(dropped),
               "versions": len(versions),
               "records_of_unknown_version": stamps[UNKNOWN_VERSION], "minutes": round(minutes, 1), "rounds": ROUNDS, "seed": SEED}
    print(f"soak: {json.dumps(figures)}", flush=True)
