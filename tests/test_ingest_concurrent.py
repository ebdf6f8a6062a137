"""The overlapped ingest of a Parquet file stores exactly what ingest() makes of it.

`ingest_task_set` reads a Parquet file once into memory (hashed in one thread, parsed in
another) and writes the stored file while the rows go into the database. Whatever the mix of
good and bad records, the rows, failures, task-set row and stored file must be those of
`ingest` on the same file, on both databases.
"""

from __future__ import annotations

import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session

from fabric_gpu.model import DEFAULT_MODEL_ID, load_tokenizer, resolve_model_dir
from fabric_pipelines.lib.core.files import sha256_file
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.store.keys import set_id_of
from fabric_pipelines.lib.store.models import Task, TaskFailure, TaskSet
from fabric_pipelines.lib.tasks import catalog, source_read
from fabric_pipelines.lib.tasks.arrow_files import read_table, to_table
from fabric_pipelines.lib.tasks.catalog import (
    IngestSummary,
    attach_task_ids,
    ingest_task_set,
    write_task_ids,
)
from fabric_pipelines.lib.tasks.inbox import submit
from fabric_pipelines.lib.tasks.ingest import TokenisedTasks, ingest

MAX = 16
VOCAB = 30522


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(resolve_model_dir(DEFAULT_MODEL_ID))


def _token_ids_file(
    path: Path, lists: list[list[int] | None], ids: list[Any] | None = None
) -> Path:
    ids = ids if ids is not None else [f"id-{i}" for i in range(len(lists))]
    pq.write_table(
        pa.table({"id": ids, "token_ids": pa.array(lists, type=pa.list_(pa.int32()))}), path
    )
    return path


def _mixed(n: int, seed: int) -> list[list[int] | None]:
    """Good lists, and among them empty ones, nulls, ids outside the vocabulary, over-long ones."""
    rng = np.random.default_rng(seed)
    lists: list[list[int] | None] = []
    for _ in range(n):
        kind = rng.integers(0, 10)
        if kind == 0:
            lists.append([])
        elif kind == 1:
            lists.append(None)
        elif kind == 2:
            lists.append([101, VOCAB + int(rng.integers(0, 5)), 102])
        elif kind == 3:
            lists.append([101, *range(1000, 1000 + MAX + int(rng.integers(0, 4))), 102])
        else:
            lists.append([101, *rng.integers(1000, 2000, int(rng.integers(0, MAX - 1))), 102])
    return lists


def _ingest(db: Engine, paths: FabricPaths, name: str, **kwargs: Any) -> IngestSummary:
    return ingest_task_set(db, paths, name, model_id=DEFAULT_MODEL_ID, max_seq_len=MAX, **kwargs)


def _assert_stored_as_ingest_makes_it(
    db: Engine, summary: IngestSummary, expected: TokenisedTasks
) -> None:
    with Session(db) as session:
        row = session.scalars(select(TaskSet).where(TaskSet.name == summary.task_set)).one()
        tasks = session.execute(
            select(Task.record_no, Task.task_id)
            .where(Task.task_set_id == row.id)
            .order_by(Task.record_no)
        ).all()
        failures = session.execute(
            select(TaskFailure.record_no, TaskFailure.task_id, TaskFailure.reason)
            .where(TaskFailure.task_set_id == set_id_of(summary.task_set))
            .order_by(TaskFailure.record_no)
        ).all()
    assert [tuple(t) for t in tasks] == list(
        zip(expected.record_no.tolist(), expected.task_ids, strict=True)
    )
    assert [tuple(f) for f in failures] == [
        (f.record_no, f.task_id, f.reason) for f in expected.failures
    ]
    assert (row.n_records, row.n_tasks, row.truncated) == (
        expected.n_records,
        len(expected.task_ids),
        expected.truncated,
    )
    assert (row.content_sha256, Path(row.path)) == (summary.content_sha256, summary.path)
    assert sha256_file(summary.path) == row.content_sha256
    stored = read_table(summary.path, row.content_sha256)
    made = to_table(expected)
    for name in made.column_names:
        assert stored.column(name).equals(made.column(name)), name
    assert np.array_equal(summary.lengths, expected.lengths)


@pytest.mark.parametrize("truncate", [False, True])
def test_task_rows_end_as_ingest_makes_them(
    db: Engine, paths: FabricPaths, tmp_path: Path, tokenizer: Any, truncate: bool
) -> None:
    source = _token_ids_file(tmp_path / "mixed.parquet", _mixed(400, seed=1))
    expected = ingest(source, tokenizer, max_seq_len=MAX, truncate=truncate)
    assert 0 < len(expected.task_ids) < expected.n_records  # some records fail
    submit(source, paths.inbox, "mixed")
    summary = _ingest(db, paths, "mixed", truncate=truncate)
    assert not summary.reused and summary.n_failed == len(expected.failures)
    _assert_stored_as_ingest_makes_it(db, summary, expected)


def test_a_set_whose_records_all_fail_keeps_no_task_rows(
    db: Engine, paths: FabricPaths, tmp_path: Path, tokenizer: Any
) -> None:
    source = _token_ids_file(tmp_path / "bad.parquet", [[], None, [VOCAB], [-1, 5]])
    expected = ingest(source, tokenizer, max_seq_len=MAX)
    assert expected.task_ids == []
    submit(source, paths.inbox, "bad")
    _assert_stored_as_ingest_makes_it(db, _ingest(db, paths, "bad"), expected)


@pytest.mark.parametrize(
    "ids",
    [
        ["a", "b", "a", "c", "d", "e"],  # a repeat
        [5, 6, 7, 8, 9, 10],  # integer ids
        ["a", "", "c", "d", "e", "f"],  # an empty id
    ],
)
def test_repeated_empty_and_integer_ids(
    db: Engine, paths: FabricPaths, tmp_path: Path, tokenizer: Any, ids: list[Any]
) -> None:
    lists: list[list[int] | None] = [[101, 7592, 102], [], [101, 102], None, [101, 1, 102], [7]]
    source = _token_ids_file(tmp_path / "ids.parquet", lists, ids)
    expected = ingest(source, tokenizer, max_seq_len=MAX)
    submit(source, paths.inbox, "ids")
    _assert_stored_as_ingest_makes_it(db, _ingest(db, paths, "ids"), expected)


def test_a_failed_ingest_leaves_nothing_and_can_run_again(
    db: Engine,
    paths: FabricPaths,
    tmp_path: Path,
    tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = _token_ids_file(tmp_path / "s.parquet", _mixed(50, seed=2))
    submit(source, paths.inbox, "again")
    real_ingest = catalog.ingest

    def fails(*args: Any, **kwargs: Any) -> TokenisedTasks:
        real_ingest(*args, **kwargs)
        raise RuntimeError("tokenizer fell over")

    monkeypatch.setattr(catalog, "ingest", fails)
    with pytest.raises(RuntimeError, match="fell over"):
        _ingest(db, paths, "again")
    with Session(db) as session:
        assert session.scalars(select(TaskSet)).all() == []
        assert session.scalars(select(Task)).all() == []
        assert session.scalars(select(TaskFailure)).all() == []
    monkeypatch.undo()
    expected = ingest(source, tokenizer, max_seq_len=MAX)
    _assert_stored_as_ingest_makes_it(db, _ingest(db, paths, "again"), expected)


def test_a_file_parsed_again_from_disk_is_checked_again(
    db: Engine,
    paths: FabricPaths,
    tmp_path: Path,
    tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the bytes read first do not give the columns, ingest reads the file itself, and a
    file changed meanwhile is refused."""
    source = _token_ids_file(tmp_path / "s.parquet", _mixed(80, seed=4))
    expected = ingest(source, tokenizer, max_seq_len=MAX)
    monkeypatch.setattr(source_read, "plain_parquet", lambda data: None)
    submit(source, paths.inbox, "disk")
    _assert_stored_as_ingest_makes_it(db, _ingest(db, paths, "disk"), expected)

    submit(source, paths.inbox, "moved")
    real_ingest = catalog.ingest

    def changes_the_file(path: Path, *args: Any, **kwargs: Any) -> TokenisedTasks:
        tasks = real_ingest(path, *args, **kwargs)
        _token_ids_file(path, [[101, 102]])
        return tasks

    monkeypatch.setattr(catalog, "ingest", changes_the_file)
    with pytest.raises(catalog.SubmissionError, match="changed while it was read"):
        _ingest(db, paths, "moved")
    with Session(db) as session:
        assert session.scalars(select(TaskSet.name)).all() == ["disk"]
        assert not (paths.task_sets / "moved").exists()


# ---- read ahead (fabric submit --run) ------------------------------------------------------------


def test_a_file_read_ahead_is_ingested_as_one_read_now(
    db: Engine, paths: FabricPaths, tmp_path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ingest takes the read started ahead (it parses nothing itself) and stores what
    ingest() makes of the file; the read-ahead is taken once."""
    source = _token_ids_file(tmp_path / "ahead.parquet", _mixed(300, seed=5))
    expected = ingest(source, tokenizer, max_seq_len=MAX)
    staged = submit(source, paths.inbox, "ahead")
    source_read.read_ahead(staged.path)
    parsed_now: list[object] = []
    real_read = source_read.read_source
    monkeypatch.setattr(
        catalog, "read_source", lambda *a, **k: parsed_now.append(a) or real_read(*a, **k)
    )
    _assert_stored_as_ingest_makes_it(db, _ingest(db, paths, "ahead"), expected)
    assert parsed_now == []  # the read-ahead served it
    assert source_read.take_read_ahead(staged.path) is None  # and is gone


def test_a_read_ahead_of_a_file_since_replaced_is_not_taken(
    db: Engine, paths: FabricPaths, tmp_path: Path, tokenizer: Any
) -> None:
    """A file replaced after its read-ahead (another inode, size, mtime) is read again, so the
    ingest checks the bytes now there against the submission record and refuses them."""
    first = _token_ids_file(tmp_path / "first.parquet", _mixed(60, seed=6))
    staged = submit(first, paths.inbox, "swap")
    source_read.read_ahead(staged.path)
    replacement = _token_ids_file(tmp_path / "second.parquet", _mixed(70, seed=7))
    replacement.replace(staged.path)  # a new inode in the inbox, under the submitted name
    assert source_read.take_read_ahead(staged.path) is None
    source_read.read_ahead(first)  # a read-ahead of one path is never taken for another
    with pytest.raises(catalog.SubmissionError, match="changed after it was submitted"):
        _ingest(db, paths, "swap")
    assert source_read.take_read_ahead(first) is not None


def test_a_read_ahead_that_failed_leaves_the_ingest_to_read_the_file(
    db: Engine, paths: FabricPaths, tmp_path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _token_ids_file(tmp_path / "fails.parquet", _mixed(90, seed=8))
    expected = ingest(source, tokenizer, max_seq_len=MAX)
    staged = submit(source, paths.inbox, "fails")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("read error")

    monkeypatch.setattr(source_read, "read_source", broken)  # the read-ahead's thread's read
    source_read.read_ahead(staged.path)
    assert source_read.take_read_ahead(staged.path) is None
    source_read.read_ahead(staged.path)  # the ingest finds it failed and reads the file itself
    _assert_stored_as_ingest_makes_it(db, _ingest(db, paths, "fails"), expected)


def test_two_sets_read_ahead_at_once_each_ingest_their_own(
    db: Engine, paths: FabricPaths, tmp_path: Path, tokenizer: Any
) -> None:
    """Two threads submit, read ahead and ingest a set each at the same time (two runs in one
    process): each set gets its own file's tasks."""
    names = ("left", "right")
    files = {
        name: _token_ids_file(tmp_path / f"{name}.parquet", _mixed(200 + 50 * i, seed=10 + i))
        for i, name in enumerate(names)
    }

    def run(name: str) -> IngestSummary:
        staged = submit(files[name], paths.inbox, name)
        source_read.read_ahead(staged.path)
        return _ingest(db, paths, name)

    with ThreadPoolExecutor(2) as pool:
        summaries = dict(zip(names, pool.map(run, names), strict=True))
    for name in names:
        expected = ingest(files[name], tokenizer, max_seq_len=MAX)
        _assert_stored_as_ingest_makes_it(db, summaries[name], expected)


# ---- task ids in bulk ----------------------------------------------------------------------------


def test_task_ids_with_gaps_and_any_characters_are_written_as_given(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite takes them as JSON arrays (a few per statement here), gaps as nulls."""
    monkeypatch.setattr(catalog, "SQLITE_IDS_PER_STATEMENT", 3)
    task_ids = [
        "a", "tab\there", "ctrl\x01\x1f", "del\x7f", "sep\u2028\u2029", 'q"uote', "b\\s",
        "é😀", "\\u0000", "null", "[1]", "x" * 256, "end",
    ]  # fmt: skip
    record_no = np.array([0, 1, 5, 6, 7, 20, 21, 22, 40, 41, 42, 43, 100], dtype=np.int64)
    with db.begin() as conn:
        set_id = catalog._insert_set_row(
            conn, catalog._SetRow("ids", "0" * 64, "m", "0" * 64, 8, "", "fail")
        )
        write_task_ids(conn, set_id, record_no, task_ids)
        attach_task_ids(conn, set_id)
        rows = conn.execute(
            select(Task.record_no, Task.task_id)
            .where(Task.task_set_id == set_id)
            .order_by(Task.record_no)
        ).all()
    assert [tuple(r) for r in rows] == list(zip(record_no.tolist(), task_ids, strict=True))


def test_sqlite_takes_ids_in_any_order_and_with_nul_row_by_row(tmp_path: Path) -> None:
    from fabric_pipelines.lib.store.db import create_schema, make_engine

    db = make_engine(f"sqlite:///{tmp_path / 'ids.sqlite'}")
    create_schema(db)
    try:
        with db.begin() as conn:
            raw = conn.connection.driver_connection
            assert isinstance(raw, sqlite3.Connection)
            write_task_ids(conn, 1, np.array([5, 2, 9]), ["five", "two", "nine"])
            write_task_ids(conn, 2, np.array([0, 1]), ["nul\x00in", "plain"])
            rows = raw.execute(
                "SELECT task_set_id, record_no, task_id FROM tasks ORDER BY 1, 2"
            ).fetchall()
    finally:
        db.dispose()
    assert rows == [
        (1, 2, "two"),
        (1, 5, "five"),
        (1, 9, "nine"),
        (2, 0, "nul\x00in"),
        (2, 1, "plain"),
    ]


@pytest.mark.parametrize(
    "db_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_postgres_keeps_each_sets_ids_in_a_partition_that_forgetting_drops(
    db: Engine, paths: FabricPaths, tmp_path: Path, tokenizer: Any
) -> None:
    """Two sets ingested at once, each on its own thread: each gets its own partition (rows
    written frozen, so already visible to all), and forgetting one drops its partition only."""
    from fabric_pipelines.lib.tasks.catalog import forget_task_set

    for name, seed in (("left", 3), ("right", 4)):
        submit(
            _token_ids_file(tmp_path / f"{name}.parquet", _mixed(300, seed=seed)), paths.inbox, name
        )
    with ThreadPoolExecutor(2) as pool:
        summaries = list(pool.map(lambda name: _ingest(db, paths, name), ["left", "right"]))
    with db.connect() as conn:
        ids = {
            name: conn.execute(select(TaskSet.id).where(TaskSet.name == name)).scalar_one()
            for name in ("left", "right")
        }
        partitions = {
            row.relname: row.relallvisible
            for row in conn.execute(
                text(
                    "SELECT c.relname, c.relallvisible FROM pg_inherits i "
                    "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'tasks'::regclass"
                )
            )
        }
        counts = {
            name: conn.execute(
                select(func.count()).select_from(Task).where(Task.task_set_id == set_id)
            ).scalar_one()
            for name, set_id in ids.items()
        }
    assert set(partitions) == {f"tasks_set_{i}" for i in ids.values()}
    assert all(pages > 0 for pages in partitions.values())  # COPY FREEZE marked them
    assert counts == {s.task_set: s.n_tasks for s in summaries}
    forget_task_set(db, paths, "left")
    with db.connect() as conn:
        left = conn.execute(
            text("SELECT to_regclass(:name)"), {"name": f"tasks_set_{ids['left']}"}
        ).scalar()
        right = conn.execute(
            select(func.count()).select_from(Task).where(Task.task_set_id == ids["right"])
        ).scalar_one()
    assert left is None and right == counts["right"]
