"""`glmpost shards inspect|verify|cat|head`: output, exit codes (0 ok, 1 bad shard, 2 usage), one-line errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from glmpost.commands.app import main
from glmpost.formats import read_shard, record_from_json, synthetic_record, write_shard
from test_formats import compacted_record

REV = "synthetic-tokenizer"
GLMPOST = Path(sys.executable).with_name("glmpost")


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return exc.value.code or 0, out, err


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """3 shards of 4 records; rewards on even records (one failed), top-k on some."""
    directory = tmp_path / "ds"
    directory.mkdir()
    for s in range(3):
        records = []
        for i in range(4 * s, 4 * s + 4):
            record = synthetic_record(i, index=i, prompt_len=10, response_len=30, judged=i % 2 == 0, topk=2 if i % 3 == 0 else 0)
            if i == 4:
                record["reward"], record["reward_info"] = math.nan, {"failure": "timeout"}
            records.append(record)
        write_shard(directory / f"shard-{s}.msgpack.zst", records, stage="rollout", tokenizer_revision=REV)
    return directory


def all_records(directory: Path) -> list[dict[str, Any]]:
    return [r for p in sorted(directory.glob("*.msgpack.zst")) for r in read_shard(p).records]


def corrupt_copy(dataset: Path, tmp_path: Path) -> Path:
    """A dataset whose second shard has lost its last bytes."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in sorted(dataset.iterdir()):
        (bad / p.name).write_bytes(p.read_bytes())
    victim = bad / "shard-1.msgpack.zst"
    victim.write_bytes(victim.read_bytes()[:-40])
    return bad


def test_inspect_json(capsys, dataset: Path) -> None:
    code, out, err = run(capsys, "shards", "inspect", str(dataset), "--json")
    assert code == 0
    (stats,) = json.loads(out)["datasets"]
    records = all_records(dataset)
    assert stats["input"] == str(dataset)
    assert stats["shards"] == 3 and stats["records"] == 12
    assert stats["fields"]["id"] == 12 and stats["fields"]["reward"] == 6 and stats["fields"]["teacher_topk_ids"] == 4
    assert stats["tokens"] == {
        "prompt": 120,
        "response": 360,
        "action": sum(int(r["action_mask"].sum()) for r in records),
        "observation": sum(int(r["observation_mask"].sum()) for r in records),
    }
    assert sum(stats["status"].values()) == 12
    rewards = np.array([r["reward"] for r in records if "reward" in r and not math.isnan(r["reward"])])
    assert stats["reward"]["n"] == 6 and stats["reward"]["failed"] == 1
    assert stats["reward"]["mean"] == pytest.approx(rewards.mean())
    assert stats["reward"]["std"] == pytest.approx(rewards.std())
    assert (stats["reward"]["min"], stats["reward"]["max"]) == (rewards.min(), rewards.max())
    versions = np.concatenate([r["policy_versions"][r["action_mask"]] for r in records])
    assert stats["policy_versions"] == {"min": int(versions.min()), "max": int(versions.max())}
    assert stats["tokenizer_revisions"] == [REV]
    assert stats["stages"] == {"rollout": 3}
    assert stats["compaction"] == {"compacted": 0, "compactions": 0, "per_trajectory": {"0": 12}, "summary_tokens": 0, "peak_context": None}


def test_inspect_human_one_block_per_dataset(capsys, dataset: Path) -> None:
    code, out, _ = run(capsys, "shards", "inspect", str(dataset), str(dataset / "shard-0.msgpack.zst"))
    assert code == 0
    assert f"{dataset}: 3 shards, 12 records" in out
    assert f"{dataset / 'shard-0.msgpack.zst'}: 1 shards, 4 records" in out
    assert "tokens:      prompt 120, response 360" in out
    assert "partly: rewards 6/12" in out
    assert "compaction" not in out  # no record was compacted: the output is as before schema version 2


@pytest.fixture
def compacted(tmp_path: Path) -> Path:
    """One shard: a record of 2 windows, one of 3 (one summary each), two without compaction."""
    path = tmp_path / "compacted.msgpack.zst"
    records = [compacted_record(0), synthetic_record(1, index=1, response_len=30), compacted_record(2, windows=3)]
    records.append(synthetic_record(3, index=3, response_len=30))
    write_shard(path, records, stage="rollout", tokenizer_revision=REV)
    return path


def test_inspect_shows_compaction(capsys, compacted: Path) -> None:
    code, out, _ = run(capsys, "shards", "inspect", "--json", str(compacted))
    assert code == 0
    (stats,) = json.loads(out)["datasets"]
    assert stats["compaction"] == {
        "compacted": 2,
        "compactions": 3,
        "per_trajectory": {"0": 2, "1": 1, "2": 1},
        "summary_tokens": 12,
        "peak_context": {"n": 2, "mean": 55.0, "max": 60},
    }
    code, out, _ = run(capsys, "shards", "inspect", str(compacted))
    assert code == 0
    assert (
        "  compaction:  2/4 records compacted, 3 compactions; compactions per trajectory {0: 2, 1: 1, 2: 1}; "
        "summary tokens 12; peak context mean 55, max 60\n"
    ) in out


def test_verify_ok(capsys, dataset: Path) -> None:
    code, out, _ = run(capsys, "shards", "verify", str(dataset))
    assert (code, out) == (0, "ok: 3 shards, 12 records\n")
    code, out, _ = run(capsys, "shards", "verify", "--json", str(dataset / "*.msgpack.zst"))
    assert json.loads(out) == {"ok": True, "shards": 3, "records": 12}


def test_verify_names_the_first_bad_file(capsys, dataset: Path, tmp_path: Path) -> None:
    bad = corrupt_copy(dataset, tmp_path)
    code, out, err = run(capsys, "shards", "verify", str(bad))
    assert code == 1 and out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"glmpost: error: {bad / 'shard-1.msgpack.zst'}: ")
    assert "truncated shard" in err


def test_verify_names_the_bad_record(capsys, dataset: Path, tmp_path: Path) -> None:
    import zlib

    import zstandard

    from glmpost.formats import normalize_record, shards

    record = normalize_record(synthetic_record(0, response_len=8))
    record["action_mask"] = record["action_mask"].astype(np.int8)
    packer = shards._packer()
    header = read_shard(dataset / "shard-0.msgpack.zst").header
    body = packer.pack(record)
    footer = {"footer": True, "records": 1, "checksum": f"crc32:{zlib.crc32(body):08x}"}
    path = tmp_path / "dtype.msgpack.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(packer.pack(header) + body + packer.pack(footer)))
    code, _, err = run(capsys, "shards", "verify", str(dataset), str(path))
    assert code == 1
    assert f"{path}: record 0 (id 'traj-00000000'): field 'action_mask': dtype int8, expected bool" in err


def test_cat_prints_every_record_as_json(capsys, dataset: Path) -> None:
    code, out, _ = run(capsys, "shards", "cat", str(dataset))
    assert code == 0
    lines = out.splitlines()
    records = all_records(dataset)
    assert len(lines) == 12
    for line, record in zip(lines, records):
        back = record_from_json(json.loads(line))
        assert list(back) == list(record)
        for key, value in record.items():
            if isinstance(value, np.ndarray):
                assert back[key].dtype == value.dtype and np.array_equal(back[key], value, equal_nan=True)
    assert "NaN" not in out


def test_cat_fields(capsys, dataset: Path) -> None:
    code, out, _ = run(capsys, "shards", "cat", "--fields", "id,reward", str(dataset / "shard-1.msgpack.zst"))
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[0] == {"id": "traj-00000004", "reward": None}  # the failed judgement
    assert lines[1] == {"id": "traj-00000005"}  # not judged: the field is absent
    assert set(lines[2]) == {"id", "reward"}


def test_head(capsys, dataset: Path) -> None:
    code, out, _ = run(capsys, "shards", "head", str(dataset))
    assert code == 0 and len(out.splitlines()) == 5
    code, out, _ = run(capsys, "shards", "head", "-n", "2", "--fields", "id", str(dataset))
    assert [json.loads(line) for line in out.splitlines()] == [{"id": "traj-00000000"}, {"id": "traj-00000001"}]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["shards", "cat", "{tmp}/nothing-here"], "nothing-here: no such file or directory"),
        (["shards", "verify", "{tmp}/*.nope"], "no shards match this pattern"),
        (["shards", "cat", "--fields", "id,bogus", "{ds}"], "unknown field(s) bogus"),
        (["shards", "head", "-n", "-1", "{ds}"], "--records"),
        (["shards", "inspect"], "Missing argument"),
    ],
)
def test_usage_errors_exit_2(capsys, dataset: Path, tmp_path: Path, argv: list[str], fragment: str) -> None:
    argv = [a.format(tmp=tmp_path, ds=dataset) for a in argv]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert fragment in err


@pytest.mark.parametrize("command", ["inspect", "verify", "cat", "head"])
def test_help(capsys, command: str) -> None:
    code, out, _ = run(capsys, "shards", command, "--help")
    assert code == 0
    assert "PATH" in out and "globs" in out


def test_console_script_exit_codes_and_no_traceback(dataset: Path, tmp_path: Path) -> None:
    bad = corrupt_copy(dataset, tmp_path)
    script = (
        f"'{GLMPOST}' shards verify '{bad}'; echo rc=$?; "
        f"'{GLMPOST}' shards cat '{dataset}' | head -n 1 >/dev/null; echo rc=${{PIPESTATUS[0]}}"
    )
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout.split() == ["rc=1", "rc=0"]
    assert f"glmpost: error: {bad / 'shard-1.msgpack.zst'}: truncated shard" in result.stderr
