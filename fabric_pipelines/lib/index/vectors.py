"""Reading the vectors an index is built from, in id order, and refusing bad ones.

A million rows are read without a Python object per value: the ids are computed by the
database, SQLite's rows come in batches whose blobs NumPy copies straight into place (no joined
copy in between), and PostgreSQL's come as a binary COPY decoded by NumPy
(index/copy_rows.py). The arrays are sized by a count taken first, so the vectors are written
once, where they stay.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import numpy as np
from psycopg.pq import TransactionStatus
from sqlalchemy import Connection, func, select, text

from fabric_pipelines.lib.index.copy_rows import RowLayoutError, vector_rows
from fabric_pipelines.lib.store.models import Embedding, Model, TaskSet
from fabric_pipelines.lib.store.schema import has_pgvector_column

# An index id packs the task set and the task: task_set_id * 2**40 + record_no.
ID_STRIDE = 1 << 40
# Rows per fetch: their blobs (1.5 MB at 768-d) are still in the CPU's cache when NumPy copies
# them into place; batches of 4096 rows (12 MB) read about a fifth slower.
SQLITE_BATCH = 512


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
    expected = conn.execute(
        select(func.count()).select_from(Embedding).where(Embedding.model_id == model)
    ).scalar_one()
    if not expected:
        return empty
    pgvector = has_pgvector_column(conn)
    rows = _RowArrays(int(expected))
    try:
        if _is_postgres(conn):
            for ids, vectors in _postgres_rows(conn, model, pgvector):
                rows.add(ids, vectors)
        else:
            for row_ids, blobs, dim in _sqlite_rows(conn, model):
                rows.add_bytes(row_ids, blobs, dim)
    except RowLayoutError as exc:
        raise _unreadable(conn, model, model_key, pgvector, exc) from exc
    ids, vectors = rows.arrays()
    if len(ids) == 0:
        return empty
    in_use = [int(t) for t in np.unique(ids // ID_STRIDE)]
    task_sets = conn.execute(
        select(TaskSet.name).where(TaskSet.id.in_(in_use)).order_by(TaskSet.name)
    ).scalars()
    return VectorSet(model_key, ids, vectors, tuple(task_sets))


class _RowArrays:
    """ids and vectors written batch by batch into arrays allocated once for the rows counted
    beforehand. Rows beyond that count (written since) are appended at the end with one copy;
    fewer rows (deleted since) leave the arrays shorter."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
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
            self.ids = np.empty(self.expected, np.int64)
            self.vectors = np.empty((self.expected, dim), np.float32)

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
    with closing(raw.cursor()) as cursor:
        cursor.execute(
            "SELECT task_set_id * ? + record_no, vector FROM embeddings WHERE model_id = ? "
            "ORDER BY task_set_id, record_no",
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


def _postgres_rows(
    conn: Connection, model: int, pgvector: bool
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, vectors) per run of PostgreSQL rows, ascending by id: a binary COPY of the id and
    the vector's bytes or, where those are NULL, pgvector's binary value less its 4-byte head
    (so every row of one dimension has one size). Sorting is turned off for the statement: the
    primary key's index gives the order, where the planner would otherwise sort the whole
    table's vectors (on disk, at a million rows)."""
    raw: Any = conn.connection.driver_connection
    from_pgvector = (
        ", CASE WHEN vector IS NULL THEN substring(vector_send(embedding) from 5) END"
        if pgvector
        else ""
    )
    with raw.cursor() as cursor:
        cursor.execute("SELECT current_setting('enable_sort')")
        before = cursor.fetchone()[0]
        cursor.execute("SELECT set_config('enable_sort', 'off', true)")
        try:
            with cursor.copy(
                f"COPY (SELECT task_set_id::int8 * {ID_STRIDE} + record_no, vector{from_pgvector} "
                "FROM embeddings WHERE model_id = %s ORDER BY task_set_id, record_no) "
                "TO STDOUT (FORMAT BINARY)",
                (model,),
            ) as copy:
                try:
                    yield from vector_rows(copy, pgvector)
                except RowLayoutError:
                    for _ in copy:  # read to the end, so the connection can ask what was wrong
                        pass
                    raise
        finally:
            if raw.info.transaction_status != TransactionStatus.INERROR:  # else nothing to undo
                cursor.execute("SELECT set_config('enable_sort', %s, true)", (before,))


def _unreadable(
    conn: Connection, model: int, model_key: str, pgvector: bool, exc: RowLayoutError
) -> BadVectorsError:
    """What is wrong with rows that could not be read as one array: their dimensions."""
    dim = (
        "coalesce(length(vector) / 4, vector_dims(embedding))" if pgvector else "length(vector) / 4"
    )
    dims = conn.execute(
        text(f"SELECT DISTINCT {dim} FROM embeddings WHERE model_id = :model"), {"model": model}
    ).scalars()
    found = set(dims)
    known = sorted(int(d) for d in found if d is not None)
    if len(known) > 1:
        return BadVectorsError(f"model {model_key}: embeddings of several dimensions {known}")
    if None in found:
        return BadVectorsError(f"model {model_key}: embeddings without a vector (NULL)")
    return BadVectorsError(f"model {model_key}: embeddings that cannot be read: {exc}")


@dataclass(frozen=True)
class VectorCounts:
    rows: int
    nan_rows: int
    inf_rows: int
    zero_norm_rows: int


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
    counts = count_bad_rows(vectors)
    problems = []
    if counts.nan_rows:
        problems.append(f"{counts.nan_rows} with NaN")
    if counts.inf_rows:
        problems.append(f"{counts.inf_rows} with Inf")
    if metric == "cosine" and counts.zero_norm_rows:
        problems.append(f"{counts.zero_norm_rows} with zero norm (undefined under cosine)")
    if problems:
        raise BadVectorsError(
            f"refusing to build: of {len(vectors)} vectors, {', '.join(problems)}; "
            "fix or delete those rows first"
        )
    return counts
