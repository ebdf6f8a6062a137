"""Reading a model's vectors while extraction writes them, so the index step need not afterwards.

The index step reads every vector of its model back from the database (1 M x 768: 3 GB, 4-6 s
from SQLite and about 10 s from PostgreSQL on the GPU host) after extraction ends, while the GPU
sits idle. A VectorTail, started by the extraction step, reads them during extraction instead,
on a thread of its own: the model's rows already there once, then every few hundred milliseconds
the rows committed since. SQLite's rowids grow with each insert, so there "since" is a range of
rowids; on PostgreSQL a batch's rows land in the transaction that acknowledges it, so "since" is
the batches of the set's plan acknowledged since, whose tasks the plan names. Each row goes
straight to its place in id order among the ids to expect (the model's rows already there and
every task of the set), so nothing is sorted afterwards. A task that reuses another's result
(a link, broker/reuse.py) holds no row: its place takes its source's vector as soon as the source
is there (at the first read for a result stored before, on arrival for a repeat inside the set),
so the arrays hold one row per task, as the index does, and the index can be made ready while
they fill (index/prebuild.py). The index step, in the same process, takes the arrays instead of
reading the table (`claim`).

That the tail holds exactly what the table holds is proved, not assumed, with the shard
watermarks, which the tail registers before it reads: every row the writer inserts and every row
deleted moves the versions of one shard by one, every row updated by two (store/watermarks.py).
In one snapshot taken at the hand-over, the versions' sum must have moved by exactly the number
of rows the tail saw arrive, and the model's row count must equal the rows it holds. A row
inserted unseen (a rowid reused after a delete; a row written by another run), inserted by hand
(SQLite counts only the writer's inserts), deleted, or changed breaks one of the two, and the index step reads the table as before; so do a row of
another task set arriving, a vector of another size, a link made or dropped since the first
read (their count and sums are compared), and any error. The tail is a head start, never a
second source of truth.

Only in a process that runs both steps, one after the other (`fabric submit --run`, `fabric run`
say so with `follow_in_this_process()`): under Dagster's multiprocess or Kubernetes executors
each step has a process of its own and nothing would claim the arrays. A tail not claimed within
UNCLAIMED_SECONDS of the extraction's end lets them go.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import closing, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from sqlalchemy import Connection, Engine, text

from fabric_gpu.variants import variant_of_model_key
from fabric_pipelines.lib.broker.ledger import COMPLETED
from fabric_pipelines.lib.broker.plans import current_plan, load_plan_order
from fabric_pipelines.lib.core.retry import retry
from fabric_pipelines.lib.index import shards
from fabric_pipelines.lib.index.copy_rows import vector_rows
from fabric_pipelines.lib.index.paths import model_index_folder
from fabric_pipelines.lib.index.vectors import (
    DOCUMENTS,
    ID_STRIDE,
    LINK_PAIRS_SQL,
    LINKS_WITHOUT_ROWS,
    VectorSet,
    copy_records_sql,
    copy_sql,
    memory_mapped,
    read_only_connection,
    vector_set,
)
from fabric_pipelines.lib.records.vector_codec import StoredCodec
from fabric_pipelines.lib.store.keys import model_id, task_set_id
from fabric_pipelines.lib.store.schema import has_pgvector_column
from fabric_pipelines.lib.tasks.arrow_files import read_table
from fabric_pipelines.lib.tasks.catalog import get_task_set

if TYPE_CHECKING:
    from fabric_pipelines.lib.index.prebuild import Prebuild, Prebuilt

log = logging.getLogger(__name__)

# The shard count the tail registers watermarks for: the versions of any one count move once
# for every row inserted or deleted.
TAIL_SHARDS = 8
POLL_SECONDS = 0.3
UNCLAIMED_SECONDS = 120.0
FETCH_ROWS = 512  # as the index's own SQLite read: blobs copied while still in the CPU's cache
LOCK_WAIT_MS = 5000  # PostgreSQL: the longest the registration waits for writes under way
SLOW_HAND_OVER_SECONDS = 10.0  # a hand-over slower than this is logged, with why


FLOAT32_ROWS = np.dtype("<f4")  # how plain rows are stored, and kept as they arrive


class TailGaveUp(Exception):
    """What the tail saw cannot stand for the table: the index step reads the table instead."""


class _Arrivals:
    """The ids the model will hold if every task completes (ascending), their vectors as they
    arrive (allocated with the first one), and which have arrived. `row_dtype`: the stored
    layout, little-endian float32; an output variant's rows are kept as their bytes (uint8) and
    decoded at the hand-over."""

    def __init__(self, ids: np.ndarray, row_dtype: np.dtype[Any] = FLOAT32_ROWS) -> None:
        self.ids = ids
        self.arrived = np.zeros(len(ids), bool)
        self.vectors: np.ndarray | None = None
        self.row_dtype = row_dtype

    def _places(self, ids: np.ndarray, dim: int) -> np.ndarray:
        at = np.searchsorted(self.ids, ids)
        if (at >= len(self.ids)).any() or not np.array_equal(self.ids[at], ids):
            raise TailGaveUp("a row of a task set other than the one extracted arrived")
        if self.arrived[at].any():
            raise TailGaveUp("a row arrived twice")
        if self.vectors is None and dim > 0:
            self.vectors = np.empty((len(self.ids), dim), self.row_dtype)  # the stored layout
        if self.vectors is None or self.vectors.shape[1] != dim:
            raise TailGaveUp("vectors of several sizes")
        self.arrived[at] = True
        return at

    def place_blobs(self, ids: np.ndarray, blobs: list[Any]) -> None:
        """SQLite's rows: each vector's stored bytes (float32: 4 * dim of little-endian)."""
        if set(map(type, blobs)) != {bytes}:
            raise TailGaveUp("a vector not stored as bytes")
        sizes = set(map(len, blobs))
        size = min(sizes)
        if len(sizes) != 1 or size % self.row_dtype.itemsize:
            raise TailGaveUp("vectors of several sizes")
        at = self._places(ids, size // self.row_dtype.itemsize)
        assert self.vectors is not None
        self.vectors.view(f"S{size}")[at, 0] = blobs

    def place(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """PostgreSQL's rows, decoded from a binary COPY (index/copy_rows.py)."""
        at = self._places(ids, vectors.shape[1])
        assert self.vectors is not None
        self.vectors[at] = vectors

    def copy_rows(self, sources: np.ndarray, targets: np.ndarray) -> None:
        """Places `targets` take the vectors of places `sources` (arrived): reused results."""
        assert self.vectors is not None
        if self.arrived[targets].any():
            raise TailGaveUp("a row arrived for a task that reuses another's result")
        self.vectors[targets] = self.vectors[sources]
        self.arrived[targets] = True

    @property
    def held(self) -> int:
        return int(self.arrived.sum())

    def compacted(self) -> tuple[np.ndarray, np.ndarray]:
        """The ids and vectors that arrived, in id order: tasks that failed have no row, so
        later rows move up over their places, in the same array (a copy would double the
        memory). Row j moves to i <= j, and chunks go in order, so no row is overwritten before
        it has moved."""
        assert self.vectors is not None
        held = self.held
        if held == len(self.ids):
            return self.ids, self.vectors
        rows = np.flatnonzero(self.arrived)
        for start in range(0, held, 65536):
            chunk = rows[start : start + 65536]
            self.vectors[start : start + len(chunk)] = self.vectors[chunk]
        return self.ids[rows], self.vectors[:held]


# What the links the tail placed must still add up to at the hand-over (_Links.digest).
LINKS_DIGEST_SQL = (
    "SELECT count(*), coalesce(sum(r.task_set_id), 0), coalesce(sum(r.record_no), 0), "
    "coalesce(sum(r.from_task_set_id), 0), coalesce(sum(r.from_record_no), 0) " + LINKS_WITHOUT_ROWS
)


class _Links:
    """Tasks that reuse another task's result hold no row: each takes its source's vector in its
    own place as soon as the source is there (at the first read for a result stored before; as
    it arrives for a repeat inside the set, linked to its first), so the arrays hold one row per
    task as the index does, and the index can be made ready while they arrive."""

    def __init__(self, arrivals: _Arrivals, targets: np.ndarray, sources: np.ndarray) -> None:
        ids = arrivals.ids
        self.targets = np.searchsorted(ids, targets)
        self.sources = np.minimum(np.searchsorted(ids, sources), max(len(ids) - 1, 0))
        if len(sources) and not np.array_equal(ids[self.sources], sources):
            raise TailGaveUp("a reused result's source is none of the rows expected")
        self.waiting = np.ones(len(targets), bool)
        self.placed = 0
        # What the table's links must still add up to at the hand-over (LINKS_DIGEST_SQL).
        self.digest = (
            len(targets),
            int((targets // ID_STRIDE).sum()),
            int((targets % ID_STRIDE).sum()),
            int((sources // ID_STRIDE).sum()),
            int((sources % ID_STRIDE).sum()),
        )

    def place(self, arrivals: _Arrivals) -> None:
        ready = self.waiting & arrivals.arrived[self.sources]
        if ready.any():
            arrivals.copy_rows(self.sources[ready], self.targets[ready])
            self.waiting[ready] = False
            self.placed += int(ready.sum())


class VectorTail:
    """The vectors of `model_key` followed while task set `task_set` is extracted (module doc).
    Subclasses say how to read a snapshot, and what arrived since the last one."""

    def __init__(
        self,
        db: Engine,
        model_key: str,
        task_set: str,
        index_settings: Mapping[str, Any] | None = None,
        index_folder: Path | None = None,
        receipt_model: Mapping[str, Any] | None = None,
    ) -> None:
        self.key = _key(db, model_key)
        # The index made ready as the rows arrive (index/prebuild.py), for this IndexSpec's build;
        # with the served index's quantizer where that build will reuse it (the index folder and
        # the model as receipts record it say which).
        self._index_settings = index_settings
        self._index_folder, self._receipt_model = index_folder, dict(receipt_model or {})
        self._prebuild: Prebuild | None = None
        self.prebuilt: Prebuilt | None = None  # what the hand-over found ready
        self._engine, self._task_set = db, task_set
        self._variant = bool(variant_of_model_key(model_key).key_suffix)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the thread's reads and the hand-over take turns
        self._ready = threading.Event()  # the first read is done: only snapshot reads follow
        self._error: BaseException | None = None
        self.kept_at: float | None = None  # monotonic time the extraction ended and kept it
        self._arrivals: _Arrivals | None = None
        self._links: _Links | None = None
        self._model = self._set = self._versions = self._arrived_since = 0
        self.read_at_hand_over = 0  # rows the hand-over itself read: the tail was behind by these
        self._thread = threading.Thread(target=self._follow, name="fabric-vector-tail", daemon=True)
        self._thread.start()

    # -- what each database says ------------------------------------------------------------------

    def _connect(self) -> Any:
        raise NotImplementedError

    def _snapshot(self, db: Any) -> Any:
        """A context: one consistent snapshot of the database; yields a cursor."""
        raise NotImplementedError

    def _mark(self, cursor: Any) -> None:
        """Note, in the first snapshot, where arrivals start."""
        raise NotImplementedError

    def _read_model_rows(self, cursor: Any) -> None:
        raise NotImplementedError

    def _catch_up(self, cursor: Any) -> None:
        """Place the model's rows committed since the last snapshot; count them."""
        raise NotImplementedError

    def _query(self, cursor: Any, sql: str, params: tuple[Any, ...]) -> Any:
        raise NotImplementedError

    def _prepare(self) -> None:
        """Anything read once, before the first snapshot."""

    def _hold_writers(self, conn: Connection) -> None:
        """Inside the registration's transaction: no write may be under way whose watermark
        update ran before the new watermark rows were there (it would not count its rows).
        SQLite needs nothing: every transaction here, the writers' too, holds its one write
        lock from its first statement."""

    # -- on the tail's thread ---------------------------------------------------------------------

    def _follow(self) -> None:
        try:
            with closing(self._connect()) as db:
                # A unit of its own (this thread's): registering the watermarks is idempotent.
                retry(
                    f"starting to follow the vectors of {self.key[1]}", lambda: self._first_read(db)
                )
                while not self._stop.wait(POLL_SECONDS):
                    kept_at = self.kept_at
                    if kept_at is not None and time.monotonic() - kept_at > UNCLAIMED_SECONDS:
                        raise TailGaveUp(f"not claimed within {UNCLAIMED_SECONDS:.0f} s")
                    with self._lock:
                        with self._snapshot(db) as cursor:
                            self._catch_up(cursor)
                        self._place_links()
                        self._advance_prebuild()
        except BaseException as exc:  # kept, never raised: the hand-over reads the table then
            self._give_up(exc)

    def _first_read(self, db: Any) -> None:
        """Watermarks registered (committed before the snapshot), then in one snapshot: their
        sum, where arrivals start, the ids to expect and the model's rows already there."""
        with self._engine.begin() as conn:
            self._model = model_id(conn, self.key[1])
            self._set = task_set_id(conn, self._task_set)
            self._hold_writers(conn)
            shards.register(conn, self._model, TAIL_SHARDS)
        self._prepare()
        self._check_stopped()
        with self._lock, self._snapshot(db) as cursor:
            self._versions = self._version_sum(cursor)
            self._mark(cursor)
            ids = self._query(
                cursor,
                "SELECT task_set_id * {s} + record_no FROM embeddings WHERE model_id = {p} AND "
                + DOCUMENTS
                + " UNION SELECT task_set_id * {s} + record_no FROM tasks WHERE task_set_id = {p}",
                (self._model, self._set),
            )
            expected = np.fromiter((row[0] for row in ids), np.int64)
            links = self._query(cursor, LINK_PAIRS_SQL, (self._model,))
            pairs = np.array([tuple(row) for row in links], dtype=np.int64).reshape(-1, 2)
            # An output variant's rows are kept as bytes; decoded at the hand-over.
            layout = np.dtype(np.uint8) if self._variant else FLOAT32_ROWS
            self._arrivals = _Arrivals(np.union1d(expected, pairs[:, 0]), layout)
            self._links = _Links(self._arrivals, pairs[:, 0], pairs[:, 1])
            self._read_model_rows(cursor)
            self._place_links()
        if self._index_settings is not None and not self._variant:
            from fabric_pipelines.lib.index.build import IndexSpec, sized_for
            from fabric_pipelines.lib.index.prebuild import Prebuild
            from fabric_pipelines.lib.index.quantizers import reusable_quantizer

            spec = sized_for(IndexSpec(**self._index_settings), len(self._arrivals.ids))
            reuse = None
            if self._index_folder is not None and self._arrivals.vectors is not None:
                reuse = reusable_quantizer(
                    self._engine, self.key[1], spec, self._index_folder, self._receipt_model,
                    self._arrivals.vectors.shape[1],
                )  # fmt: skip
            # Advanced by the polls from here on, not in the first read: preparing and assigning
            # every row already there (a rerun's reused results: most of them) may outlast a
            # short extraction, and a hand-over finds a first read unfinished unusable.
            self._prebuild = Prebuild(spec, self._arrivals.ids, reuse)
        self._ready.set()

    def _place_links(self) -> None:
        if self._links is not None and self._arrivals is not None:
            self._links.place(self._arrivals)

    def _advance_prebuild(self) -> None:
        if self._prebuild is not None and self._arrivals is not None:
            self._prebuild.advance(self._arrivals.vectors, self._arrivals.arrived)
            # Every row in: finish the index while the extraction step closes (prebuild.py).
            vectors, folder = self._arrivals.vectors, self._index_folder
            if vectors is not None and folder is not None and _min_recall is not None:
                self._prebuild.start_finishing(
                    vectors, model_index_folder(folder, self.key[1]), _min_recall
                )
            # The rows' digests last: beside the finish, never ahead of it (row_summary.py).
            self._prebuild.summarise(self._arrivals.arrived)

    def _version_sum(self, cursor: Any) -> int:
        rows = self._query(
            cursor,
            "SELECT coalesce(sum(version), 0) FROM shard_watermarks "
            "WHERE model_id = {p} AND n_shards = {p}",
            (self._model, TAIL_SHARDS),
        )
        return int(next(iter(rows))[0])

    def wait_until_following(self, timeout: float) -> bool:
        """Whether the first read finished within `timeout` seconds (from then on every row
        committed is seen arriving)."""
        return self._ready.wait(timeout)

    def _check_stopped(self) -> None:
        """On the tail's thread: a tail given up while on its first read stops reading. A poll's
        read runs to its end: the hand-over joins this thread and takes what it read (stopping
        it there gave up a tail whose hand-over came while a poll read its last rows)."""
        if (
            self._stop.is_set()
            and not self._ready.is_set()
            and threading.current_thread() is self._thread
        ):
            raise TailGaveUp("stopped")

    def _give_up(self, exc: BaseException) -> None:
        self._error = exc
        self._arrivals = None  # lets go of the arrays
        if self._prebuild is not None and not self._prebuild.why_not:
            self._prebuild.give_up(str(exc))

    # -- handing over -----------------------------------------------------------------------------

    def take(self, conn: Connection) -> VectorSet | None:
        """The model's vectors as of one snapshot taken now (`conn`: the index step's own
        connection, in its transaction), or None where the tail cannot stand for the table."""
        self._stop.set()
        if not self._ready.is_set():
            # Its first read may wait for a lock the caller holds (it registers watermarks,
            # a write): not waited for, and not used.
            self._give_up(TailGaveUp("its first read had not finished"))
            return None
        self._thread.join()  # from here on it only read snapshots, which wait for no lock
        try:
            if self._error is not None or self._arrivals is None:
                raise TailGaveUp(f"the tail stopped: {self._error}")
            with self._hand_over_snapshot(conn) as cursor:
                before = self._arrived_since
                self._catch_up(cursor)
                self.read_at_hand_over = self._arrived_since - before
                moved = self._version_sum(cursor) - self._versions
                count = self._query(
                    cursor,
                    f"SELECT count(*) FROM embeddings WHERE model_id = {{p}} AND {DOCUMENTS}",
                    (self._model,),
                )
                rows = int(next(iter(count))[0])
                digest = tuple(int(v) for v in next(iter(
                    self._query(cursor, LINKS_DIGEST_SQL, (self._model,))
                )))  # fmt: skip
            arrivals, links = self._arrivals, self._links
            assert links is not None
            self._place_links()
            stored = arrivals.held - links.placed  # rows of the table, not reused places
            if moved != self._arrived_since or rows != stored:
                raise TailGaveUp(
                    f"{moved} row changes counted against {self._arrived_since} rows seen "
                    f"arriving; {rows} rows in the table against {stored} held"
                )
            # Links made or dropped since the first read (they move the watermarks on
            # PostgreSQL; SQLite counts only inserts): the places would not be the table's.
            if digest != links.digest:
                raise TailGaveUp("the reused results' links changed since the first read")
            if arrivals.vectors is None:  # no rows: the table's own read says so at no cost
                self._error = TailGaveUp("no rows arrived")
                return None
            if self._prebuild is not None:  # before compacting: it follows the rows' places
                self.prebuilt = self._prebuild.finish(arrivals.vectors, arrivals.arrived)
            # Tasks that reused a stored result hold their source's vector already (_Links).
            ids, vectors = arrivals.compacted()
            if self._variant:
                # Read now, not at the start: an int8 key's first run records its calibration
                # while it extracts. The same decoding as the table's read (vectors.py).
                codec = StoredCodec.of_key(conn, self.key[1])
                values = codec.values(vectors.view(codec.variant.numpy_dtype))
                return vector_set(conn, self.key[1], ids, np.ascontiguousarray(values, np.float32))
            return vector_set(conn, self.key[1], ids, vectors.astype(np.float32, copy=False))
        except Exception as exc:  # any doubt: the index step reads the table as it always did
            if self._error is None:
                self._error = exc
            return None
        finally:
            self._give_up(self._error or TailGaveUp("handed over"))

    def _hand_over_snapshot(self, conn: Connection) -> Any:
        raise NotImplementedError

    @property
    def why(self) -> str:
        """Why the tail stopped (after the hand-over: "handed over")."""
        return str(self._error) if self._error is not None else "following"

    def close(self) -> None:
        """Stop following and let the arrays go."""
        self._stop.set()
        if self._ready.is_set() and threading.current_thread() is not self._thread:
            self._thread.join()
        self._give_up(self._error or TailGaveUp("closed"))


class _SqliteTail(VectorTail):
    """SQLite: the rows committed since are those above the last rowid seen."""

    _last_rowid = 0

    def _connect(self) -> Any:
        return sqlite3.connect(str(self._engine.url.database), isolation_level=None)

    @contextmanager
    def _snapshot(self, db: Any) -> Iterator[Any]:
        """A deferred read transaction: one snapshot of the file, no lock writers wait on."""
        cursor = db.cursor()
        cursor.execute("BEGIN")
        try:
            yield cursor
        finally:
            cursor.execute("COMMIT")
            cursor.close()

    @contextmanager
    def _hand_over_snapshot(self, conn: Connection) -> Iterator[Any]:
        # The index step's transaction holds SQLite's write lock: its view is the file's latest.
        raw: Any = conn.connection.driver_connection
        with closing(raw.cursor()) as cursor:
            yield cursor

    def _query(self, cursor: Any, sql: str, params: tuple[Any, ...]) -> Any:
        return cursor.execute(sql.format(s=ID_STRIDE, p="?"), params)

    def _mark(self, cursor: Any) -> None:
        self._last_rowid = _last_rowid(cursor)

    def _read_model_rows(self, cursor: Any) -> None:
        with memory_mapped(cursor):
            self._read(cursor, f"model_id = ? AND {DOCUMENTS}", (self._model,))

    def _read(self, cursor: Any, where: str, params: tuple[Any, ...]) -> int:
        assert self._arrivals is not None
        cursor.execute(
            f"SELECT task_set_id * ? + record_no, vector FROM embeddings WHERE {where}",
            (ID_STRIDE, *params),
        )
        count = 0
        while batch := cursor.fetchmany(FETCH_ROWS):
            self._check_stopped()
            ids, blobs = zip(*batch, strict=True)
            self._arrivals.place_blobs(np.array(ids, np.int64), list(blobs))
            count += len(batch)
        return count

    def _catch_up(self, cursor: Any) -> None:
        # Up to the last rowid now, read first: a row committed meanwhile waits for next time.
        now = _last_rowid(cursor)
        if now > self._last_rowid:
            where = f"rowid > ? AND rowid <= ? AND model_id = ? AND {DOCUMENTS}"
            self._arrived_since += self._read(cursor, where, (self._last_rowid, now, self._model))
            self._last_rowid = now


def _last_rowid(cursor: Any) -> int:
    return int(cursor.execute("SELECT coalesce(max(rowid), 0) FROM embeddings").fetchone()[0])


class _PostgresTail(VectorTail):
    """PostgreSQL: a batch's rows commit with its acknowledgement, so the rows committed since
    are those of the plan's batches acknowledged since, whose tasks the plan file names."""

    _acked: set[int]  # batches whose rows the tail has read (or found there at its start)

    def _prepare(self) -> None:
        plan = current_plan(self._engine, self._task_set)
        stored = get_task_set(self._engine, self._task_set)
        record_no = read_table(Path(stored.path), stored.content_sha256).column("record_no")
        # The record number of each plan item, in plan order (a batch is a run of items).
        self._plan_id = plan.plan_id
        self._records = record_no.to_numpy()[load_plan_order(Path(plan.path), plan.sha256)]
        with self._engine.connect() as conn:
            self._pgvector = has_pgvector_column(conn)

    def _hold_writers(self, conn: Connection) -> None:
        # SHARE waits for the writes under way (ROW EXCLUSIVE) and holds new ones until the
        # registration commits; a writer that would hold it longer makes the tail give up.
        conn.execute(text(f"SET LOCAL lock_timeout = {LOCK_WAIT_MS}"))
        conn.execute(text("LOCK TABLE embeddings IN SHARE MODE"))

    def _connect(self) -> Any:
        return read_only_connection(self._engine)

    @contextmanager
    def _snapshot(self, db: Any) -> Iterator[Any]:
        with db.transaction(), db.cursor() as cursor:
            yield cursor

    @contextmanager
    def _hand_over_snapshot(self, conn: Connection) -> Iterator[Any]:
        # A snapshot of its own: the index step's READ COMMITTED statements would each see a
        # later state than the one before.
        with closing(self._connect()) as db, self._snapshot(db) as cursor:
            yield cursor

    def _query(self, cursor: Any, sql: str, params: tuple[Any, ...]) -> Any:
        return cursor.execute(sql.format(s=f"{ID_STRIDE}::int8", p="%s"), params)

    def _mark(self, cursor: Any) -> None:
        self._acked = set()
        self._acked = {batch for batch, _, _ in self._acked_since(cursor)}

    def _acked_since(self, cursor: Any) -> list[tuple[int, int, int]]:
        """(batch, first item, items) of the plan's batches acknowledged since the last look."""
        cursor.execute(
            "SELECT batch_no, item_start, item_count FROM batches "
            "WHERE plan_id = %s AND state = %s",
            (self._plan_id, COMPLETED),
        )
        return [(int(b), int(s), int(n)) for b, s, n in cursor if int(b) not in self._acked]

    def _read_model_rows(self, cursor: Any) -> None:
        self._copy(cursor, copy_sql(self._pgvector), (self._model,))

    def _copy(self, cursor: Any, sql: str, params: tuple[Any, ...]) -> int:
        assert self._arrivals is not None
        count = 0
        with cursor.copy(sql, params) as copy:
            for ids, vectors in vector_rows(copy, self._pgvector):
                self._check_stopped()
                self._arrivals.place(ids, vectors)
                count += len(ids)
        return count

    def _catch_up(self, cursor: Any) -> None:
        new = self._acked_since(cursor)
        if not new:
            return
        # Sorted: the index probes walk the key in order.
        records = np.sort(np.concatenate([self._records[s : s + n] for _, s, n in new]))
        sql = copy_records_sql(self._pgvector)
        self._arrived_since += self._copy(cursor, sql, (records.tolist(), self._model, self._set))
        self._acked.update(b for b, _, _ in new)


# -- this process's tails --------------------------------------------------------------------------


def _key(engine: Engine, model_key: str) -> tuple[str, str]:
    """A tail's key: its database (as the engine reaches it) and model."""
    return engine.url.render_as_string(hide_password=False), model_key


_tails: dict[tuple[str, str], VectorTail] = {}
_tails_lock = threading.Lock()
_in_this_process = False  # whether this process's index step follows its extraction
_index_settings: Mapping[str, Any] | None = None  # the IndexSpec that index step builds with
_min_recall: float | None = None  # and its recall floor: the index is finished ahead at it


def follow_in_this_process(
    index_settings: Mapping[str, Any] | None = None, min_recall: float | None = None
) -> None:
    """This process runs the index step right after the extraction: follow the vectors, and
    with the fields of the index step's IndexSpec make its index ready as they arrive
    (index/prebuild.py; the spec is made on the tail's thread, where torch is loaded); with its
    recall floor as well, finish it (assembled, measured, stored) once every row is in."""
    global _in_this_process, _index_settings, _min_recall
    _in_this_process, _index_settings, _min_recall = True, index_settings, min_recall


_KINDS: dict[str, type[VectorTail]] = {"sqlite": _SqliteTail, "postgresql": _PostgresTail}


@contextmanager
def following(
    db: Engine,
    model_key: str,
    task_set: str,
    *,
    index_folder: Path | None = None,
    receipt_model: Mapping[str, Any] | None = None,
) -> Iterator[VectorTail | None]:
    """Follow `model_key`'s vectors while the block extracts `task_set`, and keep them for the
    index step when the block succeeds; drop_tail them when it raises. A tail replaces an unclaimed
    one of the same database and model. Yields the tail (None where there is none).
    `index_folder` and `receipt_model` (the engine's manifest.receipt_model()) let the index
    made ready reuse the served index's quantizer as the index step will."""
    kind = _KINDS.get(db.dialect.name) if _in_this_process else None
    if db.dialect.name == "sqlite" and db.url.database in (None, "", ":memory:"):
        kind = None  # another connection would open another database
    if variant_of_model_key(model_key).key_suffix and kind is not _SqliteTail:
        # PostgreSQL's tail decodes float32 (bytes or pgvector) from its COPY; an output
        # variant's rows there (bytes, halfvec or bit) are read by the table's read.
        kind = None
    tail = (
        kind(db, model_key, task_set, _index_settings, index_folder, receipt_model)
        if kind is not None
        else None
    )
    if tail is not None:
        with _tails_lock:
            before = _tails.pop(tail.key, None)
        if before is not None:
            before.close()
    try:
        yield tail
    except BaseException:
        if tail is not None:
            tail.close()
        raise
    if tail is not None:
        tail.kept_at = time.monotonic()
        with _tails_lock:
            before = _tails.pop(tail.key, None)
            _tails[tail.key] = tail
        if before is not None:  # an overlapping extraction of the same model kept one
            before.close()


def drop_tail(db: Engine, model_key: str) -> None:
    """Let go of the tail of this database and model, unclaimed (no build needs its vectors)."""
    with _tails_lock:
        tail = _tails.pop(_key(db, model_key), None)
    if tail is not None:
        tail.close()


def claim(db: Engine, model_key: str) -> VectorSet | None:
    """The vectors a tail of this database and model followed, as of a snapshot taken now; None
    where there is none or it cannot stand for the table (the caller reads the table then)."""
    return claim_with_prebuilt(db, model_key)[0]


def claim_with_prebuilt(db: Engine, model_key: str) -> tuple[VectorSet | None, Prebuilt | None]:
    """claim(), and the index the tail made ready as the rows arrived (None where it made none
    or could not finish it: prebuild.Prebuild.why_not)."""
    with _tails_lock:
        tail = _tails.pop(_key(db, model_key), None)
    if tail is None:
        return None, None
    taken = _take(db, model_key, tail)
    return taken, tail.prebuilt if taken is not None else None


def _take(db: Engine, model_key: str, tail: VectorTail) -> VectorSet | None:
    started = time.monotonic()
    # SQLite: BEGIN IMMEDIATE, so the hand-over sees the file's latest state; no write lands
    # between its reads and the task-set names.
    try:
        with db.begin() as conn:
            taken = tail.take(conn)
    except Exception as exc:  # no transaction (a lock held too long, a lost server): read
        tail.close()
        log.warning("vector tail of %s: not used (%s)", model_key, exc)
        return None
    seconds = time.monotonic() - started
    if taken is None or seconds > SLOW_HAND_OVER_SECONDS:
        log.warning(
            "vector tail of %s: %s in %.1f s (%s rows read at the hand-over)",
            model_key, "handed over" if taken is not None else f"not used ({tail.why})",
            seconds, tail.read_at_hand_over,
        )  # fmt: skip
    return taken
