"""Datasets of shards: files, directories and globs resolved to shard paths, split across tasks.

:func:`resolve_shard_paths` expands a stage's inputs (``formats/SPEC.md`` §1), :func:`select_shards`
gives each Slurm array task its shards, and :func:`iter_records` reads the records of a selection
(each shard verified by :class:`~glmpost.formats.shard_reader.ShardReader`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from glmpost.config import ConfigError
from glmpost.errors import UsageError
from glmpost.formats.globbing import expand_pattern, has_magic, is_loop
from glmpost.formats.shard_reader import ShardReader
from glmpost.formats.shards import SHARD_SUFFIX


def resolve_shard_paths(inputs: Sequence[str | Path]) -> list[Path]:
    """Expand inputs to shard files, in input order, each input sorted, duplicates dropped.

    A file is taken as is; a directory contributes its ``*.msgpack.zst`` files (not recursive,
    hidden files skipped); anything else is a glob (:mod:`glmpost.formats.globbing`: each real
    directory walked once, symbolic link loops skipped and said in one line). An input matching no
    shard, or a path through a link loop, is a :class:`UsageError` naming it.
    """
    if not inputs:
        raise UsageError("no input shards given")
    seen: set[Path] = set()
    paths: list[Path] = []
    for item in inputs:
        for path in _expand(str(item)):
            key = path.resolve()
            if key not in seen:
                seen.add(key)
                paths.append(path)
    return paths


def _expand(item: str) -> list[Path]:
    path = Path(item)
    if is_loop(item):
        raise UsageError(f"{item}: a symbolic link loop (too many levels of symbolic links)")
    if path.is_dir():
        found = _shards_in(path)
        if not found:
            raise UsageError(f"{item}: directory holds no *{SHARD_SUFFIX} shards")
        return found
    if path.exists():
        return [path]
    if not has_magic(item):
        raise UsageError(f"{item}: no such file or directory")
    matches, loops = expand_pattern(item)
    if loops:
        sys.stderr.write(f"glmpost: {item}: skipped {len(loops)} symbolic link loop(s): {', '.join(loops)}\n")
    found = []
    for match in matches:
        found.extend(_shards_in(Path(match)) if os.path.isdir(match) else [Path(match)])
    if not found:
        raise UsageError(f"{item}: no shards match this pattern")
    return found


def _shards_in(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob(f"*{SHARD_SUFFIX}") if not p.name.startswith(".") and p.is_file())


def select_shards(paths: Sequence[Path], shard_index: int, num_shards: int) -> list[Path]:
    """The shards of Slurm array task ``shard_index`` of ``num_shards``: round-robin over sorted paths.

    Every shard goes to exactly one task; a task may get none when there are fewer shards than tasks.
    Bad indices are refused naming the config fields ``shard_index`` and ``num_shards``.
    """
    if num_shards < 1:
        raise ConfigError("{num_shards} must be >= 1, got {value}", value=num_shards)
    if not 0 <= shard_index < num_shards:
        raise ConfigError("{shard_index} must be in [0, {count}) for {num_shards} {count}, got {value}", count=num_shards,
                          value=shard_index)
    return sorted(paths, key=str)[shard_index::num_shards]


def iter_records(
    inputs: Sequence[str | Path], *, shard_index: int = 0, num_shards: int = 1
) -> Iterator[dict[str, Any]]:
    """Validated records of every shard selected from ``inputs`` (see :func:`resolve_shard_paths`)."""
    for path in select_shards(resolve_shard_paths(inputs), shard_index, num_shards):
        yield from ShardReader(path)
