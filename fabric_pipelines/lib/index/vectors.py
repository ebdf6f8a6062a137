"""Reading the vectors an index is built from, in id order, and refusing bad ones.

A million rows are read without a Python object per value: the ids are computed by the
database, SQLite's rows come in batches whose blobs NumPy copies straight into place (no joined
copy in between), and PostgreSQL's come as a binary COPY decoded by NumPy
(index/copy_rows.py). The arrays are sized by a count taken first, so the vectors are written
once, where they stay.

Large PostgreSQL sets are read by several connections at once, each one range of ids, all in
one committed state (index/parallel_read.py); the caller's connection reads serially where that
cannot be had or is given up.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from sqlalchemy import Connection, Engine, select, text

from fabric_pipelines.lib.index import parallel_read
from fabric_pipelines.lib.index.copy_rows import RowLayoutError, vector_rows
from fabric_pipelines.lib.index.parallel_read import KeyRange, ReadStopped
from fabric_pipelines.lib.records.vector_codec import StoredCodec
from fabric_pipelines.lib.store.models import WINDOW_BASE, Model, TaskSet
from fabric_pipelines.lib.store.schema import has_pgvector_column
from fabric_pipelines.lib.store.vector_columns import VectorColumns

# An index holds documents: the rows of submitted records, never the windows of a chunked one
# (tasks/windows.py), whose document has a row of its own.
DOCUMENTS = f"record_no < {WINDOW_BASE}"
# An index id packs the task set and the task: task_set_id * 2**40 + record_no.
ID_STRIDE = 1 << 40
# Rows per fetch: their blobs (1.5 MB at 768-d) are still in the CPU's cache when NumPy copies
# them into place; batches of 4096 rows (12 MB) read about a fifth slower.
SQLITE_BATCH = 512
# How much of a SQLite file a vector read maps into memory: its pages then cost no read() call
# each (1 M x 768 on the GPU host: 2.9 s against 3.3-3.7 s). SQLite caps it at its compile-time
# limit, 2 GiB in the usual builds; pages beyond are read as before.
SQLITE_MMAP_BYTES = 1 << 40
# How long a parallel PostgreSQL reader waits for a lock before it gives up (_PostgresRange).
READER_LOCK_TIMEOUT_MS = 1000


class BadVectorsError(ValueError):
    """Vectors that would corrupt an index (NaN, Inf, zero norm under cosine), with counts."""


@dataclass(frozen=True)
class VectorSet:
    model_key: str
    ids: np.ndarray  # int64, ascending: task_set_id * ID_STRIDE + record_no of each row
    vectors: np.ndarray  # float32 [n, dim]
    task_sets: tuple[str, ...]

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1]) if self.vectors.ndim == 2 else 0


def load_vectors(conn: Connection, model_key: str) -> VectorSet:
    """Every embedding of `model_key`, ascending by id. Raises BadVectorsError when they are not
    all of one dimension."""
    empty = VectorSet(model_key, np.zeros(0, np.int64), np.zeros((0, 0), np.float32), ())
    model = conn.execute(select(Model.id).where(Model.model_key == model_key)).scalar()
    if model is None:
        return empty
    # Rows per task set: their total sizes the arrays, their spread cuts a parallel read.
    extents = [
        (int(task_set), int(rows), int(first), int(last))
        for task_set, rows, first, last in conn.execute(
            text(
                "SELECT task_set_id, count(*), min(record_no), max(record_no) FROM embeddings "
                f"WHERE model_id = :model AND {DOCUMENTS} GROUP BY task_set_id ORDER BY task_set_id"
            ),
            {"model": model},
        )
    ]
    expected = sum(rows for _, rows, _, _ in extents)
    if not expected:
        return empty
    codec = StoredCodec.of_key(conn, model_key)
    if not codec.plain:  # an output variant's rows: read as values (stored_vectors.py)
        ids, vectors = _read_variant_rows(conn, model, codec)
        return vector_set(conn, model_key, *with_linked_tasks(conn, model, ids, vectors))
    pgvector = has_pgvector_column(conn)
    read = _read_in_parallel(conn, model, pgvector, extents)
    if read is None:
        read = _read_serially(conn, model, model_key, pgvector, expected)
    ids, vectors = read
    if len(ids) == 0:
        return empty
    return vector_set(conn, model_key, *with_linked_tasks(conn, model, ids, vectors))


# The model's links whose task holds no row of its own (broker/reuse.py), {p} the model id.
LINKS_WITHOUT_ROWS = (
    "FROM reused_results r WHERE r.model_id = {p} AND NOT EXISTS (SELECT 1 FROM embeddings t "
    "WHERE t.model_id = r.model_id AND t.task_set_id = r.task_set_id "
    "AND t.record_no = r.record_no)"
)
# (the task's index id, its source's), {s} the id stride.
LINK_PAIRS_SQL = (
    "SELECT r.task_set_id * {s} + r.record_no, r.from_task_set_id * {s} + r.from_record_no "
    + LINKS_WITHOUT_ROWS
)


def linked_task_ids(conn: Connection, model: int) -> tuple[np.ndarray, np.ndarray]:
    """(id of each task that reused another's result, its source's id), as index ids, for the
    model's links whose task holds no row of its own (broker/reuse.py)."""
    raw: Any = conn.connection.driver_connection
    mark = "%s" if _is_postgres(conn) else "?"
    with closing(raw.cursor()) as cursor:
        cursor.execute(LINK_PAIRS_SQL.format(s=mark, p=mark), (ID_STRIDE, ID_STRIDE, model))
        pairs = np.array(cursor.fetchall(), dtype=np.int64).reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def with_linked_tasks(
    conn: Connection, model: int, ids: np.ndarray, vectors: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The stored rows (`ids` ascending) and a row for every task linked to one of them, with
    its source's vector: one row per task, ascending by id, as the index has always held. A
    link whose source is not stored yet (a duplicate still queued) adds nothing."""
    targets, sources = linked_task_ids(conn, model)
    if targets.size == 0 or ids.size == 0:
        return ids, vectors
    at = np.minimum(np.searchsorted(ids, sources), ids.size - 1)
    found = ids[at] == sources
    targets, at = targets[found], at[found]
    if targets.size == 0:
        return ids, vectors
    all_ids = np.concatenate([ids, targets])
    order = np.argsort(all_ids, kind="stable")
    source_row = np.concatenate([np.arange(ids.size), at])[order]
    return all_ids[order], vectors[source_row]


def vector_set(conn: Connection, model_key: str, ids: np.ndarray, vectors: np.ndarray) -> VectorSet:
    """A VectorSet of rows read (ids ascending), with the names of the task sets they are of."""
    in_use = [int(t) for t in np.unique(ids // ID_STRIDE)]
    task_sets = conn.execute(
        select(TaskSet.name).where(TaskSet.id.in_(in_use)).order_by(TaskSet.name)
    ).scalars()
    return VectorSet(model_key, ids, vectors, tuple(task_sets))


def _read_variant_rows(
    conn: Connection, model: int, codec: StoredCodec
) -> tuple[np.ndarray, np.ndarray]:
    """ids and float32 values of a variant key's rows (float16 exactly, int8 at the middle of
    each step, binary bits as -1/+1: inner products of those rank as Hamming distance does),
    decoded block by block as they are fetched."""
    raw: Any = conn.connection.driver_connection
    mark = "%s" if _is_postgres(conn) else "?"
    ids: list[np.ndarray] = []
    values: list[np.ndarray] = []
    sizes: set[int] = set()
    stored = VectorColumns.of(conn)
    with closing(raw.cursor()) as cursor:
        cursor.execute(
            f"SELECT task_set_id * {mark} + record_no, {stored.select_sql()} FROM embeddings "
            f"WHERE model_id = {mark} AND {DOCUMENTS} ORDER BY task_set_id, record_no",
            (ID_STRIDE, model),
        )
        while block := cursor.fetchmany(SQLITE_BATCH):
            block_ids = [row[0] for row in block]
            blobs = [stored.stored_bytes(row[1:]) for row in block]
            sizes |= set(map(len, blobs))
            if len(sizes) > 1:
                raise BadVectorsError(f"model id {model}: stored rows of several sizes")
            ids.append(np.fromiter(block_ids, np.int64, len(block_ids)))
            values.append(codec.values(codec.rows(blobs)))
    if not ids:
        return np.zeros(0, np.int64), np.zeros((0, 0), np.float32)
    return np.concatenate(ids), np.ascontiguousarray(np.concatenate(values), dtype=np.float32)


def _read_serially(
    conn: Connection, model: int, model_key: str, pgvector: bool, expected: int
) -> tuple[np.ndarray, np.ndarray]:
    rows = _RowArrays(expected)
    try:
        if _is_postgres(conn):
            for ids, vectors in _postgres_rows(conn, model, pgvector):
                rows.add(ids, vectors)
        else:
            for row_ids, blobs, dim in _sqlite_rows(conn, model):
                rows.add_bytes(row_ids, blobs, dim)
    except RowLayoutError as exc:
        raise _unreadable(conn, model, model_key, pgvector, exc) from exc
    return rows.arrays()


class _RowArrays:
    """ids and vectors written batch by batch into arrays allocated once for the rows counted
    beforehand. Rows beyond that count (written since) are appended at the end with one copy;
    fewer rows (deleted since) leave the arrays shorter. `allocate`, given the dimension, hands
    out arrays for `expected` rows (by default new ones; a parallel reader's slice of shared
    ones)."""

    def __init__(
        self, expected: int, allocate: Callable[[int], tuple[np.ndarray, np.ndarray]] | None = None
    ) -> None:
        self.expected = expected
        self.allocate = allocate or (
            lambda dim: (np.empty(expected, np.int64), np.empty((expected, dim), np.float32))
        )
        self.filled = 0
        self.ids = np.zeros(0, np.int64)
        self.vectors = np.zeros((0, 0), np.float32)
        self.beyond: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        self._allocate(vectors.shape[1])
        take = min(len(ids), self.expected - self.filled)
        self.ids[self.filled : self.filled + take] = ids[:take]
        self.vectors[self.filled : self.filled + take] = vectors[:take]
        self.filled += take
        if take < len(ids):
            self.beyond.append(
                (np.array(ids[take:], np.int64), np.array(vectors[take:], np.float32))
            )

    def add_bytes(self, ids: Sequence[int], blobs: Sequence[bytes], dim: int) -> None:
        """`add` for rows whose vectors are `dim` float32 values as little-endian bytes, each
        blob exactly 4 * dim long: NumPy copies them straight into place (a little-endian host
        stores float32 so), with no joined copy of the batch in between."""
        take = min(len(ids), self.expected - self.filled)
        if sys.byteorder != "little" or dim == 0 or take < len(ids):
            joined = np.frombuffer(b"".join(blobs), dtype="<f4").reshape(len(blobs), dim)
            self.add(np.array(ids, dtype=np.int64), joined)
            return
        self._allocate(dim)
        end = self.filled + take
        self.ids[self.filled : end] = ids
        self.vectors[self.filled : end].view(f"S{4 * dim}")[:, 0] = blobs
        self.filled = end

    def _allocate(self, dim: int) -> None:
        if self.filled == 0 and not self.beyond:
            self.ids, self.vectors = self.allocate(dim)

    @property
    def in_place(self) -> bool:
        """Whether the rows are exactly the allocated arrays, which they fill."""
        return self.filled == self.expected and not self.beyond

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        ids, vectors = self.ids[: self.filled], self.vectors[: self.filled]
        if self.beyond:
            ids = np.concatenate([ids, *(i for i, _ in self.beyond)])
            vectors = np.concatenate([vectors, *(v for _, v in self.beyond)])
        return ids, vectors


def _is_postgres(conn: Connection) -> bool:
    return conn.dialect.name == "postgresql"


def _sqlite_rows(
    conn: Connection, model: int
) -> Iterator[tuple[tuple[int, ...], tuple[bytes, ...], int]]:
    """(ids, vectors as bytes, dimension) per batch of SQLite rows, ascending by id; every
    vector holds 4 * dimension bytes."""
    raw: Any = conn.connection.driver_connection
    dim = None
    with closing(raw.cursor()) as cursor, memory_mapped(cursor):
        cursor.execute(
            "SELECT task_set_id * ? + record_no, vector FROM embeddings WHERE model_id = ? "
            f"AND {DOCUMENTS} ORDER BY task_set_id, record_no",
            (ID_STRIDE, model),
        )
        while batch := cursor.fetchmany(SQLITE_BATCH):
            ids, blobs = zip(*batch, strict=True)
            kinds = set(map(type, blobs))
            if kinds != {bytes}:  # NULL, or a value NumPy would not copy as it is
                what = (
                    "a row without a vector"
                    if type(None) in kinds
                    else "a vector not stored as bytes"
                )
                raise RowLayoutError(what)
            sizes = set(map(len, blobs))
            if dim is None and len(sizes) == 1:
                dim = next(iter(sizes)) // 4
            if dim is None or sizes != {4 * dim}:
                raise RowLayoutError("rows of several dimensions")
            yield ids, blobs, dim


@contextmanager
def memory_mapped(cursor: Any) -> Iterator[None]:
    """The connection reads its file through a memory map while inside (SQLITE_MMAP_BYTES), and
    as before afterwards: the setting belongs to a pooled connection."""
    (before,) = cursor.execute("PRAGMA mmap_size").fetchone()
    cursor.execute(f"PRAGMA mmap_size = {SQLITE_MMAP_BYTES}")
    try:
        yield
    finally:
        cursor.execute(f"PRAGMA mmap_size = {int(before)}")


def _postgres_rows(
    conn: Connection, model: int, pgvector: bool
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, vectors) per run of PostgreSQL rows, ascending by id: a binary COPY of the id and
    the vector's bytes or, where those are NULL, pgvector's binary value less its 4-byte head
    (so every row of one dimension has one size). Sorting is turned off for the statement: the
    primary key's index gives the order, where the planner would otherwise sort the whole
    table's vectors (on disk, at a million rows)."""
    raw: Any = conn.connection.driver_connection
    with raw.cursor() as cursor:
        cursor.execute("SELECT current_setting('enable_sort')")
        before = cursor.fetchone()[0]
        cursor.execute("SELECT set_config('enable_sort', 'off', true)")
        try:
            with cursor.copy(copy_sql(pgvector), (model,)) as copy:
                try:
                    yield from vector_rows(copy, pgvector)
                except RowLayoutError:
                    for _ in copy:  # read to the end, so the connection can ask what was wrong
                        pass
                    raise
        finally:
            if raw.info.transaction_status != TransactionStatus.INERROR:  # else nothing to undo
                cursor.execute("SELECT set_config('enable_sort', %s, true)", (before,))


def read_only_connection(engine: Engine) -> psycopg.Connection[Any]:
    """A psycopg connection made as `engine` makes its own, whose transactions are read-only
    and REPEATABLE READ: each one sees a single committed state."""
    args, kwargs = engine.dialect.create_connect_args(engine.url)
    db = psycopg.connect(*args, **kwargs)
    db.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    db.read_only = True
    return db


def _copied_columns(pgvector: bool) -> str:
    """A row as _postgres_rows reads it: its id, its float32 bytes, and with pgvector the
    `embedding` value's floats where `vector` is empty."""
    from_pgvector = (
        ", CASE WHEN vector IS NULL THEN substring(vector_send(embedding) from 5) END"
        if pgvector
        else ""
    )
    return f"task_set_id::int8 * {ID_STRIDE} + record_no, vector{from_pgvector}"


def copy_sql(pgvector: bool, where: str = "") -> str:
    """The binary COPY of a model's rows (the model its first parameter; `where` more conditions
    and their parameters after it), as _postgres_rows describes."""
    return (
        f"COPY (SELECT {_copied_columns(pgvector)} "
        f"FROM embeddings WHERE model_id = %s AND {DOCUMENTS}{where} "
        "ORDER BY task_set_id, record_no) "
        "TO STDOUT (FORMAT BINARY)"
    )


def copy_records_sql(pgvector: bool) -> str:
    """The binary COPY of chosen rows of one task set, laid out as copy_sql's, in no particular
    order. Parameters: the record numbers (a list), the model, the task set.

    One index probe per record: LATERAL ... LIMIT 1 keeps the planner from what it chose on a
    table written moments ago and not yet analysed, a scan of all the set's rows with the list
    as a filter (18 s for 15,000 of 200,000 rows, against 0.3 s this way). The columns are the
    LATERAL row's (`r` has only `no`)."""
    return (
        f"COPY (SELECT {_copied_columns(pgvector)} "
        "FROM unnest(%s::int8[]) AS r(no) CROSS JOIN LATERAL (SELECT * FROM embeddings "
        "WHERE model_id = %s AND task_set_id = %s AND record_no = r.no LIMIT 1) AS e) "
        "TO STDOUT (FORMAT BINARY)"
    )


def _unreadable(
    conn: Connection, model: int, model_key: str, pgvector: bool, exc: RowLayoutError
) -> BadVectorsError:
    """What is wrong with rows that could not be read as one array: their dimensions."""
    dim = (
        "coalesce(length(vector) / 4, vector_dims(embedding))" if pgvector else "length(vector) / 4"
    )
    dims = conn.execute(
        text(f"SELECT DISTINCT {dim} FROM embeddings WHERE model_id = :model AND {DOCUMENTS}"),
        {"model": model},
    ).scalars()
    found = set(dims)
    known = sorted(int(d) for d in found if d is not None)
    if len(known) > 1:
        return BadVectorsError(f"model {model_key}: embeddings of several dimensions {known}")
    if None in found:
        return BadVectorsError(f"model {model_key}: embeddings without a vector (NULL)")
    return BadVectorsError(f"model {model_key}: embeddings that cannot be read: {exc}")


# Reading in parallel (index/parallel_read.py): what each database needs for it.


def _read_in_parallel(
    conn: Connection, model: int, pgvector: bool, extents: list[parallel_read.Extent]
) -> tuple[np.ndarray, np.ndarray] | None:
    """The rows, read by several PostgreSQL connections at once, each one range of ids cut from
    the task sets' `extents`; None where the set is small, the database is SQLite, other
    connections cannot share the caller's view of it, or the read was given up: the caller then
    reads serially. (SQLite shares no snapshot between connections, and ranges read by
    several of its connections were no faster on the 16-core GPU host: 5.0 s against 4.3 s
    serially for 1 M x 768.)"""
    if not _is_postgres(conn):
        return None
    readers = parallel_read.reader_count(sum(rows for _, rows, _, _ in extents))
    ranges = parallel_read.key_ranges(extents, readers)
    if len(ranges) < 2:
        return None
    return _postgres_in_parallel(conn, model, pgvector, ranges)


def _postgres_in_parallel(
    conn: Connection, model: int, pgvector: bool, ranges: list[KeyRange]
) -> tuple[np.ndarray, np.ndarray] | None:
    """The caller's transaction exports its snapshot and every reader's transaction imports it
    (as pg_dump's workers do): they all see one committed state. Not where the caller is
    outside a transaction (the snapshot would end with the statement) or has written in it
    (the readers would not see what it wrote)."""
    raw: Any = conn.connection.driver_connection
    if raw.info.transaction_status != TransactionStatus.INTRANS:
        return None
    written = conn.execute(text("SELECT pg_current_xact_id_if_assigned() IS NOT NULL"))
    if written.scalar_one():
        return None
    snapshot, search_path = conn.execute(
        text("SELECT pg_export_snapshot(), current_setting('search_path')")
    ).one()
    return parallel_read.read_ranges(
        [
            _PostgresRange(conn.engine, snapshot, search_path, model, pgvector, key_range)
            for key_range in ranges
        ],
        keepalive=lambda: conn.execute(text("SELECT 1")),
    )


class _PostgresRange(parallel_read.RangeReader):
    """One range of a parallel PostgreSQL read: a REPEATABLE READ transaction on the exported
    snapshot, then the serial read's binary COPY (index/copy_rows.py) limited to the range."""

    def __init__(
        self,
        engine: Engine,
        snapshot: str,
        search_path: str,
        model: int,
        pgvector: bool,
        key_range: KeyRange,
    ) -> None:
        self.engine, self.snapshot, self.search_path = engine, snapshot, search_path
        self.model, self.pgvector, self.range = model, pgvector, key_range

    def read(
        self, slot: Callable[[int], parallel_read.Arrays], stop: threading.Event
    ) -> tuple[parallel_read.Arrays, bool]:
        rows = _RowArrays(self.range.rows, slot)
        with read_only_connection(self.engine) as db:
            # Before any query of the transaction, as PostgreSQL requires.
            db.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(self.snapshot)))
            # The caller already holds a lock on the table: a reader that has to wait for one
            # waits behind a request (DDL) that waits for the caller, which waits for the
            # reader. It gives up instead, and the caller reads serially.
            db.execute(
                "SELECT set_config('search_path', %s, true), set_config('enable_sort', 'off', true),"
                " set_config('lock_timeout', %s, true)",
                (self.search_path, str(READER_LOCK_TIMEOUT_MS)),
            )
            where, params = self.range.condition("%s")
            with (
                db.cursor() as cursor,
                cursor.copy(copy_sql(self.pgvector, where), (self.model, *params)) as copy,
            ):
                for ids, vectors in vector_rows(copy, self.pgvector):
                    if stop.is_set():
                        raise ReadStopped()
                    rows.add(ids, vectors)
        return rows.arrays(), rows.in_place


@dataclass(frozen=True)
class VectorCounts:
    rows: int
    nan_rows: int
    inf_rows: int
    zero_norm_rows: int

    def __add__(self, other: VectorCounts) -> VectorCounts:
        """The counts of two disjoint sets of rows together (rows counted as they arrive)."""
        return VectorCounts(
            self.rows + other.rows,
            self.nan_rows + other.nan_rows,
            self.inf_rows + other.inf_rows,
            self.zero_norm_rows + other.zero_norm_rows,
        )


def count_bad_rows(vectors: np.ndarray) -> VectorCounts:
    """Rows with NaN, with Inf, and of zero norm (NaN and Inf parts left out). One pass of
    squared norms finds the suspects (a NaN, an Inf or all zeros shows in the norm); only those
    rows are looked at element by element."""
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to Inf marks a suspect
        squares = np.einsum("ij,ij->i", x, x)
        suspects = x[~np.isfinite(squares) | (squares == 0)]
        finite = np.where(np.isfinite(suspects), suspects, 0)
        zero_norm = np.linalg.norm(finite, axis=1) == 0
    return VectorCounts(
        rows=len(x),
        nan_rows=int(np.isnan(suspects).any(axis=1).sum()),
        inf_rows=int(np.isinf(suspects).any(axis=1).sum()),
        zero_norm_rows=int(zero_norm.sum()),
    )


def check_vectors(vectors: np.ndarray, metric: str) -> VectorCounts:
    """The rows' counts (count_bad_rows); raises BadVectorsError naming how many rows are NaN,
    Inf or (for cosine) zero-norm."""
    return refuse_bad_vectors(count_bad_rows(vectors), metric)


def refuse_bad_vectors(counts: VectorCounts, metric: str) -> VectorCounts:
    """`counts`, unless they hold rows an index cannot take: BadVectorsError naming how many
    rows are NaN, Inf or (for cosine) zero-norm (check_vectors, from counts made elsewhere)."""
    problems = []
    if counts.nan_rows:
        problems.append(f"{counts.nan_rows} with NaN")
    if counts.inf_rows:
        problems.append(f"{counts.inf_rows} with Inf")
    if metric == "cosine" and counts.zero_norm_rows:
        problems.append(f"{counts.zero_norm_rows} with zero norm (undefined under cosine)")
    if problems:
        raise BadVectorsError(
            f"refusing to build: of {counts.rows} vectors, {', '.join(problems)}; "
            "fix or delete those rows first"
        )
    return counts
