"""The spool (glmpost/spool/spool.py, SPEC §12): atomic publication, claims that race across processes,
leases that return a dead consumer's claims, commits by trajectory id, and the refusals."""

from __future__ import annotations

import errno
import multiprocessing
import time

import pytest

from glmpost.formats import ShardReader, ShardWriter, synthetic_record, write_shard
from glmpost.spool.spool import Spool, SpoolError

REVISION = "synthetic-tokenizer"


def _publish(spool: Spool, name: str, ids: list[str]) -> None:
    records = []
    for i, record_id in enumerate(ids):
        record = synthetic_record(i, index=i, prompt_len=4, response_len=6, turns=1, teacher=False)
        record["id"] = record_id
        records.append(record)
    write_shard(spool.publish_path(f"{name}.msgpack.zst"), records, stage="rollout", tokenizer_revision=REVISION)


def test_a_shard_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    spool = Spool(tmp_path / "s", tokenizer_revision=REVISION)
    writer = ShardWriter(spool.publish_path("a.msgpack.zst"), stage="rollout", tokenizer_revision=REVISION)
    writer.write(synthetic_record(0, prompt_len=4, response_len=6, turns=1))
    assert spool.depth().ready == 0 and spool.claim("t") == []  # the hidden temporary file is not a shard
    writer.close()
    assert [p.name for p in spool.claim("t")] == ["a.msgpack.zst"]

    # A full disk while publishing: the writer fails, nothing is visible, no temporary file stays.
    import zstandard

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    writer = ShardWriter(spool.publish_path("b.msgpack.zst"), stage="rollout", tokenizer_revision=REVISION)
    monkeypatch.setattr(zstandard.ZstdCompressionWriter, "write", full)
    with pytest.raises(OSError, match="No space left"):
        with writer:
            writer.write(synthetic_record(0, prompt_len=4, response_len=6, turns=1))
    assert list((spool.path / "ready").iterdir()) == []


def _claim_all(path: str, consumer: str, queue) -> None:
    spool = Spool(path, tokenizer_revision=REVISION, create=False)
    mine = []
    while True:
        got = spool.claim(consumer, limit=1)
        if not got:
            break
        mine += [p.name for p in got]
    queue.put((consumer, mine))


def test_concurrent_claims_take_every_shard_exactly_once(tmp_path):
    spool = Spool(tmp_path / "s", tokenizer_revision=REVISION)
    for i in range(40):
        _publish(spool, f"p-{i:03d}", [f"t{i}"])
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    workers = [context.Process(target=_claim_all, args=(str(spool.path), f"c{n}", queue)) for n in range(4)]
    for w in workers:
        w.start()
    results = [queue.get(timeout=60) for _ in workers]
    for w in workers:
        w.join(timeout=60)
    names = [name for _, mine in results for name in mine]
    assert sorted(names) == sorted(f"p-{i:03d}.msgpack.zst" for i in range(40))  # each once, none lost
    assert spool.depth().claimed == 40 and spool.depth().ready == 0


def test_claims_are_oldest_first_and_an_expired_lease_returns_them(tmp_path):
    spool = Spool(tmp_path / "s", tokenizer_revision=REVISION)
    for name in ("z", "a", "m"):
        _publish(spool, name, [name])
        time.sleep(0.01)
    assert [p.name for p in spool.claim("dead", limit=2, lease_s=0.05)] == ["z.msgpack.zst", "a.msgpack.zst"]
    assert [p.name for p in spool.claim("alive", lease_s=60)] == ["m.msgpack.zst"]
    assert spool.reap() == 0  # both leases still hold
    time.sleep(0.1)
    # "dead" stopped renewing: the next claim of anyone returns its shards to ready/ and may take them.
    assert [p.name for p in spool.claim("alive", lease_s=60)] == ["z.msgpack.zst", "a.msgpack.zst"]
    assert spool.claimed("dead") == [] and len(spool.claimed("alive")) == 3
    assert spool.release("alive") == 3 and spool.depth().ready == 3


def test_commit_ledgers_ids_moves_to_done_and_reconcile_finishes_a_crashed_commit(tmp_path):
    spool = Spool(tmp_path / "s", tokenizer_revision=REVISION)
    _publish(spool, "a", ["t1", "t2"])
    _publish(spool, "b", ["t3"])
    a, b = spool.claim("trainer")
    spool.commit("trainer", [a], version=1, ids={a.name: ["t1", "t2"]})
    spool.commit("trainer", [a], version=1, ids={a.name: ["t1", "t2"]})  # idempotent
    assert spool.consumed_ids() == {"t1", "t2"} and len(spool.ledger()) == 1
    assert spool.depth().done == 1 and [p.name for p in spool.claimed("trainer")] == [b.name]
    # A crash after version 2 was published but before the move: the manifest says what it trained.
    assert spool.reconcile("trainer", {b.name: (2, ["t3"]), "other.msgpack.zst": (2, [])}) == 1
    assert spool.consumed_ids() == {"t1", "t2", "t3"} and spool.depth().done == 2
    assert [r["id"] for r in ShardReader(spool.path / "done" / b.name)] == ["t3"]  # still a valid shard
    with open(spool.ledger_path, "a") as ledger:
        ledger.write('{"shard": "torn", "ids": ["t9"')  # a crash mid-append
    assert spool.consumed_ids() == {"t1", "t2", "t3"}
    # The next commit (here by another process's Spool of the same directory) starts on a line of
    # its own, and a reader that parsed the ledger before sees it too.
    _publish(spool, "c", ["t4"])
    other = Spool(spool.path, tokenizer_revision=REVISION)
    (c,) = other.claim("trainer-2")
    other.commit("trainer-2", [c], version=3, ids={c.name: ["t4"]})
    assert spool.consumed_ids() == other.consumed_ids() == {"t1", "t2", "t3", "t4"}
    assert [e["shard"] for e in spool.ledger()] == [a.name, b.name, c.name]


def test_refusals_name_the_spool(tmp_path):
    spool = Spool(tmp_path / "s", tokenizer_revision=REVISION)
    with pytest.raises(SpoolError, match="tokenizer revision synthetic-tokenizer, this stage's checkpoint has other"):
        Spool(tmp_path / "s", tokenizer_revision="other")
    spool.bind_consumer_root(tmp_path / "root-a")
    spool.bind_consumer_root(tmp_path / "root-a")  # the same run again: fine
    with pytest.raises(SpoolError, match="consumed by the trainers of .*root-a.*needs its own spool"):
        spool.bind_consumer_root(tmp_path / "root-b")
    with pytest.raises(SpoolError, match="not a spool"):
        Spool(tmp_path / "nothing", tokenizer_revision=REVISION, create=False)
    with pytest.raises(ValueError, match="expected NAME.msgpack.zst"):
        spool.publish_path("../x.msgpack.zst")


def test_end_of_stream_when_every_producer_closed_and_nothing_is_left(tmp_path):
    spool = Spool(tmp_path / "s", tokenizer_revision=REVISION)
    assert not spool.closed() and not spool.ended("trainer")  # no producer opened it yet: not an end
    spool.open_producer("rollout-a")
    spool.open_producer("rollout-b")
    _publish(spool, "a0", ["a0-1"])
    spool.close_producer("rollout-a", reason="max_rounds")
    assert not spool.closed()  # rollout-b still produces
    spool.close_producer("rollout-b", reason="SIGTERM")
    assert spool.closed() and not spool.ended("trainer")  # closed, but a shard is still ready
    [claimed] = spool.claim("judge")
    assert spool.ended("judge") and not spool.ended("trainer")  # the judge holds the last one: the trainer waits
    spool.commit("judge", [claimed], version=-1, ids={claimed.name: ["a0-1"]})
    assert spool.ended("trainer")
    spool.open_producer("rollout-a")  # a restart opens its stream again
    assert not spool.closed() and not spool.ended("trainer")
