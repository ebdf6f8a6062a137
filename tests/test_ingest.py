"""Ingest: every record becomes a task or a failure with a reason; nothing aborts the set."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fabric_gpu.model import DEFAULT_MODEL_ID, load_tokenizer, resolve_model_dir
from fabric_pipelines.lib.tasks.ingest import SubmissionError, ingest

MAX = 16


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(resolve_model_dir(DEFAULT_MODEL_ID))


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_bad_records_fail_back_with_reasons(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    rows: list[object] = [
        {"id": "ok-1", "text": "a good sentence"},
        {"id": "empty", "text": ""},
        {"id": "blank", "text": "  \t\n "},
        {"id": "long", "text": "word " * 100},
        {"id": "ok-1", "text": "same id again"},
        {"text": "no id"},
        {"id": True, "text": "bool id"},
        {"id": "num-text", "text": 3.5},
        {"id": "both", "text": "x", "token_ids": [101, 102]},
        {"id": "tok-ok", "token_ids": [101, 7592, 102]},
        {"id": "tok-bad", "token_ids": [101, 999999, 102]},
        {"id": "tok-neg", "token_ids": [-1]},
        {"id": "tok-empty", "token_ids": []},
        ["not", "an", "object"],
        {"id": 7, "text": "integer ids are fine"},
    ]
    path = _jsonl(tmp_path / "set.jsonl", rows)
    with open(path, "ab") as f:
        f.write(b'{"id": "latin1", "text": "caf\xe9"}\n')  # not UTF-8
        f.write(b'{"id": "broken", "text": \n')  # not JSON
        f.write(b"\n")  # blank lines are not records
    tasks = ingest(path, tokenizer, max_seq_len=MAX)
    assert tasks.n_records == len(rows) + 2
    assert tasks.task_ids == ["ok-1", "tok-ok", "7"]
    reasons = {f.record_no: f.reason for f in tasks.failures}
    assert len(tasks.failures) + len(tasks.task_ids) == tasks.n_records
    assert reasons[1] == "empty text"
    assert reasons[2] == "text is only whitespace"
    assert reasons[3].startswith("over-long:") and f"max_seq_len {MAX}" in reasons[3]
    assert "duplicate id 'ok-1' (first at record 0)" in reasons[4]
    assert "missing 'id'" in reasons[5]
    assert "'id' must be a string or an integer" in reasons[6]
    assert "'text' must be a string" in reasons[7]
    assert "exactly one of 'text' or 'token_ids'" in reasons[8]
    assert "token id 999999 at position 1 is outside the vocabulary" in reasons[10]
    assert "token id -1" in reasons[11]
    assert reasons[12] == "empty token_ids"
    assert "expected an object" in reasons[13]
    assert "not valid UTF-8" in reasons[15]
    assert "not valid JSON" in reasons[16]
    assert list(tasks.lengths) == [5, 3, 7]  # [CLS] a good sentence [SEP]; given ids kept as is


def test_lengths_at_the_limit_pass_and_one_over_fails(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    rows = [
        {"id": "at", "token_ids": [101] + [1000] * (MAX - 2) + [102]},
        {"id": "over", "token_ids": [101] + [1000] * (MAX - 1) + [102]},
        {"id": "under", "token_ids": [101] + [1000] * (MAX - 3) + [102]},
    ]
    tasks = ingest(_jsonl(tmp_path / "edges.jsonl", rows), tokenizer, max_seq_len=MAX)
    assert tasks.task_ids == ["at", "under"]
    assert list(tasks.lengths) == [MAX, MAX - 1]
    assert tasks.failures[0].task_id == "over" and f"{MAX + 1} tokens" in tasks.failures[0].reason


def test_truncation_only_when_asked_and_counted(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    path = _jsonl(tmp_path / "t.jsonl", [{"id": "long", "text": "word " * 100}])
    tasks = ingest(path, tokenizer, max_seq_len=MAX, truncate=True)
    assert tasks.truncated == 1 and not tasks.failures
    assert tasks.lengths[0] == MAX
    assert tasks.tokens[MAX - 1] == 102  # the closing [SEP] is kept


def test_parquet_input_with_nulls(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "set.parquet"
    pq.write_table(pa.table({"id": ["a", None, "c"], "text": ["hello world", "x", None]}), path)
    tasks = ingest(path, tokenizer, max_seq_len=MAX)
    assert tasks.task_ids == ["a"]
    assert [f.record_no for f in tasks.failures] == [1, 2]


def test_a_file_of_the_wrong_kind_is_refused_as_a_whole(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "set.csv"
    path.write_text("id,text\n1,hello\n")
    with pytest.raises(SubmissionError, match=r"unsupported file type '\.csv'"):
        ingest(path, tokenizer, max_seq_len=MAX)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"key": ["a"], "body": ["b"]}), bad)
    with pytest.raises(SubmissionError, match="needs an 'id' column"):
        ingest(bad, tokenizer, max_seq_len=MAX)
