"""`fabric export`: a task set's pooled embeddings as one Parquet file, for other tools.

Rows are read in record order, a block at a time (the whole set is never in memory), and written
as they come through the file helper (staging name, fsync, sha256, rename): a reader never sees
a half-written file. Columns: `id` (the task id as submitted), `record_no` (its place in the
submitted file, from 0), `n_tokens` (tokens the model read) and `vector` (float32, fixed size).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import Engine, select

from fabric_pipelines.lib.files import HashingWriter, stream_file
from fabric_pipelines.lib.store.models import BatchPlan, Embedding, Model, Task, TaskSet

BLOCK_ROWS = 50_000  # rows read and written at a time


class ExportError(ValueError):
    """Nothing was written; the message names what is missing and what to do."""


@dataclass(frozen=True)
class Exported:
    path: Path
    sha256: str
    rows: int
    dim: int
    model_key: str


def export_task_set(
    db: Engine,
    task_set: str,
    out: Path,
    *,
    model_key: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> Exported:
    """Write `task_set`'s embeddings of `model_key` (default: the model of its current plan) to
    `out`; `progress(rows)` after each block."""
    with db.connect() as conn:
        found = conn.execute(
            select(TaskSet.id, TaskSet.current_plan_id).where(TaskSet.name == task_set)
        ).first()
        if found is None:
            raise ExportError(f"no task set named {task_set!r} (fabric status lists them)")
        set_id, plan_id = found
        if model_key is None:
            if plan_id is None:
                raise ExportError(
                    f"task set {task_set!r} has not been extracted yet: fabric run {task_set}"
                )
            model_key = conn.execute(
                select(BatchPlan.model_key).where(BatchPlan.plan_id == plan_id)
            ).scalar_one()
        model = conn.execute(select(Model.id).where(Model.model_key == model_key)).scalar()
    if model is None:
        raise ExportError(f"no embeddings of model {model_key!r} in this database")
    query = (
        select(Task.task_id, Embedding.record_no, Embedding.n_tokens, Embedding.vector)
        .join(
            Task,
            (Task.task_set_id == Embedding.task_set_id) & (Task.record_no == Embedding.record_no),
        )
        .where(Embedding.task_set_id == set_id, Embedding.model_id == model)
        .order_by(Embedding.record_no)
    )
    counted = {"rows": 0, "dim": 0}

    def write(sink: HashingWriter) -> None:
        writer: pq.ParquetWriter | None = None
        with db.connect() as conn:
            result = conn.execution_options(stream_results=True, yield_per=BLOCK_ROWS)
            for block in result.execute(query).partitions(BLOCK_ROWS):
                table = _block_table(block)
                if writer is None:
                    counted["dim"] = table.schema.field("vector").type.list_size
                    writer = pq.ParquetWriter(pa.PythonFile(sink, mode="w"), table.schema)
                writer.write_table(table)
                counted["rows"] += table.num_rows
                if progress is not None:
                    progress(counted["rows"])
        if writer is None:
            raise ExportError(
                f"task set {task_set!r} has no embeddings of {model_key}: fabric status "
                f"{task_set} shows what happened to its tasks"
            )
        writer.close()

    stored = stream_file(out, write)
    return Exported(out, stored.sha256, counted["rows"], counted["dim"], model_key)


def _block_table(rows: Sequence[Any]) -> pa.Table:
    ids = [row[0] for row in rows]
    vectors = np.frombuffer(b"".join(row[3] for row in rows), dtype="<f4")
    dim = vectors.size // len(rows)
    return pa.table(
        {
            "id": pa.array(ids, type=pa.string()),
            "record_no": pa.array([row[1] for row in rows], type=pa.int64()),
            "n_tokens": pa.array([row[2] for row in rows], type=pa.int32()),
            "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors, pa.float32()), dim),
        }
    )
