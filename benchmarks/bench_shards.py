"""Write and read synthetic trajectories as glmpost shards vs JSONL+gzip vs pickle, in one process.

    .venv/bin/python benchmarks/bench_shards.py --n 20000 --out runs/bench_shards.json

Every format stores the same records (P~200 prompt tokens, T~2000 response tokens, masks,
rollout log-probs, policy versions, teacher log-probs; realistic negative float32 log-probs from
:func:`glmpost.formats.synthetic_record`) and is read back into numpy arrays, because that is what a
stage consumes:

- glmpost: ``ShardWriter`` / ``ShardReader`` (zstd level ``--level``, records validated on write
  and read, footer checksum verified), ``--records-per-shard`` records per shard;
- JSONL+gzip: one ``json.dumps`` line per record (arrays as lists of numbers, NaN as ``NaN``),
  ``gzip`` level 6; reading converts the lists back to arrays of the schema dtypes;
- pickle: one uncompressed stream of pickled dicts of numpy arrays (protocol 5).

Every writer fsyncs its files. Files are read right after they are written, so they sit in the
page cache: the read times measure decoding, not the disk. Prints a table and writes the numbers as
JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pickle
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from glmpost.formats import ARRAY_FIELDS, FIELDS, ShardReader, ShardWriter, normalize_record, synthetic_record
from glmpost.formats.synthetic import GROUP_SIZE

REVISION = "synthetic-tokenizer"


@dataclass
class Config:
    n: int = 20_000
    prompt_len: int = 200
    response_len: int = 2_000
    topk: int = 0
    records_per_shard: int = 1_000
    level: int = 3
    seed: int = 0


@dataclass
class Result:
    format: str
    write_s: float
    read_s: float
    bytes: int
    records: int
    tokens: int

    @property
    def read_tokens_per_s(self) -> float:
        return self.tokens / self.read_s


def make_records(config: Config) -> list[dict[str, Any]]:
    """The records, already normalised (so no format pays for conversion); lengths vary +-10%.

    Like real GRPO rollouts, each group of ``GROUP_SIZE`` records shares one prompt.
    """
    rng = np.random.default_rng(config.seed)
    records = []
    for i in range(config.n):
        if i % GROUP_SIZE == 0:
            prompt_len = int(config.prompt_len * rng.uniform(0.9, 1.1))
        response_len = int(config.response_len * rng.uniform(0.9, 1.1))
        record = synthetic_record(
            rng, index=i, prompt_len=prompt_len, response_len=response_len, topk=config.topk, tokenizer_revision=REVISION
        )
        records.append(normalize_record(record))
    return records


def _tokens(record: dict[str, Any]) -> int:
    return len(record["prompt_token_ids"]) + len(record["response_token_ids"])


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


# --------------------------------------------------------------------------------------------
# The three formats: write(records, directory) -> files; read(files) -> records


def glmpost_write(records: list[dict[str, Any]], directory: Path, config: Config) -> list[Path]:
    paths = []
    for start in range(0, len(records), config.records_per_shard):
        path = directory / f"shard-{start // config.records_per_shard:05d}.msgpack.zst"
        with ShardWriter(path, stage="bench", options=asdict(config), tokenizer_revision=REVISION, level=config.level) as w:
            for record in records[start : start + config.records_per_shard]:
                w.write(record)
        paths.append(path)
    return paths


def glmpost_read(paths: list[Path]) -> Iterator[dict[str, Any]]:
    for path in paths:
        yield from ShardReader(path)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(type(value).__name__)


def jsonl_write(records: list[dict[str, Any]], directory: Path, config: Config) -> list[Path]:
    path = directory / "records.jsonl.gz"
    with gzip.open(path, "wt", compresslevel=6, encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, default=_json_default) + "\n")
    _fsync(path)
    return [path]


_ARRAY_DTYPES = {name: FIELDS[name].dtype for name in ARRAY_FIELDS}


def jsonl_read(paths: list[Path]) -> Iterator[dict[str, Any]]:
    for path in paths:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                for name, dtype in _ARRAY_DTYPES.items():
                    if name in record:
                        record[name] = np.asarray(record[name], dtype=dtype)
                yield record


def pickle_write(records: list[dict[str, Any]], directory: Path, config: Config) -> list[Path]:
    path = directory / "records.pickle"
    with open(path, "wb") as f:
        for record in records:
            pickle.dump(record, f, protocol=5)
    _fsync(path)
    return [path]


def pickle_read(paths: list[Path]) -> Iterator[dict[str, Any]]:
    for path in paths:
        with open(path, "rb") as f:
            while True:
                try:
                    yield pickle.load(f)
                except EOFError:
                    break


FORMATS: dict[str, tuple[Callable, Callable]] = {
    "glmpost": (glmpost_write, glmpost_read),
    "jsonl+gzip": (jsonl_write, jsonl_read),
    "pickle": (pickle_write, pickle_read),
}


def measure(name: str, records: list[dict[str, Any]], directory: Path, config: Config) -> Result:
    write, read = FORMATS[name]
    directory.mkdir(parents=True)
    start = time.perf_counter()
    paths = write(records, directory, config)
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    count = tokens = 0
    for record in read(paths):
        count += 1
        tokens += _tokens(record)
    read_s = time.perf_counter() - start
    assert count == len(records), f"{name}: read {count} of {len(records)} records"
    size = sum(p.stat().st_size for p in paths)
    return Result(name, write_s, read_s, size, count, tokens)


# --------------------------------------------------------------------------------------------
# Report


def report(results: list[Result], config: Config, seconds_generating: float) -> dict[str, Any]:
    base = next(r for r in results if r.format == "jsonl+gzip")
    rows = {}
    for r in results:
        rows[r.format] = {
            "write_s": round(r.write_s, 3),
            "read_s": round(r.read_s, 3),
            "bytes": r.bytes,
            "read_tokens_per_s": round(r.read_tokens_per_s),
            "read_speedup_vs_jsonl_gzip": round(base.read_s / r.read_s, 2),
            "write_speedup_vs_jsonl_gzip": round(base.write_s / r.write_s, 2),
            "size_vs_jsonl_gzip": round(r.bytes / base.bytes, 3),
        }
    glmpost = rows.get("glmpost")
    goals = None
    if glmpost is not None:
        goals = {
            "read_speedup_ge_10x": glmpost["read_speedup_vs_jsonl_gzip"] >= 10,
            "size_le_half": glmpost["size_vs_jsonl_gzip"] <= 0.5,
        }
    return {
        "config": asdict(config),
        "records": base.records,
        "tokens": base.tokens,
        "generate_s": round(seconds_generating, 1),
        "results": rows,
        "goals": goals,
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()},
    }


def print_table(summary: dict[str, Any]) -> None:
    header = f"{'format':<12} {'write s':>9} {'read s':>9} {'size MB':>10} {'read Mtok/s':>12} {'read x':>8} {'size x':>8}"
    print(f"{summary['records']} records, {summary['tokens']} tokens (prompt+response)")
    print(header)
    print("-" * len(header))
    for name, row in summary["results"].items():
        print(
            f"{name:<12} {row['write_s']:>9.2f} {row['read_s']:>9.2f} {row['bytes'] / 1e6:>10.1f} "
            f"{row['read_tokens_per_s'] / 1e6:>12.2f} {row['read_speedup_vs_jsonl_gzip']:>8.2f} {row['size_vs_jsonl_gzip']:>8.3f}"
        )
    print("(read x = JSONL+gzip read time / this read time; size x = this size / JSONL+gzip size)")
    if summary["goals"] is not None:
        print(f"goals: {summary['goals']}")


def parse_args(argv: list[str] | None) -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = Config()
    parser.add_argument("--n", type=int, default=defaults.n, help="number of trajectories (default 20000)")
    parser.add_argument("--prompt-len", type=int, default=defaults.prompt_len, help="mean prompt tokens P")
    parser.add_argument("--response-len", type=int, default=defaults.response_len, help="mean response tokens T")
    parser.add_argument("--topk", type=int, default=defaults.topk, help="teacher top-k width (0 = no top-k arrays)")
    parser.add_argument("--records-per-shard", type=int, default=defaults.records_per_shard, help="glmpost records per shard")
    parser.add_argument("--level", type=int, default=defaults.level, help="glmpost zstd level")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset of " + ", ".join(FORMATS))
    parser.add_argument("--workdir", type=Path, default=None, help="where to write the files (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    config = Config(args.n, args.prompt_len, args.response_len, args.topk, args.records_per_shard, args.level, args.seed)
    names = args.formats.split(",")
    unknown = set(names) - set(FORMATS)
    if unknown or "jsonl+gzip" not in names:
        parser.error(f"--formats must name known formats and include jsonl+gzip (the baseline); got {args.formats}")
    args.formats = names
    return config, args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config, args = parse_args(argv)
    start = time.perf_counter()
    records = make_records(config)
    generate_s = time.perf_counter() - start
    print(f"generated {len(records)} records in {generate_s:.1f}s", file=sys.stderr)
    workdir = Path(tempfile.mkdtemp(prefix="bench-shards-", dir=args.workdir))
    try:
        results = []
        for name in args.formats:
            results.append(measure(name, records, workdir / name.replace("+", "-"), config))
            r = results[-1]
            print(f"{name}: write {r.write_s:.2f}s, read {r.read_s:.2f}s, {r.bytes / 1e6:.1f} MB", file=sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = report(results, config, generate_s)
    print_table(summary)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
