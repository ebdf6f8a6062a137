"""Writing results: write-behind, batched, idempotent, and fenced by the ledger.

The drain hands each finished batch to `WriteBehind.put`, which queues it (a full queue blocks
the producer: nothing is dropped). Writer threads (two on PostgreSQL, each with its own
connection, so one builds its COPY payload while the server ingests the other's; one on SQLite,
which has a single write lock) take a few batches at a time and commit them in one transaction: first each batch's ack (accepted only with the lease's current epoch),
then the rows of the acked batches — on PostgreSQL one binary COPY built in bulk (pgcopy.py),
on SQLite one INSERT that reads the rows out of its parameters, whose shard watermarks the writer
moves itself (store/watermarks.py) — and their hidden-state shard references. A stale batch is
dropped from the group before its rows are written. RowColumns are keyed by (task set, task, model): if
a replay finds rows already there (the previous attempt committed but its reply was lost), the
group is written again ignoring those rows (PostgreSQL: through a staging table with ON CONFLICT
DO NOTHING; SQLite: row by row).

Transient database errors (lib/core/retry.py) are retried with back-off, the whole group each time
(idempotent), up to a bound; then the writer fails with an error that says how long it tried.
`before_write` may keep a batch out of its group by raising `RejectBatch` (its hidden-state file
did not verify): that batch is neither written nor acked, and `on_written` hears of it.
"""

from __future__ import annotations

import json
import queue
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from sqlalchemy import Connection, Engine, exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.dml import Insert

from fabric_gpu.variants import stored_rows
from fabric_pipelines.lib.broker.ledger import Lease, ack_many, stale_reason
from fabric_pipelines.lib.core.retry import DEFAULT_BUDGET_S, GaveUpRetrying, retry
from fabric_pipelines.lib.results.hidden_states import ShardFile
from fabric_pipelines.lib.store.db import sqlite_has_json
from fabric_pipelines.lib.store.models import HiddenStateShard
from fabric_pipelines.lib.store.pgcopy import embeddings_payload
from fabric_pipelines.lib.store.vector_columns import BYTES, NO_PGVECTOR, VectorColumns
from fabric_pipelines.lib.store.watermarks import count_inserted

COPY_EMBEDDINGS = "COPY embeddings (task_set_id, record_no, model_id, n_tokens, vector) FROM STDIN (FORMAT BINARY)"


@dataclass
class BatchRows:
    """One batch's results, ready to write."""

    lease: Lease
    task_set: str
    task_set_id: int
    model_key: str
    model_id: int
    record_no: np.ndarray  # int64 [items]
    n_tokens: np.ndarray  # int64 [items]
    pooled: np.ndarray  # float32 [items, dim], or the output variant's rows (variants.py)
    shard: ShardFile | None = None
    layers: tuple[int, ...] = ()
    # The batch's task rows and, when the engine kept hook layers, their hidden states
    # ([real tokens, hidden] per layer): `before_write` turns them into `shard`.
    task_rows: np.ndarray | None = None
    hidden_states: dict[int, np.ndarray] | None = None
    engine: str = ""  # the identity that computed the rows (fabric_gpu/engines/identity.py)


@dataclass(frozen=True)
class BatchFailed:
    """The engine failed a batch: handed to the writer like a finished one, so every outcome of
    a batch (written and acked, stale, rejected or failed) reaches the run on one thread."""

    lease: Lease
    task_rows: np.ndarray
    error: str


@dataclass
class GroupOutcome:
    acked: list[BatchRows] = field(default_factory=list)
    stale: list[tuple[BatchRows, str]] = field(default_factory=list)
    inserted: int = 0
    rejected: list[tuple[BatchRows, str]] = field(default_factory=list)  # by before_write
    failed: list[BatchFailed] = field(default_factory=list)  # by the engine


class RejectBatch(Exception):
    """Raised by `before_write` to keep a batch out of its group, with the reason."""


def write_group(
    engine: Engine,
    group: list[BatchRows],
    upsert: bool = False,
    vector_columns: VectorColumns = NO_PGVECTOR,
) -> GroupOutcome:
    """Ack and write `group` in one transaction; returns what was acked, stale and inserted."""
    outcome = GroupOutcome()
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # synchronous_commit off: safe, rows and ack commit or vanish together, and a batch
            # whose commit a crash loses is simply run again (its ack is lost with it).
            # work_mem 64MB: the watermark trigger's transition table holds the whole COPY
            # (~6 MB a group at 384-d); at the default 4MB it spills to a temp file.
            conn.exec_driver_sql(
                "SELECT set_config('synchronous_commit', 'off', true), "
                "set_config('work_mem', '64MB', true)"
            )
        # One worker's group: one engine computed it.
        engine_ids = {batch.engine for batch in group if batch.engine}
        stale = set(
            ack_many(
                conn,
                [batch.lease for batch in group],
                next(iter(engine_ids)) if len(engine_ids) == 1 else None,
            )
        )
        for batch in group:
            if batch.lease in stale:
                outcome.stale.append((batch, stale_reason(batch.lease)))
            else:
                outcome.acked.append(batch)
        if outcome.acked:
            outcome.inserted = insert_rows(
                conn, outcome.acked, upsert=upsert, vector_columns=vector_columns
            )
            shards = [_shard_row(b) for b in outcome.acked if b.shard is not None]
            if shards:
                conn.execute(_insert_shard_rows(conn), shards)
    return outcome


class RowColumns(Protocol):
    """What `insert_rows` reads of a batch (BatchRows, or lib/results/documents.py's combined rows)."""

    task_set_id: int
    model_id: int
    record_no: np.ndarray
    n_tokens: np.ndarray
    pooled: np.ndarray


def insert_rows(
    conn: Connection,
    batches: Sequence[RowColumns],
    *,
    upsert: bool = False,
    vector_columns: VectorColumns = NO_PGVECTOR,
) -> int:
    """Insert the rows of `batches` on `conn`'s transaction, into the vector column of the schema
    `vector_columns` for their dtype (store/vector_columns.py); returns how many were new (a replay,
    `upsert`, skips rows already there). The only way rows enter `embeddings`: on SQLite it also
    moves their shard watermarks."""
    targets = {vector_columns.column_for(b.pooled) for b in batches}
    column = targets.pop() if len(targets) == 1 else BYTES  # mixed encodings: all as bytes
    as_values = column != BYTES
    columns = {
        "task_set_id": np.concatenate([np.full(len(b.record_no), b.task_set_id) for b in batches]),
        "record_no": np.concatenate([b.record_no for b in batches]),
        "model_id": np.concatenate([np.full(len(b.record_no), b.model_id) for b in batches]),
        "n_tokens": np.concatenate([b.n_tokens for b in batches]),
        "vectors": np.concatenate(
            [
                np.ascontiguousarray(b.pooled) if as_values else stored_rows(b.pooled)
                for b in batches
            ]
        ),
    }
    if conn.dialect.name == "postgresql":
        payload = embeddings_payload(
            columns["task_set_id"], columns["record_no"], columns["model_id"],
            columns["n_tokens"], columns["vectors"], column=column,
        )  # fmt: skip
        statement = COPY_EMBEDDINGS.replace("vector)", f"{column})")
        raw = conn.connection.driver_connection
        assert raw is not None
        with raw.cursor() as cur:
            if not upsert:
                with cur.copy(statement) as copy:
                    copy.write(payload)
                return int(cur.rowcount)
            cur.execute(
                "CREATE TEMP TABLE IF NOT EXISTS staging_embeddings "
                "(LIKE embeddings INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
            )
            with cur.copy(statement.replace("COPY embeddings", "COPY staging_embeddings")) as copy:
                copy.write(payload)
            cur.execute(
                f"INSERT INTO embeddings (task_set_id, record_no, model_id, n_tokens, {column}) "
                f"SELECT task_set_id, record_no, model_id, n_tokens, {column} "
                "FROM staging_embeddings ON CONFLICT DO NOTHING"
            )
            return int(cur.rowcount)
    # SQLite: a plain INSERT, so a row already there fails the group, which is then replayed
    # row by row ignoring duplicates. No trigger counts inserts (migration 0006): the rows
    # inserted move their shards' watermarks here, in the same transaction.
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    if upsert:
        inserted = _insert_sqlite_ignoring_rows_there(cursor, columns)
    else:
        if _packable(columns) and sqlite_has_json():
            _insert_sqlite_in_one_step(cursor, columns)
        else:
            cursor.executemany(
                "INSERT INTO embeddings (task_set_id, record_no, model_id, n_tokens, vector) "
                "VALUES (?, ?, ?, ?, ?)",
                _sqlite_rows(columns),
            )
        inserted = np.ones(len(columns["record_no"]), dtype=bool)
    count_inserted(
        cursor,
        columns["task_set_id"][inserted],
        columns["model_id"][inserted],
        columns["record_no"][inserted],
    )
    return int(inserted.sum())


def _sqlite_rows(columns: dict[str, np.ndarray]) -> Iterator[tuple[int, int, int, int, bytes]]:
    return zip(
        columns["task_set_id"].tolist(),
        columns["record_no"].tolist(),
        columns["model_id"].tolist(),
        columns["n_tokens"].tolist(),
        (memoryview(v).tobytes() for v in columns["vectors"]),
        strict=True,
    )


def _insert_sqlite_ignoring_rows_there(cursor: Any, columns: dict[str, np.ndarray]) -> np.ndarray:
    """A replay: each row on its own, so the rows actually inserted are known (to count them).
    Rare (a commit whose reply was lost), so one statement per row is fine."""
    inserted = np.zeros(len(columns["record_no"]), dtype=bool)
    for n, row in enumerate(_sqlite_rows(columns)):
        cursor.execute(
            "INSERT OR IGNORE INTO embeddings (task_set_id, record_no, model_id, n_tokens, "
            "vector) VALUES (?, ?, ?, ?, ?)",
            row,
        )
        inserted[n] = cursor.rowcount == 1
    return inserted


# A row's record number and token count travel as one JSON integer: record_no << 24 | n_tokens.
_TOKEN_BITS = 24


def _packable(columns: dict[str, np.ndarray]) -> bool:
    """Whether the one-step insert can carry these rows: record numbers and token counts fit
    the packed JSON integer, set and model ids the grouping key's halves."""
    record_no, n_tokens = columns["record_no"], columns["n_tokens"]
    ids = np.concatenate([columns["task_set_id"], columns["model_id"]])
    return bool(
        len(record_no)
        and ids.min() >= 0
        and ids.max() < 1 << 31
        and record_no.min() >= 0
        and record_no.max() < 1 << (63 - _TOKEN_BITS)
        and n_tokens.min() >= 0
        and n_tokens.max() < 1 << _TOKEN_BITS
    )


def _insert_sqlite_in_one_step(cursor: Any, columns: dict[str, np.ndarray]) -> None:
    """The group's rows in one INSERT that reads them out of its parameters: the vectors as one
    blob (row k is bytes k*B..), record number and token count packed into one JSON array.

    SQLite then inserts the whole group in one step, without Python's GIL. executemany gives the
    GIL up and takes it back for every row: with any other busy Python thread in the process
    (the worker's drain and submit loop) each row can wait for the switch interval. Measured on
    one core with one spinning thread: 1 k rows/s for executemany, 49 k for this (72 k and 66 k
    with no other thread)."""
    set_ids, model_ids = columns["task_set_id"], columns["model_id"]
    vectors = columns["vectors"]
    packed = (columns["record_no"].astype(np.int64) << _TOKEN_BITS) | columns["n_tokens"]
    # One statement per (task set, model): a group normally holds one of each.
    keys = (set_ids.astype(np.int64) << 32) | model_ids
    distinct = np.unique(keys).tolist()
    for key in distinct:
        set_id, model = key >> 32, key & 0xFFFFFFFF
        rows = slice(None) if len(distinct) == 1 else np.flatnonzero(keys == key)
        cursor.execute(
            "INSERT INTO embeddings (task_set_id, record_no, model_id, n_tokens, vector) "
            f"SELECT ?1, r.value >> {_TOKEN_BITS}, ?2, r.value & {(1 << _TOKEN_BITS) - 1}, "
            "substr(?4, r.key * ?5 + 1, ?5) FROM json_each(?3) AS r",
            # Numbered parameters (?1 ... ?5) are named ones to sqlite3: bound from a mapping
            # (a sequence for them is deprecated since Python 3.12, an error from 3.14).
            {
                "1": set_id,
                "2": model,
                "3": "[" + ",".join(map(str, packed[rows].tolist())) + "]",
                "4": np.ascontiguousarray(vectors[rows]).tobytes(),
                "5": vectors.shape[1] * vectors.itemsize,
            },
        )


def _insert_shard_rows(conn: Connection) -> Insert:
    """One row per batch: a replay of a batch keeps its row. Another batch (of this or another
    task set) naming the same content-addressed file gets a row of its own."""
    key = [HiddenStateShard.plan_id, HiddenStateShard.batch_no]
    if conn.dialect.name == "postgresql":
        return postgresql.insert(HiddenStateShard).on_conflict_do_nothing(index_elements=key)
    if conn.dialect.name == "sqlite":
        return sqlite.insert(HiddenStateShard).on_conflict_do_nothing(index_elements=key)
    raise NotImplementedError(f"database dialect {conn.dialect.name!r} is not supported")


def _shard_row(batch: BatchRows) -> dict[str, Any]:
    assert batch.shard is not None
    return {
        "sha256": batch.shard.sha256,
        "task_set_id": batch.task_set_id,
        "model_id": batch.model_id,
        "plan_id": batch.lease.plan_id,
        "batch_no": batch.lease.batch_no,
        "layers": json.dumps(list(batch.layers)),
        "n_items": len(batch.record_no),
        "n_tokens": int(batch.n_tokens.sum()),
        "path": str(batch.shard.path),
        "bytes": batch.shard.bytes,
    }


def _driver_errors(name: str) -> tuple[type[BaseException], ...]:
    """psycopg's own error class `name` (raised as is by COPY on the raw connection)."""
    try:
        import psycopg

        return (getattr(psycopg, name),)
    except ImportError:  # pragma: no cover - psycopg is a dependency
        return ()


def is_duplicate(error: BaseException) -> bool:
    """RowColumns already written: a unique-key violation (SQLAlchemy's, or psycopg's or sqlite3's
    own, raised as is by the writer's raw cursors)."""
    return isinstance(
        error, (exc.IntegrityError, sqlite3.IntegrityError, *_driver_errors("IntegrityError"))
    )


class WriterGaveUp(GaveUpRetrying):
    pass


class WriteBehind:
    """A bounded queue and its writer threads. `on_written(outcome)` runs after each committed
    group (and for batches the engine failed, queued as BatchFailed), one call at a time;
    `before_write(batch)` may run on several writer threads at once. `close()` flushes, joins
    and re-raises a writer failure."""

    def __init__(
        self,
        engine: Engine,
        on_written: Callable[[GroupOutcome], None],
        *,
        max_batches: int = 16,
        group_batches: int = 8,
        writers: int | None = None,
        attempts: int | None = None,
        budget_s: float = DEFAULT_BUDGET_S,
        first_backoff_s: float = 0.25,
        max_backoff_s: float = 5.0,
        before_write: Callable[[BatchRows], None] | None = None,
    ) -> None:
        self._engine = engine
        self._on_written = on_written
        self._before_write = before_write
        self._queue: queue.Queue[BatchRows | BatchFailed | None] = queue.Queue(maxsize=max_batches)
        self._group = group_batches
        self._attempts = attempts
        self._budget_s = budget_s
        self._backoff = (first_backoff_s, max_backoff_s)
        self._error: BaseException | None = None
        self._columns: VectorColumns | None = None  # asked of the schema at the first write
        self._lock = threading.Lock()  # serialises on_written and the retry count
        self.retries = 0
        if writers is None:
            writers = 2 if engine.dialect.name == "postgresql" else 1
        if writers < 1:
            raise ValueError(f"writers must be at least 1, got {writers}")
        self._threads = [
            threading.Thread(target=self._run, name=f"fabric-writer-{n}", daemon=True)
            for n in range(writers)
        ]
        for thread in self._threads:
            thread.start()

    def put(self, batch: BatchRows | BatchFailed) -> None:
        """Queue a batch; blocks while the queue is full. Raises if the writer has failed."""
        if self._error is not None:
            raise self._error
        self._queue.put(batch)

    def flush(self) -> None:
        """Wait until everything queued so far is written; re-raise a writer failure."""
        self._queue.join()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        for _ in self._threads:  # one end mark per thread: each stops at the first it takes
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        done = False
        while not done:
            first = self._queue.get()
            if first is None:
                self._queue.task_done()
                return
            items = [first]
            while len(items) < self._group:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.task_done()
                    done = True
                    break
                items.append(item)
            group = [item for item in items if isinstance(item, BatchRows)]
            failed = [item for item in items if isinstance(item, BatchFailed)]
            try:
                if self._error is None:  # after a failure, keep draining: producers never block
                    rejected: list[tuple[BatchRows, str]] = []
                    if self._before_write is not None:
                        kept = []
                        for batch in group:
                            try:
                                self._before_write(batch)
                                kept.append(batch)
                            except RejectBatch as why:
                                rejected.append((batch, str(why)))
                        group = kept
                    outcome = self._write_with_retries(group) if group else GroupOutcome()
                    outcome.rejected = rejected
                    outcome.failed = failed
                    with self._lock:
                        self._on_written(outcome)
            except BaseException as error:
                self._error = error
            finally:
                for _ in items:
                    self._queue.task_done()

    def _write_with_retries(self, group: list[BatchRows]) -> GroupOutcome:
        upsert = False

        def attempt() -> GroupOutcome:
            nonlocal upsert
            if self._columns is None:
                self._columns = VectorColumns.of_engine(self._engine)
            try:
                return write_group(self._engine, group, upsert=upsert, vector_columns=self._columns)
            except Exception as error:
                if not is_duplicate(error) or upsert:
                    raise
            upsert = True  # rows already there: an earlier attempt committed; replay
            return write_group(self._engine, group, upsert=True, vector_columns=self._columns)

        def retrying(_error: BaseException) -> None:
            nonlocal upsert
            with self._lock:
                self.retries += 1
            upsert = True  # the lost attempt may have committed

        first, cap = self._backoff
        return retry(
            f"writing {len(group)} batch(es)",
            attempt,
            budget_s=self._budget_s,
            attempts=self._attempts,
            first_backoff_s=first,
            max_backoff_s=cap,
            on_retry=retrying,
            gave_up=WriterGaveUp,
        )
