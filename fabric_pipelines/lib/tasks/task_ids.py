"""A new task set's ids, written into the database inside its ingest's transaction.

Writing a million ids takes the database a second or two. Most of them are known before the
file's tokens are read: a row whose id is good and no other row's becomes a task with that id,
unless its tokens or text fail. So the ingest writes those ids (`ingest.parquet_ids_known_early`) while the
tokens are still being read and checked, then removes the rows that failed and adds the tasks
that were not among them (`corrections`): the table ends as if every task's id had been written
after the check, in one transaction either way.

`TaskIdWriter` does the writing: on PostgreSQL a COPY of a CSV that Arrow writes, into the set's
own table, keyed once filled and attached as its partition of `tasks` (store/task_partitions.py);
on SQLite an INSERT from a JSON array of ids per statement (SQLite reads it in C, no Python per
row). On SQLite, writing early means the ingest holds the database's write lock while the tokens
are read (a second or two at 1 M token-id tasks; longer for text, which is tokenised meanwhile).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from fabric_pipelines.lib.store import task_partitions
from fabric_pipelines.lib.store.db import sqlite_has_json

# SQLite page cache while task ids are inserted, in KiB (the default is 2 MiB).
SQLITE_INSERT_CACHE_KIB = 256 * 1024
# Task ids per INSERT statement on SQLite (one JSON array each): a few MB of text.
SQLITE_IDS_PER_STATEMENT = 1 << 18


class TaskIdWriter:
    """Writes one new set's task ids through `conn` (the ingest's transaction): `write` any
    number of times (record numbers not written before), `remove` rows written that are no
    tasks, then `key` and, last in the transaction, `attach`."""

    def __init__(self, conn: Any, set_id: int) -> None:
        self._conn, self._set_id = conn, set_id
        self._postgres = conn.dialect.name == "postgresql"
        if self._postgres:
            with self._cursor() as cursor:
                task_partitions.create(cursor, set_id)

    def write(self, record_no: np.ndarray, task_ids: Sequence[str] | pa.Array) -> None:
        if len(record_no) == 0:
            return
        if self._postgres:
            table = pa.table(
                {
                    "task_set_id": pa.array(np.full(len(record_no), self._set_id, np.int32)),
                    "record_no": pa.array(record_no, type=pa.int64()),
                    "task_id": pa.array(task_ids, type=pa.string()),
                }
            )
            sink = pa.BufferOutputStream()
            pa_csv.write_csv(table, sink, pa_csv.WriteOptions(include_header=False))
            with self._cursor() as cursor:
                task_partitions.copy_rows(cursor, self._set_id, memoryview(sink.getvalue()))
            return
        ids = task_ids.to_pylist() if isinstance(task_ids, pa.Array) else list(task_ids)
        _sqlite_insert(self._conn, self._set_id, record_no, ids)

    def remove(self, record_no: np.ndarray) -> None:
        if len(record_no) == 0:
            return
        numbers = [int(r) for r in record_no]
        if self._postgres:
            with self._cursor() as cursor:
                task_partitions.remove(cursor, self._set_id, numbers)
            return
        cursor = self._conn.connection.driver_connection.cursor()
        cursor.executemany(
            "DELETE FROM tasks WHERE task_set_id = ? AND record_no = ?",
            [(self._set_id, r) for r in numbers],
        )

    def key(self) -> None:
        """PostgreSQL: the set's table keyed, now that it is filled (SQLite keyed as it went)."""
        if self._postgres:
            with self._cursor() as cursor:
                task_partitions.add_keys(cursor, self._set_id)

    def attach(self) -> None:
        """PostgreSQL: the set's table becomes its partition of `tasks`; last in the
        transaction, as the lock this takes lasts until the commit."""
        if self._postgres:
            with self._cursor() as cursor:
                task_partitions.attach(cursor, self._set_id)

    def _cursor(self) -> Any:
        return self._conn.connection.driver_connection.cursor()


def write_task_ids(conn: Any, set_id: int, record_no: np.ndarray, task_ids: list[str]) -> None:
    """Every task id of a new set at once (`TaskIdWriter`: written, keyed, attached)."""
    writer = TaskIdWriter(conn, set_id)
    writer.write(record_no, task_ids)
    writer.key()
    writer.attach()


def corrections(
    early_rows: np.ndarray, early_ids: pa.Array, task_rows: np.ndarray, task_ids: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """What makes the early rows the tasks: (record numbers to remove, positions of the tasks
    to add). A task stays as written early only with the same record number and id. Both
    record-number arrays ascend."""
    at = np.searchsorted(early_rows, task_rows)
    inside = at < len(early_rows)
    written = np.zeros(len(task_rows), dtype=bool)
    written[inside] = early_rows[at[inside]] == task_rows[inside]
    if written.any():
        tasks = np.flatnonzero(written)
        same = pc.equal(
            early_ids.take(pa.array(at[tasks])), pa.array(task_ids, pa.string()).take(tasks)
        )
        written[tasks] = same.to_numpy(zero_copy_only=False)
    kept = np.zeros(len(early_rows), dtype=bool)
    kept[at[written]] = True
    return early_rows[~kept], np.flatnonzero(~written)


def _sqlite_insert(conn: Any, set_id: int, record_no: np.ndarray, task_ids: list[str]) -> None:
    cursor = conn.connection.driver_connection.cursor()
    # Ids in no particular order land all over the unique index on (set, id): a page cache that
    # holds the index saves re-reading its pages (a third less time for 1 M random ids). The
    # cache size belongs to the pooled connection, so it is put back after.
    (cache_size,) = cursor.execute("PRAGMA cache_size").fetchone()
    cursor.execute(f"PRAGMA cache_size = {-SQLITE_INSERT_CACHE_KIB}")
    try:
        if sqlite_has_json() and bool(np.all(np.diff(record_no) > 0)):
            _insert_json_arrays(cursor, set_id, record_no, task_ids)
        else:
            _insert_rows(cursor, set_id, record_no, task_ids)
    finally:
        cursor.execute(f"PRAGMA cache_size = {int(cache_size)}")


def _insert_rows(cursor: Any, set_id: int, record_no: np.ndarray, task_ids: list[str]) -> None:
    cursor.executemany(
        "INSERT INTO tasks (task_set_id, record_no, task_id) VALUES (?, ?, ?)",
        zip([set_id] * len(task_ids), record_no.tolist(), task_ids, strict=True),
    )


def _insert_json_arrays(
    cursor: Any, set_id: int, record_no: np.ndarray, task_ids: list[str]
) -> None:
    """Per statement, a JSON array holding the ids of a run of consecutive record numbers
    (null for a record that is no task); the array index gives the record number. `record_no`
    ascends."""
    for start in range(0, len(task_ids), SQLITE_IDS_PER_STATEMENT):
        stop = min(start + SQLITE_IDS_PER_STATEMENT, len(task_ids))
        first = int(record_no[start])
        span = int(record_no[stop - 1]) - first + 1
        ids: list[Any] = task_ids[start:stop]
        if span != stop - start:
            slots = np.full(span, None, dtype=object)
            slots[record_no[start:stop] - first] = ids
            ids = slots.tolist()
        text = json.dumps(ids, ensure_ascii=False)
        if "\\u0000" in text:  # a NUL, as SQLite's JSON reader may not give it back: bind it
            _insert_rows(cursor, set_id, record_no[start:stop], task_ids[start:stop])
            continue
        cursor.execute(
            "INSERT INTO tasks (task_set_id, record_no, task_id) "
            "SELECT ?, ? + key, value FROM json_each(?) WHERE type = 'text'",
            (set_id, first, text),
        )
