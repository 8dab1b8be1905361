"""Prompts and conversations from parquet, CSV, JSON arrays and ``datasets`` directories (issue 34,
"Data"): the same prompts and records as the equivalent JSONL, the column mapping, one-line errors
naming the file and the column, and parquet streamed batch by batch."""

from __future__ import annotations

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_rollout import _records, _same

from glmpost.config import ConfigError
from glmpost.errors import UsageError
from glmpost.formats import sources
from glmpost.formats.prompts import PromptDataError, read_prompts
from glmpost.formats.sources import ColumnsConfig, source_kind, source_rows

ROWS = [{"id": f"q{d}", "prompt": f"count: {d}", "domain": "count", "task": {"digit": str(d)}} for d in range(5)]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """``datasets`` caches what its loaders read (CSV, JSON) here, not in the user's cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _parquet(path, rows, **kwargs):
    pq.write_table(pa.Table.from_pylist(rows), path, **kwargs)
    return path


def _dataset_dir(path, rows):
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def _prompts(path, columns=None):
    return read_prompts(path, source_rows(path, columns))


def test_every_source_gives_the_prompts_of_the_same_jsonl(tmp_path):
    expected = read_prompts(_jsonl(tmp_path / "prompts.jsonl", ROWS))
    (tmp_path / "array.json").write_text(json.dumps(ROWS))
    paths = {"parquet": _parquet(tmp_path / "prompts.parquet", ROWS), "datasets": _dataset_dir(tmp_path / "saved", ROWS),
             "json": tmp_path / "array.json"}
    for kind, path in paths.items():
        assert source_kind(path) == kind
        assert _prompts(path) == expected, kind
    flat = [{key: row[key] for key in ("id", "prompt", "domain")} for row in ROWS]
    (tmp_path / "flat.csv").write_text("id,prompt,domain\n" + "".join(f"{r['id']},{r['prompt']},{r['domain']}\n" for r in flat))
    assert _prompts(tmp_path / "flat.csv") == read_prompts(_jsonl(tmp_path / "flat.jsonl", flat))
    # Rows without ids: a table's row N defaults to <stem>-N, as line N of a JSONL file does.
    bare = [{"prompt": row["prompt"]} for row in ROWS]
    ids = [p.id for p in _prompts(_parquet(tmp_path / "bare.parquet", bare))]
    assert ids == [p.id for p in read_prompts(_jsonl(tmp_path / "bare.jsonl", bare))] == [f"bare-{n}" for n in range(1, 6)]


def test_jsonl_is_read_as_before(tmp_path):
    path = _jsonl(tmp_path / "prompts.jsonl", ROWS)
    assert list(source_rows(path)) == [(f"{path}:{n}", f"prompts-{n}", row) for n, row in enumerate(ROWS, start=1)]
    lines = _jsonl(tmp_path / "lines.json", ROWS)  # JSON lines named .json stay JSONL
    assert source_kind(lines) == "jsonl" and _prompts(lines) == read_prompts(lines)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "count: 1"}\n{"prompt": 3}\n')
    with pytest.raises(PromptDataError) as before:
        read_prompts(broken)
    with pytest.raises(PromptDataError) as now:
        _prompts(broken)
    assert str(before.value) == str(now.value) == f"{broken}:2: needs a string 'prompt' or a 'messages' list"
    with pytest.raises(PromptDataError, match=r"jsonl:1: needs a string 'prompt' or a 'messages' list"):
        _prompts(_jsonl(tmp_path / "no-prompt.jsonl", [{"q": 1, "a": 2}]), ColumnsConfig(answer_column="a"))


def test_columns_are_mapped_in_every_source(tmp_path):
    rows = [{"question": f"count: {d}", "solution": str(d), "source": "math", "chat": None} for d in range(3)]
    rows[2]["chat"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count: 2"}]
    columns = ColumnsConfig(prompt_column="question", messages_column="chat", answer_column="solution", domain_column="source")
    parquet = _parquet(tmp_path / "mapped.parquet", rows)
    jsonl = _jsonl(tmp_path / "mapped.jsonl", [{k: v for k, v in row.items() if v is not None} for row in rows])
    prompts = _prompts(parquet, columns)
    assert prompts == _prompts(jsonl, columns) == _prompts(_dataset_dir(tmp_path / "mapped", rows), columns)
    assert [p.messages for p in prompts[:2]] == [[{"role": "user", "content": f"count: {d}"}] for d in range(2)]
    assert prompts[2].messages == rows[2]["chat"]  # a null cell is a missing value: row 3's chat, the others' question
    assert [(p.domain, p.task) for p in prompts] == [("math", {"answer": str(d)}) for d in range(3)]
    # The answer column joins a task the row has.
    with_task = _prompts(_parquet(tmp_path / "task.parquet", [{"prompt": "p", "task": {"x": 1}, "ans": "7"}]),
                         ColumnsConfig(answer_column="ans"))
    assert with_task[0].task == {"x": 1, "answer": "7"}


def test_missing_columns_and_unreadable_files_are_one_line_errors(glmpost_cli, tiny_checkpoint, tmp_path):
    parquet = _parquet(tmp_path / "prompts.parquet", [{"a": "x", "b": 1, "c": 2.0}])
    missing = glmpost_cli("rollout", parquet, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "o",
                          "--prompt-column", "question")
    assert missing.exit_code == 2
    assert missing.stderr.strip() == f"glmpost: error: {parquet}: no column 'question' (columns: a, b, c); set --prompt-column"
    neither = glmpost_cli("shards", "import", parquet, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "i")
    assert neither.exit_code == 2 and neither.stderr.strip() == (
        f"glmpost: error: {parquet}: no column 'prompt' or 'messages' (columns: a, b, c); set --prompt-column or "
        "--messages-column")
    answer = glmpost_cli("shards", "import", parquet, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "i",
                         "--prompt-column", "a", "--answer-column", "solution")
    assert answer.exit_code == 2 and answer.stderr.strip().endswith("no column 'solution' (columns: a, b, c); set --answer-column")
    jsonl = _jsonl(tmp_path / "p.jsonl", [{"q": "x"}])
    line = glmpost_cli("rollout", jsonl, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "o", "--prompt-column", "question")
    assert line.exit_code == 2 and line.stderr.strip() == f"glmpost: error: {jsonl}:1: no column 'question' (keys: q); set --prompt-column"
    damaged = tmp_path / "damaged.parquet"
    damaged.write_bytes(b"PAR1 not really parquet")
    unreadable = glmpost_cli("rollout", damaged, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "o")
    assert unreadable.exit_code == 1 and unreadable.stderr.startswith(f"glmpost: error: {damaged}: not a readable parquet file (")
    bad_csv = tmp_path / "bad.csv"
    bad_csv.write_text('prompt,domain\n"open quote,x\n')
    csv = glmpost_cli("shards", "import", bad_csv, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "i")
    assert csv.exit_code == 1 and csv.stderr.startswith(f"glmpost: error: {bad_csv}: not a readable CSV file (")
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dict"))
    splits = glmpost_cli("rollout", tmp_path / "dict", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "o")
    assert splits.exit_code == 2 and "a DatasetDict (splits: train); give one split's directory" in splits.stderr
    results = (missing, neither, answer, line, unreadable, csv, splits)
    assert all(len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr for r in results)
    assert not (tmp_path / "o").exists() and not (tmp_path / "i").exists()


def test_rollout_from_parquet_and_datasets_writes_the_records_of_the_jsonl(glmpost_cli, tiny_checkpoint, tmp_path):
    rows = ROWS[:3]
    args = ["--checkpoint", tiny_checkpoint, "--group-size", "2", "--max-new-tokens", "4", "--stop-token-ids", "none"]
    assert glmpost_cli("rollout", _jsonl(tmp_path / "p.jsonl", rows), *args, "--out", tmp_path / "a").exit_code == 0
    expected = _records(tmp_path / "a")
    assert len(expected) == 6
    renamed = [{"question": r["prompt"], "id": r["id"], "domain": r["domain"], "task": r["task"]} for r in rows]
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('[rollout]\nprompt-column = "question"\n')  # the setting is a recipe key too
    for name, source, extra in (("b", _parquet(tmp_path / "p.parquet", rows), []),
                                ("c", _dataset_dir(tmp_path / "saved", rows), []),
                                ("d", _parquet(tmp_path / "renamed.parquet", renamed), ["--config", recipe])):
        result = glmpost_cli("rollout", source, *args, "--out", tmp_path / name, *extra)
        assert result.exit_code == 0, result.stderr
        records = _records(tmp_path / name)
        assert len(records) == len(expected)
        for a, b in zip(expected, records):
            _same(a, b)
    stage = json.loads((tmp_path / "d" / "stage.json").read_text())
    assert stage["options"]["prompt_column"] == "question" and stage["options"]["answer_column"] is None


def test_shards_import_from_parquet_writes_the_records_of_the_jsonl(glmpost_cli, tiny_checkpoint, tmp_path):
    rows = [{"id": f"c{d}", "prompt": f"count: {d}", "response": str(d), "domain": "count", "task": {"digit": str(d)}}
            for d in range(4)]
    base = ["--checkpoint", tiny_checkpoint, "--records-per-shard", "3"]
    assert glmpost_cli("shards", "import", _jsonl(tmp_path / "c.jsonl", rows), *base, "--out", tmp_path / "a").exit_code == 0
    expected = _records(tmp_path / "a")
    sft = [{"instruction": r["prompt"], "response": r["response"], "id": r["id"], "label": r["domain"], "task": r["task"]}
           for r in rows]
    parquet = _parquet(tmp_path / "sft.parquet", sft, row_group_size=2)
    result = glmpost_cli("shards", "import", parquet, *base, "--out", tmp_path / "b", "--prompt-column", "instruction",
                         "--domain-column", "label", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["records"] == 4 and json.loads(result.stdout)["shards"] == 2
    records = _records(tmp_path / "b")
    assert len(records) == len(expected) == 4
    for a, b in zip(expected, records):
        _same(a, b)
    # JSON-form records (what `shards cat` prints) from parquet come back as they were.
    printed = glmpost_cli("shards", "cat", tmp_path / "a")
    assert printed.exit_code == 0
    lines = [json.loads(line) for line in printed.stdout.splitlines()]
    again = glmpost_cli("shards", "import", _parquet(tmp_path / "records.parquet", lines), "--out", tmp_path / "c")
    assert again.exit_code == 0, again.stderr
    records = _records(tmp_path / "c")
    assert len(records) == len(expected)
    for a, b in zip(expected, records):
        _same(a, b)


def test_a_parquet_file_is_streamed_batch_by_batch(tmp_path, monkeypatch):
    rows = [{"prompt": f"count: {n % 10}", "id": f"r{n}"} for n in range(12)]
    path = _parquet(tmp_path / "groups.parquet", rows, row_group_size=4)
    assert pq.ParquetFile(path).num_row_groups == 3
    monkeypatch.setattr(sources, "BATCH_ROWS", 4)
    batches = []
    real = pq.ParquetFile.iter_batches

    def counted(self, *args, **kwargs):
        for batch in real(self, *args, **kwargs):
            batches.append(batch.num_rows)
            yield batch

    def whole(*args, **kwargs):
        raise AssertionError("the whole file was read")

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", counted)
    monkeypatch.setattr(pq.ParquetFile, "read", whole)
    monkeypatch.setattr(pq, "read_table", whole)
    stream = source_rows(path)
    assert next(stream)[2] == rows[0] and batches == [4]  # the first row before the rest is read
    assert [obj for _, _, obj in stream] == rows[1:] and batches == [4, 4, 4]


@pytest.mark.parametrize("module, source", [("pyarrow.parquet", "p.parquet"), ("datasets", "p.csv")])
def test_without_the_data_extra_the_error_says_how_to_install_it(tmp_path, monkeypatch, module, source):
    path = tmp_path / source
    path.write_text("prompt\nx\n")
    monkeypatch.setitem(sys.modules, module, None)  # import then raises ImportError
    with pytest.raises(UsageError, match=r"pip install 'glmpost\[data\]'") as error:
        list(source_rows(path))
    assert module.split(".")[0] in str(error.value) and "\n" not in str(error.value)


def test_the_column_errors_name_fields_a_command_spells(tmp_path):
    with pytest.raises(ConfigError) as error:
        list(source_rows(_parquet(tmp_path / "x.parquet", [{"a": 1}]), ColumnsConfig(task_column="t")))
    assert error.value.fields == ["task_column"]


def test_qat_reads_conversations_from_parquet_and_datasets_as_from_jsonl(tiny_checkpoint, tmp_path):
    from glmpost.kernel.loading import load_tokenizer
    from glmpost.rl.qat_update import read_sft_records

    tokenizer, revision = load_tokenizer(tiny_checkpoint)
    rows = [{"id": f"c{d}", "messages": [{"role": "user", "content": f"count: {d}"},
                                         {"role": "assistant", "content": str(d) * 3}], "domain": "count"}
            for d in range(4)]
    expected = read_sft_records([str(_jsonl(tmp_path / "c.jsonl", rows))], tokenizer, revision)
    for source in (_parquet(tmp_path / "c.parquet", rows, row_group_size=3), _dataset_dir(tmp_path / "c-ds", rows)):
        records = read_sft_records([str(source)], tokenizer, revision)
        assert [r["id"] for r in records] == [r["id"] for r in expected] == ["c0", "c1", "c2", "c3"]
        for a, b in zip(expected, records):
            _same(a, b)
