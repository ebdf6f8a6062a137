"""Reading a model's vectors while extraction writes them, so the index step need not afterwards.

The index step reads every vector of its model back from the database (1 M x 768: 3 GB, about
4 s from SQLite on the GPU host) after extraction ends, while the GPU sits idle. A VectorTail,
started by the extraction step, reads them during extraction instead, on a thread of its own:
the rows already there once, then every few hundred milliseconds the rows committed since
(SQLite's rowids grow with each insert, so "since" is a range of rowids). Each row goes straight
to its place in id order among the ids to expect (the model's rows already there and every task
of the set), so nothing is sorted afterwards. The index step, in the same process, takes the
arrays instead of reading the table (`claim`).

That the tail holds exactly what the table holds is proved, not assumed, with the shard
watermarks (store migration 0003), which the tail registers before it reads: SQLite's triggers
raise one shard version for every row inserted or deleted and two for every row updated. In the
index step's snapshot, the versions' sum must have moved by exactly the number of rows the tail
saw arrive, and the model's row count must equal the rows it holds. A row inserted unseen (a
rowid reused after a delete), deleted, or changed breaks one of the two, and the index step
reads the table as before; so do a row of another task set arriving, a vector of another size
and any error. The tail is a head start, never a second source of truth.

Only SQLite (PostgreSQL's triggers count statements, not rows, and its rows have no order of
arrival), and only in a process that runs both steps (`fabric submit --run`, `fabric run`): a
tail not claimed within UNCLAIMED_SECONDS lets its arrays go.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from typing import Any

import numpy as np
from sqlalchemy import Connection, Engine

from fabric_pipelines.lib.index import shards
from fabric_pipelines.lib.index.vectors import ID_STRIDE, VectorSet, memory_mapped, vector_set
from fabric_pipelines.lib.store.keys import model_id, task_set_id

# The shard count the tail registers watermarks for: the versions of any one count move once
# for every row inserted or deleted.
TAIL_SHARDS = 8
POLL_SECONDS = 0.3
UNCLAIMED_SECONDS = 600.0
FETCH_ROWS = 512  # as the index's own SQLite read: blobs copied while still in the CPU's cache


class TailGaveUp(Exception):
    """What the tail saw cannot stand for the table: the index step reads the table instead."""


class _Arrivals:
    """The ids the model will hold if every task completes (ascending), their vectors as they
    arrive (allocated with the first one), and which have arrived."""

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids
        self.arrived = np.zeros(len(ids), bool)
        self.vectors: np.ndarray | None = None

    def place(self, ids: np.ndarray, blobs: list[Any]) -> None:
        at = np.searchsorted(self.ids, ids)
        if (at >= len(self.ids)).any() or not np.array_equal(self.ids[at], ids):
            raise TailGaveUp("a row of a task set other than the one extracted arrived")
        if self.arrived[at].any():
            raise TailGaveUp("a row arrived twice")
        if set(map(type, blobs)) != {bytes}:
            raise TailGaveUp("a vector not stored as bytes")
        sizes = set(map(len, blobs))
        if self.vectors is None and len(sizes) == 1 and min(sizes) % 4 == 0 and min(sizes):
            self.vectors = np.empty((len(self.ids), min(sizes) // 4), "<f4")  # the blobs' layout
        if self.vectors is None or sizes != {4 * self.vectors.shape[1]}:
            raise TailGaveUp("vectors of several sizes")
        self.vectors.view(f"S{4 * self.vectors.shape[1]}")[at, 0] = blobs
        self.arrived[at] = True

    @property
    def held(self) -> int:
        return int(self.arrived.sum())


class VectorTail:
    """The vectors of `model_key` followed while task set `task_set` is extracted (module doc)."""

    def __init__(self, db: Engine, model_key: str, task_set: str) -> None:
        self.key = (str(db.url.database), model_key)
        self._engine, self._task_set = db, task_set
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the thread's reads and the hand-over take turns
        self._error: BaseException | None = None
        self._started = time.monotonic()
        self._arrivals: _Arrivals | None = None
        self._ready = threading.Event()  # the first read is done: only snapshot reads follow
        self._model = self._versions = self._last_rowid = self._arrived_since = 0
        self._thread = threading.Thread(target=self._follow, name="fabric-vector-tail", daemon=True)
        self._thread.start()

    # -- on the tail's thread ---------------------------------------------------------------------

    def _follow(self) -> None:
        try:
            with closing(sqlite3.connect(self.key[0], isolation_level=None)) as db:
                self._first_read(db.cursor())
                while not self._stop.wait(POLL_SECONDS):
                    if time.monotonic() - self._started > UNCLAIMED_SECONDS:
                        raise TailGaveUp(f"not claimed within {UNCLAIMED_SECONDS:.0f} s")
                    with self._lock, _snapshot(db.cursor()) as cursor:
                        self._catch_up(cursor)
        except BaseException as exc:
            self._give_up(exc)

    def _first_read(self, cursor: Any) -> None:
        """Watermarks registered (committed before the snapshot), then in one snapshot: their
        sum, the last rowid, the ids to expect and the model's rows already there."""
        with self._engine.begin() as conn:
            self._model = model_id(conn, self.key[1])
            set_id = task_set_id(conn, self._task_set)
            shards.register(conn, self._model, TAIL_SHARDS)
        with self._lock, _snapshot(cursor):
            self._versions = _version_sum(cursor, self._model)
            self._last_rowid = _last_rowid(cursor)
            cursor.execute(
                "SELECT task_set_id * ? + record_no FROM embeddings WHERE model_id = ? "
                "UNION SELECT task_set_id * ? + record_no FROM tasks WHERE task_set_id = ?",
                (ID_STRIDE, self._model, ID_STRIDE, set_id),
            )
            ids = np.fromiter((row[0] for row in cursor), np.int64)
            self._arrivals = _Arrivals(np.sort(ids))
            with memory_mapped(cursor):
                self._read(cursor, "model_id = ?", (self._model,))
        self._ready.set()

    def _read(self, cursor: Any, where: str, params: tuple[Any, ...]) -> int:
        assert self._arrivals is not None
        cursor.execute(
            f"SELECT task_set_id * ? + record_no, vector FROM embeddings WHERE {where}",
            (ID_STRIDE, *params),
        )
        count = 0
        while batch := cursor.fetchmany(FETCH_ROWS):
            ids, blobs = zip(*batch, strict=True)
            self._arrivals.place(np.array(ids, np.int64), list(blobs))
            count += len(batch)
        return count

    def _catch_up(self, cursor: Any) -> None:
        """The model's rows committed since the last read: rowids above the last one seen, up
        to the last one now (read first: a row committed meanwhile waits for the next read)."""
        now = _last_rowid(cursor)
        if now > self._last_rowid:
            where = "rowid > ? AND rowid <= ? AND model_id = ?"
            self._arrived_since += self._read(cursor, where, (self._last_rowid, now, self._model))
            self._last_rowid = now

    def _give_up(self, exc: BaseException) -> None:
        self._error = exc
        self._arrivals = None  # lets go of the arrays

    # -- handing over -----------------------------------------------------------------------------

    def take(self, conn: Connection) -> VectorSet | None:
        """The model's vectors as of `conn`'s transaction (the caller's snapshot, which holds
        SQLite's write lock), or None where the tail cannot stand for the table."""
        self._stop.set()
        if not self._ready.is_set():
            # Its first read may wait for the write lock the caller holds (it registers the
            # watermarks): not waited for, and not used.
            self._give_up(TailGaveUp("its first read had not finished"))
            return None
        self.close()  # from here on it only reads snapshots, which wait for no lock
        try:
            if self._error is not None or self._arrivals is None:
                raise TailGaveUp(f"the tail stopped: {self._error}")
            raw: Any = conn.connection.driver_connection
            with closing(raw.cursor()) as cursor:
                self._catch_up(cursor)
                moved = _version_sum(cursor, self._model) - self._versions
                rows = cursor.execute(
                    "SELECT count(*) FROM embeddings WHERE model_id = ?", (self._model,)
                ).fetchone()[0]
            arrivals = self._arrivals
            if moved != self._arrived_since or rows != arrivals.held:
                raise TailGaveUp(
                    f"{moved} row changes counted against {self._arrived_since} rows seen "
                    f"arriving; {rows} rows in the table against {arrivals.held} held"
                )
            if arrivals.vectors is None:
                return None  # no rows: the table's own read says so at no cost
            ids, vectors = arrivals.ids, arrivals.vectors
            if arrivals.held < len(ids):  # tasks that failed have no row: close the gaps
                ids, vectors = ids[arrivals.arrived], vectors[arrivals.arrived]
            return vector_set(conn, self.key[1], ids, vectors.astype(np.float32, copy=False))
        except (TailGaveUp, sqlite3.Error):
            return None
        finally:
            self._give_up(self._error or TailGaveUp("handed over"))

    def close(self) -> None:
        """Stop following (the arrays stay for `take`)."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()


@contextmanager
def _snapshot(cursor: Any) -> Iterator[Any]:
    """A deferred read transaction: one snapshot of the file, no lock that writers wait on."""
    cursor.execute("BEGIN")
    try:
        yield cursor
    finally:
        cursor.execute("COMMIT")


def _version_sum(cursor: Any, model: int) -> int:
    return int(
        cursor.execute(
            "SELECT coalesce(sum(version), 0) FROM shard_watermarks "
            "WHERE model_id = ? AND n_shards = ?",
            (model, TAIL_SHARDS),
        ).fetchone()[0]
    )


def _last_rowid(cursor: Any) -> int:
    return int(cursor.execute("SELECT coalesce(max(rowid), 0) FROM embeddings").fetchone()[0])


# -- this process's tails --------------------------------------------------------------------------

_tails: dict[tuple[str, str], VectorTail] = {}
_tails_lock = threading.Lock()


@contextmanager
def following(db: Engine, model_key: str, task_set: str) -> Iterator[None]:
    """Follow `model_key`'s vectors while the block extracts `task_set` (SQLite files only), and
    keep them for the index step when the block succeeds; drop them when it raises. A tail
    replaces an unclaimed one of the same database and model."""
    tail = None
    if db.dialect.name == "sqlite" and db.url.database not in (None, "", ":memory:"):
        tail = VectorTail(db, model_key, task_set)
        with _tails_lock:
            before = _tails.pop(tail.key, None)
        if before is not None:
            before.close()
            before._give_up(TailGaveUp("replaced"))
    try:
        yield
    except BaseException:
        if tail is not None:
            tail.close()
            tail._give_up(TailGaveUp("the extraction failed"))
        raise
    if tail is not None:
        with _tails_lock:
            _tails[tail.key] = tail


def claim(conn: Connection, model_key: str) -> VectorSet | None:
    """The vectors a tail of this database and model followed, as of `conn`'s transaction; None
    where there is none or it cannot stand for the table (the caller reads the table then)."""
    if conn.dialect.name != "sqlite":
        return None
    with _tails_lock:
        tail = _tails.pop((str(conn.engine.url.database), model_key), None)
    return None if tail is None else tail.take(conn)
