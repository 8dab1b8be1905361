"""Prompt rows from a large parquet file: glmpost's streamed reader vs pandas loading the table, each in
a fresh process (peak resident memory from VmHWM, wall-clock), reported as ratios.

    .venv/bin/python benchmarks/bench_sources.py --rows 400000 --out runs/bench_sources.json

The file holds ``--rows`` prompts of ``--prompt-chars`` characters (a question, an answer, a domain)
in row groups of 10,000. Both sides visit every row as a dict of its columns with the question
mapped to ``prompt`` and the answer into ``task``:

- glmpost: :func:`glmpost.formats.sources.source_rows` (``ParquetFile.iter_batches``, batches of
  1,024 rows; the whole file is never in memory);
- pandas: ``pandas.read_parquet`` then ``DataFrame.to_dict("records")`` (the usual one-liner).

Each side runs in its own interpreter after importing its libraries, so the peak is the reading's,
not the other side's; the baseline (the interpreter with the libraries imported) is reported too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
from glmpost.memory.process import peak_rss_mib
side, path = sys.argv[1], sys.argv[2]
import pyarrow.parquet  # both sides read through pyarrow: its import is part of the baseline
if side == "glmpost":
    from glmpost.formats.sources import ColumnsConfig, source_rows
    columns = ColumnsConfig(prompt_column="question", answer_column="answer")
    base = peak_rss_mib()
    start = time.perf_counter()
    rows = sum(1 for _, _, row in source_rows(path, columns) if row["prompt"])
else:
    import pandas
    base = peak_rss_mib()
    start = time.perf_counter()
    rows = 0
    for row in pandas.read_parquet(path).to_dict("records"):
        row = {"prompt": row.pop("question"), "task": {"answer": row.pop("answer")}, **row}
        rows += bool(row["prompt"])
print(json.dumps({"rows": rows, "seconds": time.perf_counter() - start, "peak_mib": peak_rss_mib(), "base_mib": base}))
"""


def write_parquet(path: Path, rows: int, prompt_chars: int) -> None:
    import pyarrow as pa  # the data extra
    import pyarrow.parquet as pq  # the data extra

    filler = ("lorem ipsum dolor sit amet " * (prompt_chars // 27 + 1))[:prompt_chars]
    with pq.ParquetWriter(path, pa.schema([("question", pa.string()), ("answer", pa.string()),
                                           ("domain", pa.string())])) as writer:
        for start in range(0, rows, 10_000):
            n = min(10_000, rows - start)
            writer.write_table(pa.table({"question": [f"{start + i}: {filler}" for i in range(n)],
                                         "answer": [str(start + i) for i in range(n)], "domain": ["math"] * n}))


def measure(side: str, path: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, side, str(path)], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--prompt-chars", type=int, default=400)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.parquet"
        write_parquet(path, args.rows, args.prompt_chars)
        size_mib = path.stat().st_size / 2**20
        results = {side: measure(side, path) for side in ("glmpost", "pandas")}
    ours, peer = results["glmpost"], results["pandas"]
    assert ours["rows"] == peer["rows"] == args.rows
    report = {"rows": args.rows, "prompt_chars": args.prompt_chars, "file_mib": round(size_mib, 1), **results,
              "peak_above_base_ratio": (ours["peak_mib"] - ours["base_mib"]) / max(peer["peak_mib"] - peer["base_mib"], 1e-9),
              "seconds_ratio": ours["seconds"] / peer["seconds"]}
    print(f"{args.rows} rows, parquet {size_mib:.1f} MiB")
    for side, r in results.items():
        print(f"  {side:8s} {r['seconds']:7.2f} s   peak {r['peak_mib']:8.1f} MiB (+{r['peak_mib'] - r['base_mib']:.1f} over its baseline)")
    print(f"  glmpost / pandas: memory above baseline {report['peak_above_base_ratio']:.3f}x, time {report['seconds_ratio']:.2f}x")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
