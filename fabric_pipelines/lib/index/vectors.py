"""Reading the vectors an index is built from, in id order, and refusing bad ones."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
from sqlalchemy import BigInteger, Connection, cast, literal, select, text

from fabric_pipelines.lib.store.models import Embedding, Model, TaskSet

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
    rows = conn.execute(
        select(
            (
                cast(Embedding.task_set_id, BigInteger) * literal(ID_STRIDE, BigInteger)
                + Embedding.record_no
            ).label("id"),
            Embedding.vector,
        )
        .where(Embedding.model_id == model)
        .order_by(Embedding.task_set_id, Embedding.record_no)
    ).all()
    if rows and any(r.vector is None for r in rows):
        rows = _with_pgvector_values(conn, list(rows))
    task_sets = conn.execute(
        select(TaskSet.name)
        .where(TaskSet.id.in_(select(Embedding.task_set_id).where(Embedding.model_id == model)))
        .order_by(TaskSet.name)
    ).scalars()
    if not rows:
        return VectorSet(model_key, np.zeros(0, np.int64), np.zeros((0, 0), np.float32), ())
    sizes = {len(r.vector) for r in rows}
    if len(sizes) != 1:
        raise BadVectorsError(
            f"model {model_key}: embeddings of several dimensions {sorted(s // 4 for s in sizes)}"
        )
    dim = sizes.pop() // 4
    vectors = np.frombuffer(b"".join(r.vector for r in rows), dtype="<f4").reshape(len(rows), dim)
    ids = np.fromiter((r.id for r in rows), dtype=np.int64, count=len(rows))
    return VectorSet(model_key, ids, vectors.astype(np.float32), tuple(task_sets))


def _with_pgvector_values(conn: Connection, rows: list[Any]) -> Any:
    """Rows whose embedding is stored as a pgvector value (schema revision 0002): read its text
    form and turn it into the same float32 bytes as the `vector` column holds."""
    ids = [r.id for r in rows if r.vector is None]
    values: dict[int, str] = dict(
        conn.execute(
            text(
                "select task_set_id::bigint * :stride + record_no, embedding::text "
                "from embeddings where task_set_id::bigint * :stride + record_no = any(:ids)"
            ),
            {"ids": ids, "stride": ID_STRIDE},
        ).all()
    )
    out = []
    for r in rows:
        if r.vector is None:
            floats = np.array(json.loads(values[r.id]), dtype="<f4")
            r = SimpleNamespace(id=r.id, vector=floats.tobytes())
        out.append(r)
    return out


def check_vectors(vectors: np.ndarray, metric: str) -> None:
    """Raise BadVectorsError naming how many rows are NaN, Inf or (for cosine) zero-norm."""
    nan_rows = int(np.isnan(vectors).any(axis=1).sum())
    inf_rows = int(np.isinf(vectors).any(axis=1).sum())
    problems = []
    if nan_rows:
        problems.append(f"{nan_rows} with NaN")
    if inf_rows:
        problems.append(f"{inf_rows} with Inf")
    if metric == "cosine":
        finite = np.where(np.isfinite(vectors), vectors, 0)
        zero_rows = int((np.linalg.norm(finite, axis=1) == 0).sum())
        if zero_rows:
            problems.append(f"{zero_rows} with zero norm (undefined under cosine)")
    if problems:
        raise BadVectorsError(
            f"refusing to build: of {len(vectors)} vectors, {', '.join(problems)}; "
            "fix or delete those rows first"
        )
