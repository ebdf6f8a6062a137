"""Hostile input, generated: whatever a JSONL line or a Parquet value holds, each record ends as
exactly one task or one failure, and both are stored, on SQLite and on PostgreSQL.

A file that cannot be read at all is refused as a whole (SubmissionError) and registers nothing.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from fabric_gpu.model import DEFAULT_MODEL_ID
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.store.keys import set_id_of
from fabric_pipelines.lib.store.models import TaskFailure, TaskSet
from fabric_pipelines.lib.tasks.catalog import ingest_task_set
from fabric_pipelines.lib.tasks.inbox import submit
from fabric_pipelines.lib.tasks.ingest import SubmissionError
from tests.test_ingest import assert_every_record_once, stored_records

MAX = 32
NAMES = itertools.count()
FUZZ = settings(
    max_examples=40,
    deadline=None,
    # One database and data root serve every example; each example uses a task set of its own.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Characters that broke something once: NUL, lone surrogates, line and paragraph separators, BOM,
# a character outside the BMP, quotes and backslashes (CSV and COPY escaping).
AWKWARD = st.sampled_from(
    ["\x00", "\ud800", "\udfff", "\u2028", "\ufeff", "\r", "\n", "😀", '"', "\\", "\\.", ",", "é"]
)
TEXT = st.lists(st.one_of(st.text(max_size=12), AWKWARD), max_size=6).map("".join)
HUGE = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, 2**70, -(2**70)])
TOKEN = st.one_of(st.integers(0, 30521), st.integers(-5, 40000), HUGE)
JSON_SCALAR = st.one_of(
    st.none(), st.booleans(), st.integers(), HUGE, st.floats(), TEXT, st.just(10**300)
)
JSON_VALUE = st.recursive(
    JSON_SCALAR,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=8,
)


@st.composite
def record_line(draw: st.DrawFn) -> str:
    """One JSONL line, never blank and without a line break inside: a record, good or not."""
    kind = draw(st.sampled_from(["text", "tokens", "any", "raw"]))
    if kind == "raw":
        raw = draw(
            st.one_of(
                st.integers(1, 150_000).map(lambda d: "[" * d + "]" * d),  # deep nesting
                st.integers(4000, 6000).map(lambda d: '{"id": 1' + "0" * d + ', "text": "x"}'),
                st.binary(max_size=30).map(lambda b: b.decode("latin-1")),
                st.just('{"id": "x", "text": "unterminated'),
            )
        )
        return "x" + raw.replace("\n", " ").replace("\r", " ")
    record: dict[str, Any] = {}
    if draw(st.integers(0, 9)):  # mostly an id, of any kind
        record["id"] = draw(st.one_of(TEXT, st.integers(), HUGE, JSON_VALUE))
    if kind == "text":
        record["text"] = draw(st.one_of(TEXT, st.text(min_size=1, max_size=40), JSON_VALUE))
    elif kind == "tokens":
        record["token_ids"] = draw(
            st.one_of(st.lists(TOKEN, max_size=40), st.lists(JSON_VALUE, max_size=3))
        )
    else:
        record.update(
            draw(st.dictionaries(st.sampled_from(["id", "text", "token_ids"]), JSON_VALUE))
        )
    # NUL, surrogates and line breaks travel as \\u escapes, inside one line.
    return json.dumps(record)


def _ingest_and_check(db: Engine, paths: FabricPaths, source: Path, n_records: int | None) -> None:
    task_set = f"fuzz-{next(NAMES)}"
    submit(source, paths.inbox, task_set)
    try:
        summary = ingest_task_set(db, paths, task_set, model_id=DEFAULT_MODEL_ID, max_seq_len=MAX)
    except SubmissionError as exc:
        assert "\n" not in str(exc)
        with Session(db) as session:  # refused as a whole: nothing registered
            assert (
                session.scalar(
                    select(func.count()).select_from(TaskSet).where(TaskSet.name == task_set)
                )
                == 0
            )
            assert (
                session.scalar(
                    select(func.count())
                    .select_from(TaskFailure)
                    .where(TaskFailure.task_set_id == set_id_of(task_set))
                )
                == 0
            )
        assert n_records is None, f"a readable file was refused: {exc}"
        return
    if n_records is not None:
        assert summary.n_records == n_records
    assert summary.n_records == summary.n_tasks + summary.n_failed
    failures = assert_every_record_once(db, task_set, summary.n_records)
    assert [(f.record_no, f.reason) for f in failures] == [
        (f.record_no, f.reason) for f in summary.failures
    ]
    for failure in failures:
        assert failure.reason and "\x00" not in failure.reason
        assert failure.task_id is None or len(failure.task_id) <= 256
    _, tasks, _ = stored_records(db, task_set)
    stored = ingest_task_set(db, paths, task_set, model_id=DEFAULT_MODEL_ID, max_seq_len=MAX)
    assert stored.reused and stored.n_tasks == len(tasks)


@FUZZ
@given(lines=st.lists(record_line(), min_size=1, max_size=10))
def test_every_jsonl_record_ends_as_one_task_or_one_failure(
    db: Engine, paths: FabricPaths, tmp_path: Path, lines: list[str]
) -> None:
    source = tmp_path / "fuzz.jsonl"
    source.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass") + b"\n")
    _ingest_and_check(db, paths, source, len(lines))


def _values(kind: str) -> tuple[pa.DataType, st.SearchStrategy[Any]]:
    text = st.text(max_size=20)  # Arrow strings cannot hold lone surrogates; NUL they can
    ints = st.integers(-(2**63), 2**63 - 1)
    return {
        "string": (pa.string(), st.one_of(text, AWKWARD.filter(lambda c: c not in "\ud800\udfff"))),
        "large_string": (pa.large_string(), text),
        "int64": (pa.int64(), ints),
        "uint64": (pa.uint64(), st.integers(0, 2**64 - 1)),
        "float64": (pa.float64(), st.floats()),
        "bool": (pa.bool_(), st.booleans()),
        "binary": (pa.binary(), st.binary(max_size=12)),
        "list_int64": (pa.list_(pa.int64()), st.lists(st.one_of(st.none(), ints), max_size=40)),
        "list_uint64": (pa.list_(pa.uint64()), st.lists(st.integers(0, 2**64 - 1), max_size=8)),
        "list_float": (pa.list_(pa.float64()), st.lists(st.floats(), max_size=4)),
        "list_string": (pa.list_(pa.string()), st.lists(text, max_size=3)),
        "list_list": (
            pa.list_(pa.list_(pa.int64())),
            st.lists(st.lists(ints, max_size=2), max_size=2),
        ),
        "struct": (pa.struct([("a", pa.int64())]), st.fixed_dictionaries({"a": ints})),
        "timestamp": (pa.timestamp("us"), ints),  # most beyond Python's datetime range
        "null": (pa.null(), st.none()),
    }[kind]


KINDS = [
    "string", "large_string", "int64", "uint64", "float64", "bool", "binary", "list_int64",
    "list_uint64", "list_float", "list_string", "list_list", "struct", "timestamp", "null",
]  # fmt: skip


@st.composite
def parquet_table(draw: st.DrawFn) -> pa.Table:
    n = draw(st.integers(1, 12))
    names = draw(st.sets(st.sampled_from(["id", "text", "token_ids", "extra"]), min_size=1))
    columns = {}
    for name in sorted(names):
        kind = draw(st.sampled_from(KINDS))
        dtype, values = _values(kind)
        if name == "id" and draw(st.booleans()):
            dtype, values = pa.string(), st.text(min_size=1, max_size=5)  # some good ids too
        if name == "text" and draw(st.booleans()):
            dtype, values = pa.string(), st.text(min_size=1, max_size=30)
        if name == "token_ids" and draw(st.booleans()):
            dtype, values = (
                pa.list_(pa.int64()),
                st.lists(TOKEN.filter(lambda t: -(2**63) <= t < 2**63), max_size=40),
            )
        cells = draw(st.lists(st.one_of(st.none(), values), min_size=n, max_size=n))
        columns[name] = pa.array(cells, type=dtype)
    return pa.table(columns)


@FUZZ
@given(table=parquet_table())
def test_every_parquet_record_ends_as_one_task_or_one_failure(
    db: Engine, paths: FabricPaths, tmp_path: Path, table: pa.Table
) -> None:
    source = tmp_path / "fuzz.parquet"
    pq.write_table(table, source)
    names = set(table.column_names)
    readable = "id" in names and bool({"text", "token_ids"} & names)
    _ingest_and_check(db, paths, source, table.num_rows if readable else None)


@pytest.mark.parametrize(
    "content",
    [b"", b"PAR1", b"PAR1" + bytes(range(256)) + b"PAR1", b'{"id": 1, "text": "json"}\n'],
)
def test_a_file_that_is_not_parquet_is_refused_as_a_whole(
    db: Engine, paths: FabricPaths, tmp_path: Path, content: bytes
) -> None:
    source = tmp_path / "not.parquet"
    source.write_bytes(content)
    _ingest_and_check(db, paths, source, None)
