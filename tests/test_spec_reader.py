"""The reference reader in formats/SPEC.md §11 (msgpack + zstandard + numpy only) reads what glmpost writes."""

from __future__ import annotations

import math
import re
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import zstandard

import glmpost.formats
from glmpost.formats import ShardReader, normalize_record, shards, synthetic_record, write_shard
from test_formats import compacted_record

SPEC = Path(glmpost.formats.__file__).with_name("SPEC.md")
REV = "synthetic-tokenizer"


def spec_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", SPEC.read_text(), flags=re.S)
    assert len(blocks) == 1, "SPEC.md holds exactly one python block, the reference reader"
    return blocks[0]


@pytest.fixture(scope="module")
def spec_read_shard() -> Callable[[Path], tuple[dict, list]]:
    namespace: dict[str, Any] = {}
    exec(compile(spec_block(), str(SPEC), "exec"), namespace)
    imported = {name for name, value in namespace.items() if type(value).__name__ == "module"}
    assert imported <= {"zlib", "msgpack", "np", "zstandard"}
    return namespace["read_shard"]


def test_reference_reader_is_at_most_30_lines() -> None:
    assert len(spec_block().strip("\n").splitlines()) <= 30


def assert_identical(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, where
        assert a.tobytes() == b.tobytes(), where  # bit for bit, NaN payloads included
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert type(a) is type(b) and a == b, where


def records() -> list[dict[str, Any]]:
    out = [synthetic_record(i, index=i, prompt_len=20, response_len=60, topk=4 if i % 2 else 0) for i in range(5)]
    out[1]["reward"] = math.nan
    out[1]["reward_info"] = {"failure": "no answer"}
    out[2]["extra"] = {
        "f16": np.array([np.nan, 1.5], dtype=np.float16),
        "f64": np.array([[math.pi, -0.0]]),
        "u8": np.arange(3, dtype=np.uint8),
        "i16": np.array([-3], dtype=np.int16),
        "u16": np.array([65535], dtype=np.uint16),
        "u32": np.array([2**32 - 1], dtype=np.uint32),
        "i64": np.array([-(2**63)], dtype=np.int64),
        "u64": np.array([2**64 - 1], dtype=np.uint64),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "scalar": np.array(7, dtype=np.int32),
    }
    out[3]["response_token_ids"] = out[3]["response_token_ids"][:0]
    for key in ("action_mask", "observation_mask", "rollout_log_probs", "policy_versions", "teacher_log_probs"):
        out[3][key] = out[3][key][:0]
    out[3]["teacher_topk_ids"] = out[3]["teacher_topk_ids"][:0]
    out[3]["teacher_topk_log_probs"] = out[3]["teacher_topk_log_probs"][:0]
    out[3]["segments"] = []
    out.append(compacted_record(5, windows=3))  # schema version 2: segments carrying `context`, a `role`
    # schema version 3: the MoE experts of each token (uint16 [T, moe_layers, k]; row 0 not recorded)
    routed = np.stack([np.arange(40) % 300, np.arange(40) % 300 + 1], axis=-1)[:, None, :].repeat(3, axis=1)
    routed[0] = 0xFFFF
    out[5]["routed_experts"] = routed.astype(np.uint16)
    return out


@pytest.mark.parametrize("level", [1, 3, 19])
def test_reference_reader_matches_shard_reader(tmp_path: Path, spec_read_shard, level: int) -> None:
    path = write_shard(tmp_path / "a.msgpack.zst", records(), stage="rollout", options={"k": 4}, tokenizer_revision=REV, level=level)
    header, got = spec_read_shard(path)
    reader = ShardReader(path)
    expected = list(reader)
    assert_identical(reader.header, header)
    assert header["schema_version"] == 3
    assert len(got) == len(expected) == 6
    for a, b in zip(expected, got):
        assert_identical(a, b)
    assert got[1]["teacher_topk_log_probs"].shape == (60, 4)
    assert got[5]["segments"][3]["context"].dtype == np.int32 and got[5]["segments"][5]["context"].size
    assert np.isnan(got[0]["rollout_log_probs"]).any()


def test_reference_reader_reads_an_empty_shard(tmp_path: Path, spec_read_shard) -> None:
    path = write_shard(tmp_path / "e.msgpack.zst", [], stage="rollout", tokenizer_revision=REV)
    header, got = spec_read_shard(path)
    assert header["stage"] == "rollout" and got == []


def test_reference_reader_refuses_truncated_and_corrupt_shards(tmp_path: Path, spec_read_shard) -> None:
    path = write_shard(tmp_path / "a.msgpack.zst", records(), stage="rollout", tokenizer_revision=REV)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not one complete zstd frame"):
        spec_read_shard(path)
    # A valid zstd frame whose footer checksum does not match the records.
    packer = shards._packer()
    recs = [normalize_record(r) for r in records()]
    head = packer.pack({"format": "glmpost-trajectories", "schema_version": 2})
    body = b"".join(packer.pack(r) for r in recs)
    foot = packer.pack({"footer": True, "records": len(recs), "checksum": "crc32:%08x" % (zlib.crc32(body) ^ 1)})
    path.write_bytes(zstandard.ZstdCompressor().compress(head + body + foot))
    with pytest.raises(ValueError, match="checksum mismatch"):
        spec_read_shard(path)
    path.write_bytes(zstandard.ZstdCompressor().compress(head + body))
    with pytest.raises(ValueError, match="truncated"):
        spec_read_shard(path)


def test_reference_reader_reads_version_1_and_refuses_version_4(tmp_path: Path, spec_read_shard) -> None:
    packer = shards._packer()
    recs = [normalize_record(r) for r in records()[:5]]  # no context windows: a version-1 shard's records
    body = b"".join(packer.pack(r) for r in recs)
    foot = packer.pack({"footer": True, "records": len(recs), "checksum": "crc32:%08x" % zlib.crc32(body)})

    def shard(version: int) -> Path:
        head = packer.pack({"format": "glmpost-trajectories", "schema_version": version})
        path = tmp_path / f"v{version}.msgpack.zst"
        path.write_bytes(zstandard.ZstdCompressor().compress(head + body + foot))
        return path

    header, got = spec_read_shard(shard(1))
    assert header["schema_version"] == 1 and len(got) == 5
    for a, b in zip(recs, got):
        assert_identical(a, b)
    with pytest.raises(ValueError, match="not a version-1, -2 or -3 glmpost shard"):
        spec_read_shard(shard(4))
