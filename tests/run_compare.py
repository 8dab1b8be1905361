"""Compare two runs of a pipeline: the same files, every ``*.safetensors`` byte for byte, every shard
record field by field (shard headers hold timestamps and paths, so shard bytes differ).

``python tests/run_compare.py DIR_A DIR_B`` prints the differences and exits 1 if there are any.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def _records(path: Path) -> list[dict]:
    from glmpost.formats import ShardReader

    return list(ShardReader(path))


def _same_value(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:  # NaN rewards
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def differences(a: Path, b: Path) -> tuple[list[str], dict[str, int]]:
    """What differs between runs ``a`` and ``b``, and how much was compared."""
    a, b = Path(a), Path(b)
    found: list[str] = []
    counts = {"checkpoint_files": 0, "shards": 0, "records": 0}
    names = {p.relative_to(a) for p in a.rglob("*") if p.is_file() and p.name.endswith((".safetensors", ".msgpack.zst"))}
    other = {p.relative_to(b) for p in b.rglob("*") if p.is_file() and p.name.endswith((".safetensors", ".msgpack.zst"))}
    found += [f"only in {a}: {n}" for n in sorted(names - other)] + [f"only in {b}: {n}" for n in sorted(other - names)]
    for name in sorted(names & other):
        if name.name.endswith(".safetensors"):
            counts["checkpoint_files"] += 1
            if (a / name).read_bytes() != (b / name).read_bytes():
                found.append(f"{name}: bytes differ")
            continue
        counts["shards"] += 1
        ra, rb = _records(a / name), _records(b / name)
        if len(ra) != len(rb):
            found.append(f"{name}: {len(ra)} vs {len(rb)} records")
            continue
        for index, (x, y) in enumerate(zip(ra, rb)):
            counts["records"] += 1
            keys = sorted(set(x) | set(y))
            bad = [k for k in keys if k not in x or k not in y or not _same_value(x[k], y[k])]
            if bad:
                found.append(f"{name}: record {index}: {', '.join(bad)} differ")
    return found, counts


if __name__ == "__main__":
    diffs, compared = differences(Path(sys.argv[1]), Path(sys.argv[2]))
    print("\n".join(diffs) or "identical", compared)
    sys.exit(1 if diffs else 0)
