"""Reading the vectors an index is built from, in id order, and refusing bad ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import BigInteger, Connection, cast, column, func, literal, select

from fabric_pipelines.lib.store.models import Embedding, Model, TaskSet
from fabric_pipelines.lib.store.schema import has_pgvector_column

# An index id packs the task set and the task: task_set_id * 2**40 + record_no.
ID_STRIDE = 1 << 40


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
    """Every embedding of `model_key`, ascending by id."""
    model = select(Model.id).where(Model.model_key == model_key).scalar_subquery()
    columns = [
        (
            cast(Embedding.task_set_id, BigInteger) * literal(ID_STRIDE, BigInteger)
            + Embedding.record_no
        ).label("id"),
        Embedding.vector,
    ]
    if has_pgvector_column(conn):  # schema revision 0002 on a server with pgvector
        columns.append(func.vector_send(column("embedding")).label("pgvector"))
    rows = conn.execute(
        select(*columns)
        .select_from(Embedding)
        .where(Embedding.model_id == model)
        .order_by(Embedding.task_set_id, Embedding.record_no)
    ).all()
    task_sets = conn.execute(
        select(TaskSet.name)
        .where(TaskSet.id.in_(select(Embedding.task_set_id).where(Embedding.model_id == model)))
        .order_by(TaskSet.name)
    ).scalars()
    if not rows:
        return VectorSet(model_key, np.zeros(0, np.int64), np.zeros((0, 0), np.float32), ())
    vectors = _float32_rows(model_key, rows)
    ids = np.fromiter((r.id for r in rows), dtype=np.int64, count=len(rows))
    return VectorSet(model_key, ids, vectors, tuple(task_sets))


def _float32_rows(model_key: str, rows: Any) -> np.ndarray:
    """The rows' vectors as float32 [n, dim]: from the `vector` column (little-endian float32
    bytes) or, where that is empty, from pgvector's binary form (16-bit dimension, 16-bit zero,
    float32 in network order). Each kind is decoded in one NumPy pass."""
    as_bytes = np.fromiter((r.vector is not None for r in rows), dtype=bool, count=len(rows))
    sizes = {len(r.vector) if r.vector is not None else len(r.pgvector) - 4 for r in rows}
    if len(sizes) != 1:
        raise BadVectorsError(
            f"model {model_key}: embeddings of several dimensions {sorted(s // 4 for s in sizes)}"
        )
    dim = sizes.pop() // 4
    out = np.empty((len(rows), dim), dtype=np.float32)
    if as_bytes.any():
        joined = b"".join(r.vector for r in rows if r.vector is not None)
        out[as_bytes] = np.frombuffer(joined, dtype="<f4").reshape(-1, dim)
    if not as_bytes.all():
        joined = b"".join(r.pgvector for r in rows if r.vector is None)
        values = np.frombuffer(joined, dtype=np.uint8).reshape(-1, 4 + 4 * dim)[:, 4:]
        out[~as_bytes] = np.ascontiguousarray(values).view(">f4")
    return out


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
