"""Prompt and conversation sources: JSONL, parquet, CSV / JSON through ``datasets``, and
``datasets`` directories (``Dataset.save_to_disk``), each read row by row as the JSON object a
JSONL line would be, so prompt parsing, ids and validation are the same for every source.

A ``.parquet`` file is streamed (record batches of :data:`BATCH_ROWS` rows, never the whole file);
a ``datasets`` directory is memory-mapped Arrow, iterated in batches; a ``.csv`` file, or a ``.json``
file holding one JSON array, goes through ``datasets``' loaders. Any other file is JSONL, read exactly
as before. :class:`ColumnsConfig` says which column holds what (the defaults are the JSONL keys).
pyarrow and ``datasets`` are optional (``pip install 'glmpost[data]'``), imported only to read such
a source.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterator, Optional

from glmpost.config import ConfigError, setting
from glmpost.errors import UsageError, first_line
from glmpost.formats.pipes import is_pipe, pipe_holds_shard
from glmpost.formats.prompts import PromptDataError, jsonl_rows
from glmpost.formats.shards import SHARD_SUFFIX

# Rows per record batch read from a parquet file or a datasets directory.
BATCH_ROWS = 1024
DATASET_FILES = ("dataset_info.json", "state.json")  # a Dataset.save_to_disk directory
DATASET_DICT_FILE = "dataset_dict.json"  # a DatasetDict.save_to_disk directory (one directory per split)


@dataclass
class ColumnsConfig:
    """Which column (JSONL key) of a prompt source holds what; a mapped column is read as the key
    it maps to, so ``question`` can be the prompt and ``solution`` the task's answer."""

    prompt_column: str = setting("prompt", "Column (JSONL key) holding the prompt text (a user turn).")
    messages_column: str = setting(
        "messages", "Column holding chat messages, a list of {role, content} (used instead of the prompt column when a "
        "row has both).")
    answer_column: Optional[str] = setting(
        None, "Column holding the reference answer, put into the task as task.answer (what the math verifier "
        "compares); default: none, the task's own.")
    domain_column: str = setting("domain", "Column holding the domain (routes to a verifier and a teacher).")
    task_column: str = setting("task", "Column holding the task object (what the verifier needs).")

    def mapping(self) -> dict[str, str]:
        """``{key the prompt parser reads: column}`` of the columns mapped to another name."""
        pairs = {"prompt": self.prompt_column, "messages": self.messages_column, "domain": self.domain_column,
                 "task": self.task_column}
        return {key: column for key, column in pairs.items() if key != column}

    def identity(self) -> bool:
        """Whether rows are read as they are (every column under its own name, no answer column)."""
        return not self.mapping() and self.answer_column is None


def dataset_directory(path: Path) -> bool:
    """Whether ``path`` is a directory ``datasets`` saved (a Dataset or a DatasetDict)."""
    path = Path(path)
    return path.is_dir() and (all((path / name).is_file() for name in DATASET_FILES) or (path / DATASET_DICT_FILE).is_file())


def is_prompt_source(path: str | Path) -> bool:
    """Whether ``path`` is read as prompts (a file that is not a shard, a pipe carrying text, or a
    datasets directory) rather than as shards (a shard, a shard directory or a glob)."""
    path = Path(path)
    if is_pipe(path):  # a named pipe or <(...): told by what it carries (glmpost.formats.pipes)
        return not pipe_holds_shard(path)
    return (path.is_file() and not path.name.endswith(SHARD_SUFFIX)) or dataset_directory(path)


PROMPT_SUFFIXES = (".jsonl", ".parquet", ".pq", ".csv")  # files a folder of shards should not hold beside them
OWN_FILES = ("metrics.jsonl",)  # what glmpost writes beside its shards


def check_not_mixed(directory: str | Path) -> None:
    """Refuse a directory holding both shards and prompt files (JSONL, parquet, CSV; not the
    ``metrics.jsonl`` a stage writes): read as shards, its prompt files would be dropped without a
    word. A :class:`UsageError` naming the directory and its prompt files."""
    directory = Path(directory)
    if not directory.is_dir() or not any(directory.glob(f"*{SHARD_SUFFIX}")):
        return
    loose = sorted(p.name for p in directory.iterdir() if p.suffix.lower() in PROMPT_SUFFIXES
                   and not p.name.startswith(".") and p.name not in OWN_FILES and p.is_file())
    if loose:
        shown = ", ".join(loose[:3]) + (f" and {len(loose) - 3} more" if len(loose) > 3 else "")
        raise UsageError(f"{directory}: holds both shards and prompt files ({shown}); name the prompt files, or the "
                         f"shards ({directory}/*{SHARD_SUFFIX}), as inputs")


def source_kind(path: Path) -> str:
    """How ``path`` is read: ``datasets`` (a saved directory), ``parquet``, ``csv``, ``json`` (a
    ``.json`` file holding one JSON array) or ``jsonl`` (any other file, as before)."""
    path = Path(path)
    if dataset_directory(path):
        return "datasets"
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix == ".csv":
        return "csv"
    if suffix == ".json" and path.is_file() and _first_byte(path) == b"[":
        return "json"
    return "jsonl"


def _first_byte(path: Path) -> bytes:
    """The first byte of ``path`` that is not white space (b"" for an empty or unreadable file)."""
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(4096):
                stripped = chunk.lstrip()
                if stripped:
                    return stripped[:1]
    except OSError:
        return b""
    return b""


def source_rows(path: str | Path, columns: ColumnsConfig | None = None) -> Iterator[tuple[str, str, Any]]:
    """``(where, default id, object)`` of every row of ``path``, its columns mapped by ``columns``:
    a JSONL line as :func:`~glmpost.formats.prompts.jsonl_rows` reads it (``file:line``, id
    ``<stem>-<line>``), a table's row as ``file: row N`` (N from 1, id ``<stem>-<N>``)."""
    path, columns = Path(path), columns or ColumnsConfig()
    kind = source_kind(path)
    if kind == "jsonl":
        if columns.identity():
            yield from jsonl_rows(path)
            return
        for where, default_id, obj in jsonl_rows(path):
            yield where, default_id, map_row(obj, columns, where=where, missing_check=True)
        return
    names, batches = _table(path, kind)
    check_columns(path, names, columns)
    number = 0
    for batch in batches:
        for row in batch:
            number += 1
            where = f"{path}: row {number}"
            yield where, f"{path.stem}-{number}", map_row(_without_nulls(row), columns, where=where)


def map_row(obj: Any, columns: ColumnsConfig, *, where: str, missing_check: bool = False) -> Any:
    """``obj`` with its mapped columns under the keys the prompt parser reads (another object is
    left to the parser's error); the answer column goes into the task as ``answer``.
    ``missing_check``: a row holding neither the prompt nor the messages column is an error naming
    them when either is renamed (a JSONL line; a table's columns are checked once, :func:`check_columns`)."""
    if not isinstance(obj, dict) or "prompt_token_ids" in obj:
        return obj
    renamed = columns.mapping()
    if (missing_check and ("prompt" in renamed or "messages" in renamed) and columns.prompt_column not in obj
            and columns.messages_column not in obj):
        field = "prompt_column" if columns.prompt_column != "prompt" else "messages_column"
        raise ConfigError("{where}: no column {column!r} (keys: {names}); set {" + field + "}", where=where,
                          column=getattr(columns, field), names=", ".join(map(str, obj)) or "none")
    row = dict(obj)
    for key, column in renamed.items():
        row.pop(key, None)
        if column in obj:
            row[key] = obj[column]
    answer = obj.get(columns.answer_column) if columns.answer_column is not None else None
    if answer is not None:
        task = row.get("task")
        if task is None or isinstance(task, dict):  # another task is the parser's error
            row["task"] = {**(task or {}), "answer": answer}
    return row


def check_columns(path: Path, names: list[str], columns: ColumnsConfig) -> None:
    """Refuse a table that lacks a column the settings name: one line naming the file, the column,
    the columns it has and the setting to change."""
    listed = ", ".join(names) or "none"
    for f in fields(ColumnsConfig):
        column = getattr(columns, f.name)
        if column is not None and column != f.default and column not in names:
            raise ConfigError("{file}: no column {column!r} (columns: {names}); set {" + f.name + "}", file=str(path),
                              column=column, names=listed)
    wanted = (columns.prompt_column, columns.messages_column, "prompt_token_ids")
    if not any(name in names for name in wanted):
        raise ConfigError("{file}: no column {prompt!r} or {messages!r} (columns: {names}); set {prompt_column} or "
                          "{messages_column}", file=str(path), prompt=columns.prompt_column,
                          messages=columns.messages_column, names=listed)


def _without_nulls(row: dict[str, Any]) -> dict[str, Any]:
    """A table's row without its null cells: a null is a missing value (a JSONL line leaves the key
    out), so a table can mix prompt and messages rows and leave ids to their default."""
    return {key: value for key, value in row.items() if value is not None}


def _table(path: Path, kind: str) -> tuple[list[str], Iterator[list[dict[str, Any]]]]:
    """The column names of a table source and an iterator of its rows, a batch at a time."""
    if kind == "parquet":
        return _parquet(path)
    dataset = _load_dataset(path, kind)
    return list(dataset.column_names), _dataset_batches(path, dataset)


def _parquet(path: Path) -> tuple[list[str], Iterator[list[dict[str, Any]]]]:
    """A parquet file's column names and its rows, streamed batch by batch (never the whole file)."""
    try:
        import pyarrow.parquet as pq  # optional (glmpost[data]): only a parquet source needs it
    except ImportError:
        raise missing_extra("pyarrow") from None
    try:
        reader = pq.ParquetFile(path)
        names = list(reader.schema_arrow.names)
    except FileNotFoundError:
        raise PromptDataError(f"{path}: no such file") from None
    except Exception as exc:  # pyarrow's ArrowInvalid / OSError: not parquet, or damaged
        raise PromptDataError(f"{path}: not a readable parquet file ({first_line(exc)})") from None

    def batches() -> Iterator[list[dict[str, Any]]]:
        try:
            for batch in reader.iter_batches(batch_size=BATCH_ROWS):
                yield batch.to_pylist()
        except Exception as exc:  # a damaged row group found while streaming
            raise PromptDataError(f"{path}: not a readable parquet file ({first_line(exc)})") from None

    return names, batches()


def _load_dataset(path: Path, kind: str):
    """The ``datasets`` Dataset of a saved directory, a CSV file or a JSON array file."""
    try:
        import datasets  # optional (glmpost[data]), and slow to import: only these sources need it
    except ImportError:
        raise missing_extra("datasets") from None
    datasets.disable_progress_bars()
    quiet = logging.getLogger("datasets")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # its own log line would repeat the one-line error
    try:
        if kind == "datasets":
            loaded = datasets.load_from_disk(str(path))
        else:
            loaded = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as exc:  # datasets raises many kinds (DatasetGenerationError, ArrowInvalid, ValueError)
        what = "a readable datasets directory" if kind == "datasets" else f"a readable {kind.upper()} file"
        raise PromptDataError(f"{path}: not {what} ({first_line(root_cause(exc))})") from None
    finally:
        quiet.setLevel(level)
    if isinstance(loaded, datasets.DatasetDict):
        splits = ", ".join(loaded)
        raise UsageError(f"{path}: a DatasetDict (splits: {splits}); give one split's directory, e.g. "
                         f"{path / next(iter(loaded), 'train')}")
    return loaded


def _dataset_batches(path: Path, dataset: Any) -> Iterator[list[dict[str, Any]]]:
    """The rows of a ``datasets`` Dataset, a batch at a time (its memory-mapped Arrow tables)."""
    try:
        for table in dataset.with_format("arrow").iter(batch_size=BATCH_ROWS):
            yield table.to_pylist()
    except Exception as exc:  # an Arrow file damaged after loading
        raise PromptDataError(f"{path}: not a readable dataset ({first_line(exc)})") from None


def root_cause(exc: BaseException) -> BaseException:
    """The exception at the bottom of ``exc``'s chain (what ``datasets`` wraps says what is wrong)."""
    seen = {id(exc)}
    while (inner := exc.__cause__ or exc.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        exc = inner
    return exc


def missing_extra(module: str) -> UsageError:
    """The error for a source that needs ``module`` (pyarrow or datasets) when it is not installed."""
    return UsageError(f"reading parquet, CSV, JSON arrays or datasets directories needs {module}: "
                      f"pip install 'glmpost[data]'")
