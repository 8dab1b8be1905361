"""Record schema v2 and shard files: round trips, validation rules, every refusal of the reader, version-1 shards."""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zstandard

from glmpost.errors import GlmpostError, UsageError
from glmpost.formats import (
    DTYPE_CODES,
    FIELDS,
    SCHEMA_VERSION,
    RecordError,
    ShardError,
    ShardReader,
    ShardWriter,
    compactions,
    context_windows,
    iter_records,
    normalize_record,
    read_shard,
    record_from_json,
    record_to_json,
    require_fields,
    resolve_shard_paths,
    schema,
    select_shards,
    shards,
    synthetic_record,
    validate_record,
    window_inputs,
    write_shard,
)

REV = "synthetic-tokenizer"


def make(i: int = 0, **kw: Any) -> dict[str, Any]:
    kw.setdefault("prompt_len", 12)
    kw.setdefault("response_len", 40)
    return synthetic_record(i, index=i, **kw)


def full_record(i: int = 0) -> dict[str, Any]:
    """Every schema field, NaNs, a 2-D top-k payload and arrays of several dtypes under extra."""
    record = make(i, topk=3)
    record["reward"] = math.nan
    record["rewards"] = {"correct": math.nan, "format": 1.0}
    record["reward_info"] = {"failure": "verifier timed out", "elapsed_s": 3.5}
    record["extra"] = {
        "note": "free-form",
        "nested": {"list": [1, 2.5, None, True, "x"], "nan": math.nan, "inf": -math.inf, "blob": b"\x00\xff"},
        "f16": np.array([[0.5, np.nan], [1.0, -2.0]], dtype=np.float16),
        "u64": np.array([2**64 - 1, 0], dtype=np.uint64),
        "i8": np.array([-128, 127], dtype=np.int8),
        "mask": np.array([True, False]),
        "scalar": np.array(3.25),
    }
    record["segments"][0]["context_token_ids"] = np.arange(5, dtype=np.int32)
    # Schema version 3: the MoE experts per token and layer (uint8; the last row not recorded).
    routed = np.arange(len(record["response_token_ids"]) * 2 * 2, dtype=np.int64).reshape(-1, 2, 2) % 250
    routed[:, :, 1] = (routed[:, :, 0] + 1) % 250
    routed[-1] = 255
    record["routed_experts"] = routed.astype(np.uint8)
    return record


# A compacted record (schema version 2): turn 0's action, the observation that asks for a summary,
# the summary, then window 1 (its rebuilt context on the segment that opens it) and, with
# windows=3, window 2 opening at turn 3's action. (start, end, kind, turn)
COMPACTED_LAYOUT = [(0, 8, "action", 0), (8, 14, "observation", 0), (14, 20, "summary", 1),
                    (20, 28, "action", 2), (28, 34, "observation", 2), (34, 40, "action", 3)]
RESUME_IDS = np.array([151_000, 151_001], dtype=np.int32)


def compacted_record(i: int = 0, *, windows: int = 2) -> dict[str, Any]:
    """A valid record of ``windows`` context windows (2 or 3), T=40: each later window's context is
    the prompt, a resume turn wrapping the summary and the last action-observation pair."""
    record = make(i, response_len=40)
    prompt, response = record["prompt_token_ids"], record["response_token_ids"]
    segments = [{"start": a, "end": b, "kind": kind, "turn": turn} for a, b, kind, turn in COMPACTED_LAYOUT]
    segments[1]["role"] = "summary_request"
    for at, (a, b) in [(3, (0, 14)), (5, (20, 34))][: windows - 1]:  # the window's last action-observation pair
        tail = response[a:b]
        segments[at]["context"] = np.concatenate([prompt, RESUME_IDS, response[14:20], tail]).astype(np.int32)
    action = np.zeros(40, dtype=bool)
    for seg in segments:
        action[seg["start"] : seg["end"]] = seg["kind"] in ("action", "summary")
    record.update(
        segments=segments,
        action_mask=action,
        observation_mask=~action,
        rollout_log_probs=np.where(action, -0.25, np.nan).astype(np.float32),
        policy_versions=np.where(action, 7, -1).astype(np.int32),
        teacher_log_probs=np.where(action, -0.5, np.nan).astype(np.float32),
    )
    record["extra"] = {
        "compaction": {
            "mode": "summary", "budget": 64, "threshold": 48, "keep_last": 1, "windows": windows,
            "summaries": [{"turn": 1, "window": 0, "tokens": 6, "truncated": False}],
            "kept_pairs": [1] * (windows - 1), "peak_context": 30 + 10 * windows,
        }
    }
    return record


def assert_same(a: Any, b: Any, where: str = "record") -> None:
    """Exact equality: same keys, same array dtypes/shapes/values (NaN == NaN), same Python types."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), where
        assert a.dtype.newbyteorder("=") == b.dtype.newbyteorder("="), where
        assert a.shape == b.shape, where
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert type(a) is type(b) and a == b, where


def one_line_naming(exc: pytest.ExceptionInfo, path: Path, *fragments: str) -> str:
    message = str(exc.value)
    assert "\n" not in message
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return message


# ---------------------------------------------------------------------------------------------
# Low-level helpers: shards with arbitrary objects, bypassing the writer's validation.


def header(**over: Any) -> dict[str, Any]:
    base = {
        "format": "glmpost-trajectories",
        "schema_version": 2,
        "stage": "test",
        "options": {},
        "tokenizer_revision": REV,
        "created": "2025-01-01T00:00:00+00:00",
        "glmpost_version": "0.1.0",
    }
    return {**base, **over}


def footer(records: list[Any], over: dict[str, Any] | None = None) -> dict[str, Any]:
    packer = shards._packer()
    crc = zlib.crc32(b"".join(packer.pack(r) for r in records))
    return {"footer": True, "records": len(records), "checksum": f"crc32:{crc:08x}", **(over or {})}


def write_raw(path: Path, objects: list[Any], *, trailing: bytes = b"") -> Path:
    packer = shards._packer()
    payload = b"".join(packer.pack(o) for o in objects)
    path.write_bytes(zstandard.ZstdCompressor(level=1).compress(payload) + trailing)
    return path


def raw_shard(path: Path, records: list[Any], footer_over: dict[str, Any] | None = None) -> Path:
    return write_raw(path, [header(), *records, footer(records, footer_over)])


# ---------------------------------------------------------------------------------------------
# Round trips


def test_round_trip_every_field(tmp_path: Path) -> None:
    records = [full_record(0), make(1), make(2, topk=2, judged=False, teacher=False)]
    path = write_shard(tmp_path / "a.msgpack.zst", records, stage="rollout", options={"n": 3, "t": [1.0]}, tokenizer_revision=REV)
    shard = read_shard(path)
    assert shard.header["format"] == "glmpost-trajectories"
    assert shard.header["schema_version"] == SCHEMA_VERSION == 3
    assert shard.header["stage"] == "rollout"
    assert shard.header["options"] == {"n": 3, "t": [1.0]}
    assert shard.header["tokenizer_revision"] == REV
    assert set(shard.header) == {"format", "schema_version", "stage", "options", "tokenizer_revision", "created", "glmpost_version"}
    assert len(shard.records) == 3
    for written, read in zip(records, shard.records):
        assert_same(written, read)
    assert shard.records[0]["teacher_topk_log_probs"].shape == (40, 3)
    assert np.isnan(shard.records[0]["rollout_log_probs"]).any()
    assert shard.records[0]["response_token_ids"].flags.writeable


def test_every_schema_field_is_exercised() -> None:
    assert set(full_record()) == set(FIELDS)


def test_empty_response_and_empty_shard(tmp_path: Path) -> None:
    record = make(0, response_len=0, topk=2)
    path = write_shard(tmp_path / "a.msgpack.zst", [record], stage="rollout", tokenizer_revision=REV)
    assert_same(record, read_shard(path).records[0])
    empty = write_shard(tmp_path / "e.msgpack.zst", [], stage="rollout", tokenizer_revision=REV)
    reader = ShardReader(empty)
    assert list(reader) == []
    assert reader.footer == {"footer": True, "records": 0, "checksum": "crc32:00000000"}


def test_writer_normalises_lists_and_widths(tmp_path: Path) -> None:
    record = make(0, response_len=3, turns=1, teacher=False)
    record.update(
        prompt_token_ids=[1, 2, 3],
        response_token_ids=np.array([4, 5, 6], dtype=np.int64),
        action_mask=[1, 1, 0],
        observation_mask=[False, False, True],
        rollout_log_probs=[-0.5, -1.25, math.nan],
        policy_versions=(3, 3, -1),
        reward=np.float64(1),
        rewards={"correct": 1},
        segments=[{"start": np.int64(0), "end": 2, "kind": "action", "turn": 0}],
    )
    path = write_shard(tmp_path / "a.msgpack.zst", [record], stage="rollout", tokenizer_revision=REV)
    got = read_shard(path).records[0]
    assert got["prompt_token_ids"].dtype == np.int32 and got["prompt_token_ids"].tolist() == [1, 2, 3]
    assert got["response_token_ids"].dtype == np.int32
    assert got["action_mask"].tolist() == [True, True, False]
    assert got["rollout_log_probs"].dtype == np.float32
    assert got["policy_versions"].dtype == np.int32
    assert got["reward"] == 1.0 and type(got["reward"]) is float
    assert got["rewards"] == {"correct": 1.0}
    assert got["segments"][0]["start"] == 0 and type(got["segments"][0]["start"]) is int


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("response_token_ids", np.array([2**40] * 40), "outside the int32 range"),
        ("response_token_ids", np.zeros(40, dtype=np.float32), "dtype float32 cannot be converted to int32"),
        ("action_mask", np.full(40, 2), "cannot be converted to bool"),
        ("rollout_log_probs", ["a"] * 40, "cannot be converted to float32"),
        ("reward", True, "must be a number"),
        ("task", {1: "x"}, "map key 1 is not a string"),
        ("sampling", {"engine": object()}, "cannot be stored"),
    ],
)
def test_normalize_refuses_lossy_conversions(field: str, value: Any, fragment: str) -> None:
    record = make()
    record[field] = value
    with pytest.raises(RecordError, match=fragment):
        normalize_record(record)


# ---------------------------------------------------------------------------------------------
# Validation rules


def _set(field: str, value: Any):
    def mutate(r: dict[str, Any]) -> None:
        r[field] = value(r) if callable(value) else value

    return mutate


def _delete(field: str):
    return lambda r: r.pop(field)


def _both_masks(r: dict[str, Any]) -> None:
    r["observation_mask"] = r["observation_mask"].copy()
    r["observation_mask"][np.flatnonzero(r["action_mask"])[0]] = True


def _nan_on_action(r: dict[str, Any]) -> None:
    r["rollout_log_probs"][np.flatnonzero(r["action_mask"])[0]] = np.nan


def _positive_log_prob(r: dict[str, Any]) -> None:
    r["teacher_log_probs"][np.flatnonzero(r["action_mask"])[1]] = 0.5


def _inf_off_action(r: dict[str, Any]) -> None:
    r["rollout_log_probs"][np.flatnonzero(~r["action_mask"])[0]] = -np.inf


VIOLATIONS = {
    "missing required": (_delete("status"), "missing required field 'status'"),
    "unknown key": (_set("rewrads", {}), "unknown field 'rewrads' (did you mean 'rewards'?)"),
    "wrong dtype": (_set("response_token_ids", lambda r: r["response_token_ids"].astype(np.int64)), "dtype int64, expected int32"),
    "list not array": (_set("action_mask", lambda r: r["action_mask"].tolist()), "field 'action_mask': expected a bool array"),
    "wrong ndim": (_set("teacher_log_probs", lambda r: r["teacher_log_probs"][:, None]), "2-D, expected shape [T]"),
    "wrong length": (_set("observation_mask", lambda r: r["observation_mask"][:-1]), "field 'observation_mask': length 39, expected T=40"),
    "top-k width": (_set("teacher_topk_log_probs", lambda r: r["teacher_topk_log_probs"][:, :2].copy()), "top-k width 2, expected k=3"),
    "top-k alone": (_delete("teacher_topk_ids"), "must be present together"),
    "negative id": (_set("prompt_token_ids", lambda r: r["prompt_token_ids"] * 0 - 1), "negative token id -1"),
    "both masks": (_both_masks, "both set on token"),
    "NaN on action": (_nan_on_action, "field 'rollout_log_probs': NaN on action token"),
    "positive log-prob": (_positive_log_prob, "field 'teacher_log_probs': token"),
    "-inf log-prob": (_inf_off_action, "not a log-prob"),
    "top-k positive": (_set("teacher_topk_log_probs", lambda r: np.abs(r["teacher_topk_log_probs"]) + 1), "teacher_topk_log_probs"),
    "segment range": (_set("segments", [{"start": 0, "end": 41, "kind": "action", "turn": 0}]), "not within [0, T=40]"),
    "segment overlap": (
        _set("segments", [{"start": 0, "end": 10, "kind": "action", "turn": 0}, {"start": 9, "end": 12, "kind": "observation", "turn": 0}]),
        "segments[1]: starts at 9, before the previous segment ends (10)",
    ),
    "segment kind": (_set("segments", [{"start": 0, "end": 1, "kind": "tool", "turn": 0}]), "kind 'tool'"),
    "segment key": (_set("segments", [{"start": 0, "end": 1, "kind": "action"}]), "segments[0]: missing 'turn'"),
    "status": (_set("status", "done"), "status 'done' is not one of"),
    "reward inf": (_set("reward", math.inf), "field 'reward': infinite"),
    "reward NaN without reason": (_set("reward", math.nan), "NaN without reward_info['failure']"),
    "rewards type": (_set("rewards", {"a": 1}), "is not str -> float"),
    "empty id": (_set("id", ""), "field 'id': must not be empty"),
    "str type": (_set("domain", 3), "field 'domain': expected str, got int"),
}


def assert_refused(record: dict[str, Any], mutate, fragment: str) -> None:
    """``record`` validates; after ``mutate`` it is refused in one line holding ``fragment``."""
    validate_record(record)
    mutate(record)
    with pytest.raises(RecordError) as exc:
        validate_record(record)
    assert fragment in str(exc.value)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("name", list(VIOLATIONS))
def test_validate_refuses(name: str) -> None:
    mutate, fragment = VIOLATIONS[name]
    assert_refused(make(topk=3), mutate, fragment)


def test_validate_allows_nan_reward_with_reason_and_neither_mask() -> None:
    record = make()
    record["reward"] = math.nan
    record["reward_info"] = {"failure": "timeout"}
    record["action_mask"][:3] = False
    record["observation_mask"][:3] = False
    validate_record(record)


def test_require_fields_names_the_producing_stage() -> None:
    record = make(judged=False, teacher=False)
    require_fields(record, ["response_token_ids", "rollout_log_probs"], where="train-grpo")
    with pytest.raises(RecordError) as exc:
        require_fields(record, ["rewards"], where="train-grpo: in.msgpack.zst")
    assert str(exc.value) == "train-grpo: in.msgpack.zst: record 'traj-00000000' has no rewards: run `glmpost judge` first"
    with pytest.raises(RecordError, match="has no teacher_log_probs: run `glmpost score-teacher` first"):
        require_fields(record, ["teacher_log_probs"], where="opd")
    del record["domain"]
    with pytest.raises(RecordError, match="has no domain: it comes from the prompt data"):
        require_fields(record, ["domain"], where="opd")


# ---------------------------------------------------------------------------------------------
# Context windows (schema version 2, CompactionRL)


def test_compacted_record_round_trips_bitwise(tmp_path: Path) -> None:
    record = compacted_record()
    validate_record(record)
    path = write_shard(tmp_path / "c.msgpack.zst", [record, make(1)], stage="rollout", tokenizer_revision=REV)
    shard = read_shard(path)
    assert shard.header["schema_version"] == 3
    got = shard.records[0]
    assert_same(record, got)
    context = got["segments"][3]["context"]
    assert context.dtype == np.int32 and context.tobytes() == record["segments"][3]["context"].tobytes()
    assert got["segments"][1]["role"] == "summary_request"
    windows = context_windows(got)
    assert [(w.index, w.start, w.end) for w in windows] == [(0, 0, 20), (1, 20, 40)]
    assert windows[0].context.tobytes() == record["prompt_token_ids"].tobytes()
    assert compactions(got) == 1 and compactions(shard.records[1]) == 0
    ids, prompt_len = window_inputs(got, windows[1])
    assert prompt_len == len(context) == 12 + 2 + 6 + 14
    assert ids == context.tolist() + record["response_token_ids"][20:40].tolist()


def test_three_windows_validate() -> None:
    record = compacted_record(windows=3)
    validate_record(record)
    assert [w.start for w in context_windows(record)] == [0, 20, 34]


def test_writer_converts_a_context_to_int32(tmp_path: Path) -> None:
    record = compacted_record()
    context = record["segments"][3]["context"]
    record["segments"][3]["context"] = context.tolist()
    second = compacted_record(1, windows=3)
    second["segments"][5]["context"] = second["segments"][5]["context"].astype(np.int64)
    path = write_shard(tmp_path / "c.msgpack.zst", [record, second], stage="rollout", tokenizer_revision=REV)
    first, third = read_shard(path).records
    assert first["segments"][3]["context"].dtype == np.int32 and first["segments"][3]["context"].tolist() == context.tolist()
    assert third["segments"][5]["context"].dtype == np.int32
    bad = compacted_record()
    bad["segments"][3]["context"] = np.array([2**40], dtype=np.int64)
    with pytest.raises(RecordError, match=r"segments\[3\]\.context': values outside the int32 range"):
        normalize_record(bad)


def _segment(index: int, key: str, value: Any):
    def mutate(r: dict[str, Any]) -> None:
        r["segments"][index][key] = value(r) if callable(value) else value

    return mutate


def _summary_over_observation(r: dict[str, Any]) -> None:
    r["action_mask"][16] = False
    r["rollout_log_probs"][16] = np.nan
    r["teacher_log_probs"][16] = np.nan


CONTEXT_VIOLATIONS = {
    "context on segment 0": (
        _segment(0, "context", np.arange(3, dtype=np.int32)),
        "segments[0].context: the first segment cannot open a window (window 0's context is prompt_token_ids)",
    ),
    "context int64": (_segment(3, "context", lambda r: r["segments"][3]["context"].astype(np.int64)), "segments[3].context: dtype int64, expected int32"),
    "context list": (_segment(3, "context", [1, 2]), "segments[3].context: expected a int32 array, got list"),
    "context 2-D": (_segment(3, "context", np.ones((2, 2), dtype=np.int32)), "segments[3].context: 2-D, expected shape [C]"),
    "context empty": (_segment(3, "context", np.zeros(0, dtype=np.int32)), "segments[3].context: empty"),
    "context negative id": (_segment(3, "context", np.array([5, -2, 7], dtype=np.int32)), "segments[3].context: negative token id -2"),
    "role not str": (_segment(1, "role", 1), "segments[1].role: expected str, got int"),
    "summary not action": (_summary_over_observation, "segments[2]: kind 'summary' but token 16 has action_mask 0"),
}


@pytest.mark.parametrize("name", list(CONTEXT_VIOLATIONS))
def test_validate_refuses_bad_windows(name: str) -> None:
    mutate, fragment = CONTEXT_VIOLATIONS[name]
    assert_refused(compacted_record(), mutate, fragment)


def test_any_role_is_allowed_and_other_kinds_keep_their_conventions() -> None:
    record = compacted_record()
    record["segments"][4]["role"] = "tool_result"
    record["action_mask"][30] = True  # an action token inside an observation segment: not this rule's business
    record["observation_mask"][30] = False
    record["rollout_log_probs"][30] = record["teacher_log_probs"][30] = -1.0
    validate_record(record)


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda r: r["segments"][3].update(context=r["segments"][3]["context"].astype(np.int64)), "segments[3].context: dtype int64, expected int32"),
        (lambda r: r["segments"][3].update(context=np.array([1, -1, 2], dtype=np.int32)), "segments[3].context: negative token id -1"),
        (lambda r: r["segments"][0].update(context=np.array([1], dtype=np.int32)), "segments[0].context: the first segment cannot open a window"),
    ],
)
def test_reader_refuses_a_bad_context_in_the_file(tmp_path: Path, mutate, fragment: str) -> None:
    record = normalize_record(compacted_record())
    mutate(record)
    path = raw_shard(tmp_path / "ctx.msgpack.zst", [normalize_record(make(1)), record])
    with pytest.raises(ShardError) as exc:
        list(ShardReader(path))
    one_line_naming(exc, path, "record 1 (id 'traj-00000000')", fragment)


def test_reads_a_version_1_shard_as_it_is(tmp_path: Path) -> None:
    records = [normalize_record({k: v for k, v in full_record(0).items() if k != "routed_experts"}), normalize_record(make(1))]
    path = write_raw(tmp_path / "v1.msgpack.zst", [header(schema_version=1), *records, footer(records)])
    shard = read_shard(path)
    assert shard.header["schema_version"] == 1
    for a, b in zip(records, shard.records):
        assert_same(a, b)
    assert [len(context_windows(r)) for r in shard.records] == [1, 1]


@pytest.mark.parametrize("version", [1, 2])
def test_refuses_routed_experts_before_version_3(tmp_path: Path, version: int) -> None:
    records = [normalize_record(full_record(0))]
    path = write_raw(tmp_path / "v2.msgpack.zst", [header(schema_version=version), *records, footer(records)])
    with pytest.raises(ShardError) as exc:
        list(ShardReader(path))
    one_line_naming(exc, path, "record 0", f"field 'routed_experts' needs schema version 3, the header says {version}")


def test_routed_experts_rules() -> None:
    record = normalize_record(full_record(0))
    validate_record(record)
    wide = {**record, "routed_experts": record["routed_experts"].astype(np.uint16)}
    wide["routed_experts"][-1] = 0xFFFF  # uint16: its own largest value means "not recorded"
    validate_record(wide)
    # 256 experts, k >= 2, in uint8: id 255 is an expert; only a row of nothing else is "not recorded".
    validate_record({**record, "routed_experts": np.where(np.arange(2)[None, None, :] == 0, 255, record["routed_experts"]).astype(np.uint8)})
    for change, message in (
        (lambda r: r.astype(np.int32), "dtype int32, expected uint16 or uint8"),
        (lambda r: r[:-1], "length 39, expected T=40"),
        (lambda r: np.repeat(r[:, :, :1], 2, axis=2), "token 0 lists one expert twice in a layer"),
        (lambda r: np.where((np.arange(40)[:, None, None] == 3) & (np.arange(2)[None, :, None] == 0), 255, r).astype(np.uint8),
         "token 3 lists one expert twice"),  # layer 0 all 255, layer 1 not: a recorded row with a repeat
    ):
        with pytest.raises(RecordError, match=message):
            validate_record({**record, "routed_experts": change(record["routed_experts"])})


def test_refuses_a_context_in_a_version_1_shard(tmp_path: Path) -> None:
    records = [normalize_record(compacted_record())]
    path = write_raw(tmp_path / "v1ctx.msgpack.zst", [header(schema_version=1), *records, footer(records)])
    with pytest.raises(ShardError) as exc:
        list(ShardReader(path))
    one_line_naming(exc, path, "record 0", "segments[3].context: context windows need schema version 2, the header says 1")


# ---------------------------------------------------------------------------------------------
# JSON form


def test_json_round_trip_is_exact() -> None:
    for record in [full_record(0), make(1), make(2, response_len=0)]:
        text = json.dumps(record_to_json(record), allow_nan=False)
        assert_same(record, record_from_json(json.loads(text)))


def test_json_round_trip_keeps_context_windows() -> None:
    record = compacted_record(windows=3)
    obj = json.loads(json.dumps(record_to_json(record), allow_nan=False))
    assert obj["segments"][3]["context"] == record["segments"][3]["context"].tolist()
    assert obj["segments"][1]["role"] == "summary_request"
    back = record_from_json(obj)
    assert_same(record, back)
    assert back["segments"][3]["context"].dtype == np.int32 and back["segments"][5]["context"].dtype == np.int32
    # A tagged array of another integer width (hand-written JSON) is accepted and becomes int32.
    obj["segments"][3]["context"] = {"$array": {"dtype": "int64", "shape": [3], "data": [4, 5, 6]}}
    assert record_from_json(obj)["segments"][3]["context"].dtype == np.int32
    obj["segments"][3]["context"] = [4, -5]
    with pytest.raises(RecordError, match=r"segments\[3\]\.context: negative token id -5"):
        record_from_json(obj)


def test_json_form_uses_lists_and_null() -> None:
    obj = record_to_json(full_record())
    assert obj["reward"] is None
    assert obj["rewards"]["correct"] is None
    assert isinstance(obj["response_token_ids"][0], int)
    assert None in obj["rollout_log_probs"]
    assert isinstance(obj["teacher_topk_ids"][0], list)
    assert obj["extra"]["f16"]["$array"]["dtype"] == "float16"
    assert obj["extra"]["nested"]["nan"] == {"$float": "nan"}


def test_record_from_json_refuses_bad_input() -> None:
    obj = record_to_json(make())
    obj["response_token_ids"][2] = None
    with pytest.raises(RecordError, match="field 'response_token_ids': null in a int32 array"):
        record_from_json(obj)
    obj = record_to_json(make())
    obj["extra"] = {"x": {"$array": {"dtype": "int32"}}}
    with pytest.raises(RecordError, match="field 'extra': malformed tagged value"):
        record_from_json(obj)
    with pytest.raises(RecordError, match="must be a JSON object"):
        record_from_json([1, 2])


# ---------------------------------------------------------------------------------------------
# Writer


def test_writer_validates_and_names_file_and_record(tmp_path: Path) -> None:
    path = tmp_path / "a.msgpack.zst"
    bad = make(1)
    bad["status"] = "nope"
    with pytest.raises(RecordError) as exc:
        write_shard(path, [make(0), bad], stage="rollout", tokenizer_revision=REV)
    one_line_naming(exc, path, "record 1 (id 'traj-00000001')", "status 'nope'")
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_a_different_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(RecordError, match="tokenizer_revision 'synthetic-tokenizer' differs from the shard's 'other'"):
        write_shard(tmp_path / "a.msgpack.zst", [make()], stage="rollout", tokenizer_revision="other")


def test_writer_crash_leaves_no_file_and_keeps_the_old_one(tmp_path: Path) -> None:
    path = tmp_path / "a.msgpack.zst"
    with pytest.raises(KeyError):
        with ShardWriter(path, stage="rollout", tokenizer_revision=REV) as writer:
            writer.write(make(0))
            raise KeyError("crash")
    assert list(tmp_path.iterdir()) == []
    write_shard(path, [make(0)], stage="rollout", tokenizer_revision=REV)
    before = path.read_bytes()
    with pytest.raises(RuntimeError):
        with ShardWriter(path, stage="rollout", tokenizer_revision=REV) as writer:
            writer.write(make(1))
            assert (tmp_path / f".a.msgpack.zst.tmp-{os.getpid()}").exists()
            raise RuntimeError("crash")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.msgpack.zst"]


def test_zstd_level_is_configurable(tmp_path: Path) -> None:
    records = [make(i, response_len=400) for i in range(4)]
    fast = write_shard(tmp_path / "fast.msgpack.zst", records, stage="s", tokenizer_revision=REV, level=1)
    small = write_shard(tmp_path / "small.msgpack.zst", records, stage="s", tokenizer_revision=REV, level=19)
    assert small.stat().st_size < fast.stat().st_size
    assert len(read_shard(small).records) == len(read_shard(fast).records) == 4


def test_writer_missing_directory_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "a.msgpack.zst"
    with pytest.raises(ShardError) as exc:
        ShardWriter(path, stage="rollout", tokenizer_revision=REV)
    one_line_naming(exc, path, "cannot write")


def test_raw_helper_writes_what_the_writer_writes(tmp_path: Path) -> None:
    records = [normalize_record(make(i)) for i in range(3)]
    path = raw_shard(tmp_path / "raw.msgpack.zst", records)
    for a, b in zip(records, read_shard(path).records):
        assert_same(a, b)


# ---------------------------------------------------------------------------------------------
# Reader refusals: each names the file (and the record) in one line


def test_refuses_a_text_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.msgpack.zst"
    path.write_text("hello\n")
    with pytest.raises(ShardError) as exc:
        ShardReader(path)
    one_line_naming(exc, path, "not a glmpost shard (not zstd-compressed)")


def test_refuses_a_zstd_file_of_something_else(tmp_path: Path) -> None:
    path = tmp_path / "text.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(b"just some text, not msgpack\n" * 10))
    with pytest.raises(ShardError) as exc:
        ShardReader(path)
    one_line_naming(exc, path, "not a glmpost shard")


def test_refuses_msgpack_without_a_glmpost_header(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "other.msgpack.zst", [{"format": "something-else"}, {"a": 1}])
    with pytest.raises(ShardError) as exc:
        ShardReader(path)
    one_line_naming(exc, path, "first object is not a glmpost-trajectories header")


def test_refuses_an_empty_file_and_a_directory(tmp_path: Path) -> None:
    empty = tmp_path / "empty.msgpack.zst"
    empty.write_bytes(b"")
    with pytest.raises(ShardError, match="not zstd-compressed"):
        ShardReader(empty)
    with pytest.raises(ShardError, match="is a directory"):
        ShardReader(tmp_path)


def test_refuses_a_newer_schema_version(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "v4.msgpack.zst", [header(schema_version=4), footer([])])
    with pytest.raises(ShardError) as exc:
        ShardReader(path)
    one_line_naming(exc, path, "written by a newer glmpost: schema version 4 > 3 (upgrade glmpost)")


def test_refuses_a_header_without_stage(tmp_path: Path) -> None:
    h = header()
    del h["stage"]
    path = write_raw(tmp_path / "h.msgpack.zst", [h, footer([])])
    with pytest.raises(ShardError) as exc:
        ShardReader(path)
    one_line_naming(exc, path, "header has no valid 'stage'")


@pytest.mark.parametrize("keep", [0.97, 0.6, 0.2, 0.01])
def test_refuses_a_shard_cut_short(tmp_path: Path, keep: float) -> None:
    """Cuts inside later zstd blocks (records decoded, no footer) and inside the first block (nothing decoded)."""
    records = [make(i, response_len=3000) for i in range(6)]
    path = write_shard(tmp_path / "a.msgpack.zst", records, stage="s", tokenizer_revision=REV)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ShardError) as exc:
        list(ShardReader(path))
    one_line_naming(exc, path, "truncated shard")


def test_refuses_a_shard_cut_in_the_zstd_epilogue(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "a.msgpack.zst", [make(0)], stage="s", tokenizer_revision=REV)
    path.write_bytes(path.read_bytes()[:-2])  # the frame's content checksum is cut
    with pytest.raises(ShardError) as exc:
        list(ShardReader(path))
    one_line_naming(exc, path, "truncated shard")


def test_refuses_a_complete_frame_without_footer(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "nofooter.msgpack.zst", [header(), normalize_record(make(0))])
    with pytest.raises(ShardError) as exc:
        list(ShardReader(path))
    one_line_naming(exc, path, "truncated shard: the file ends without a footer after 1 records")


def test_refuses_a_checksum_mismatch(tmp_path: Path) -> None:
    records = [normalize_record(make(i)) for i in range(3)]
    path = raw_shard(tmp_path / "crc.msgpack.zst", records, {"checksum": "crc32:deadbeef"})
    with pytest.raises(ShardError) as exc:
        list(ShardReader(path))
    one_line_naming(exc, path, "checksum mismatch: footer has crc32:deadbeef")


def test_refuses_a_corrupted_record_byte(tmp_path: Path) -> None:
    """Flip one byte inside a float array of an uncompressed-level shard: only the checksum notices."""
    records = [normalize_record(make(i)) for i in range(2)]
    packer = shards._packer()
    payload = bytearray(b"".join(packer.pack(o) for o in [header(), *records, footer(records)]))
    marker = records[1]["rollout_log_probs"][np.flatnonzero(records[1]["action_mask"])[0]].tobytes()
    at = bytes(payload).index(marker)
    payload[at] ^= 0x01
    path = tmp_path / "flip.msgpack.zst"
    path.write_bytes(zstandard.ZstdCompressor(level=1).compress(bytes(payload)))
    with pytest.raises(ShardError) as exc:
        list(ShardReader(path))
    one_line_naming(exc, path, "checksum mismatch")


def test_refuses_a_footer_count_mismatch(tmp_path: Path) -> None:
    records = [normalize_record(make(i)) for i in range(3)]
    path = raw_shard(tmp_path / "count.msgpack.zst", records, {"records": 4})
    with pytest.raises(ShardError) as exc:
        list(ShardReader(path))
    one_line_naming(exc, path, "footer count mismatch: footer says 4 records, found 3")


def test_refuses_a_record_missing_a_required_field(tmp_path: Path) -> None:
    records = [normalize_record(make(i)) for i in range(3)]
    del records[1]["status"]
    path = raw_shard(tmp_path / "missing.msgpack.zst", records)
    reader = ShardReader(path)
    seen = []
    with pytest.raises(ShardError) as exc:
        for record in reader:
            seen.append(record["id"])
    one_line_naming(exc, path, "record 1 (id 'traj-00000001')", "missing required field 'status'")
    assert seen == ["traj-00000000"]


def test_refuses_a_wrong_dtype_in_the_file(tmp_path: Path) -> None:
    record = normalize_record(make(0))
    record["response_token_ids"] = record["response_token_ids"].astype(np.int64)
    path = raw_shard(tmp_path / "dtype.msgpack.zst", [record])
    with pytest.raises(ShardError) as exc:
        list(ShardReader(path))
    one_line_naming(exc, path, "record 0", "field 'response_token_ids': dtype int64, expected int32")


def test_refuses_lists_of_numbers_in_the_file(tmp_path: Path) -> None:
    record = normalize_record(make(0))
    record["prompt_token_ids"] = record["prompt_token_ids"].tolist()
    path = raw_shard(tmp_path / "list.msgpack.zst", [record])
    with pytest.raises(ShardError) as exc:
        list(ShardReader(path))
    one_line_naming(exc, path, "record 0", "field 'prompt_token_ids': expected a int32 array, got list")


def test_refuses_a_wrong_length_in_the_file(tmp_path: Path) -> None:
    records = [normalize_record(make(i)) for i in range(3)]
    records[2]["rollout_log_probs"] = records[2]["rollout_log_probs"][:-1]
    path = raw_shard(tmp_path / "len.msgpack.zst", records)
    with pytest.raises(ShardError) as exc:
        list(ShardReader(path))
    one_line_naming(exc, path, "record 2", "field 'rollout_log_probs': length 39, expected T=40")


def test_refuses_a_record_with_another_tokenizer(tmp_path: Path) -> None:
    record = normalize_record(make(0, tokenizer_revision="other"))
    path = raw_shard(tmp_path / "tok.msgpack.zst", [record])
    with pytest.raises(ShardError) as exc:
        list(ShardReader(path))
    one_line_naming(exc, path, "record 0", "differs from the header's")


def test_refuses_an_unknown_ext_type_and_a_bad_payload(tmp_path: Path) -> None:
    record = normalize_record(make(0))
    record["extra"] = {"x": msgpack.ExtType(7, b"abc")}
    path = raw_shard(tmp_path / "ext.msgpack.zst", [record])
    with pytest.raises(ShardError) as exc:
        list(ShardReader(path))
    one_line_naming(exc, path, "record 0", "unknown msgpack ExtType code 7")
    record["extra"] = {"x": msgpack.ExtType(1, bytes([5, 1, 4, 0, 0, 0]) + b"\x00" * 3)}
    path = raw_shard(tmp_path / "payload.msgpack.zst", [record])
    with pytest.raises(ShardError, match="array payload size does not match its shape"):
        list(ShardReader(path))


def test_refuses_data_after_the_footer(tmp_path: Path) -> None:
    records = [normalize_record(make(0))]
    path = write_raw(tmp_path / "after.msgpack.zst", [header(), *records, footer(records), {"more": 1}])
    with pytest.raises(ShardError) as exc:
        list(ShardReader(path))
    one_line_naming(exc, path, "data after the footer")


def test_refuses_bytes_after_the_zstd_frame(tmp_path: Path) -> None:
    records = [normalize_record(make(0))]
    path = write_raw(tmp_path / "trail.msgpack.zst", [header(), *records, footer(records)], trailing=b"garbage")
    with pytest.raises(ShardError) as exc:
        list(ShardReader(path))
    one_line_naming(exc, path, "7 bytes after the end of the zstd frame")


def test_refuses_a_non_record_object(tmp_path: Path) -> None:
    path = raw_shard(tmp_path / "obj.msgpack.zst", [[1, 2, 3]])
    with pytest.raises(ShardError) as exc:
        list(ShardReader(path))
    one_line_naming(exc, path, "record 0", "a record must be a map")


def test_shard_errors_are_glmpost_errors() -> None:
    assert issubclass(ShardError, GlmpostError) and issubclass(RecordError, GlmpostError)
    assert ShardError("x", "y").exit_code == 1


def test_dtype_table_matches_the_schema_list() -> None:
    codes = sorted(dtype.str.lstrip("<>|=") for dtype in DTYPE_CODES.values())
    assert codes == sorted(schema._FREE_FORM_DTYPES)


# ---------------------------------------------------------------------------------------------
# Datasets


def _dataset(tmp_path: Path, n: int, name: str = "ds") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    for s in range(n):
        write_shard(directory / f"shard-{s:03d}.msgpack.zst", [make(s)], stage="s", tokenizer_revision=REV)
    return directory


def test_resolve_files_directories_and_globs(tmp_path: Path) -> None:
    ds = _dataset(tmp_path, 3)
    (ds / "notes.txt").write_text("x")
    (ds / ".shard-9.msgpack.zst.tmp-1").write_text("x")
    names = [p.name for p in resolve_shard_paths([str(ds)])]
    assert names == ["shard-000.msgpack.zst", "shard-001.msgpack.zst", "shard-002.msgpack.zst"]
    assert resolve_shard_paths([str(ds / "shard-00[12].msgpack.zst")]) == [ds / "shard-001.msgpack.zst", ds / "shard-002.msgpack.zst"]
    assert resolve_shard_paths([ds / "shard-002.msgpack.zst", str(ds)])[0].name == "shard-002.msgpack.zst"
    assert len(resolve_shard_paths([str(ds), str(ds / "*.msgpack.zst")])) == 3  # duplicates dropped
    assert len(resolve_shard_paths([str(tmp_path / "d*")])) == 3  # a glob matching a directory


@pytest.mark.parametrize(
    "item, fragment",
    [("missing.msgpack.zst", "no such file or directory"), ("nomatch-*.zst", "no shards match this pattern"), ("emptydir", "holds no *.msgpack.zst shards")],
)
def test_resolve_names_the_input_that_matches_nothing(tmp_path: Path, item: str, fragment: str) -> None:
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(UsageError) as exc:
        resolve_shard_paths([str(tmp_path / item)])
    assert str(tmp_path / item) in str(exc.value) and fragment in str(exc.value)


@pytest.mark.parametrize("n", [0, 1, 5, 7, 16])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 8])
def test_select_shards_covers_every_shard_exactly_once(n: int, num_shards: int) -> None:
    paths = [Path(f"d/shard-{i:03d}.msgpack.zst") for i in range(n)][::-1]
    parts = [select_shards(paths, i, num_shards) for i in range(num_shards)]
    flat = [p for part in parts for p in part]
    assert sorted(flat) == sorted(paths) and len(flat) == n
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert parts[0][:1] == sorted(paths)[:1]


@pytest.mark.parametrize("index, num", [(-1, 2), (2, 2), (0, 0)])
def test_select_shards_refuses_bad_indices(index: int, num: int) -> None:
    with pytest.raises(UsageError, match="--(shard-index|num-shards)"):
        select_shards([Path("a")], index, num)


def test_iter_records_reads_the_selected_shards(tmp_path: Path) -> None:
    ds = _dataset(tmp_path, 5)
    ids = [r["id"] for r in iter_records([str(ds)])]
    assert ids == [f"traj-{i:08d}" for i in range(5)]
    split = [[r["id"] for r in iter_records([ds], shard_index=i, num_shards=2)] for i in range(2)]
    assert split == [["traj-00000000", "traj-00000002", "traj-00000004"], ["traj-00000001", "traj-00000003"]]
