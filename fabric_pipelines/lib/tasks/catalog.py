"""The ingest stage: inbox file -> tokenised Arrow task set + its database row and failures.

Task sets are immutable. Ingesting a set again with the same file and settings reuses what is
stored (after checking its hash); with a different file or settings it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
from sqlalchemy import Engine, delete, insert, select
from sqlalchemy.orm import Session

from fabric_gpu.model import load_tokenizer, resolve_model_dir, tokenizer_sha256
from fabric_pipelines.lib.settings import FabricPaths
from fabric_pipelines.lib.store.models import (
    Batch,
    BatchPlan,
    Embedding,
    HiddenStateShard,
    Task,
    TaskFailure,
    TaskSet,
)
from fabric_pipelines.lib.tasks.inbox import submission_path
from fabric_pipelines.lib.tasks.ingest import Failure, ingest
from fabric_pipelines.lib.files import sha256_file
from fabric_pipelines.lib.tasks.store import read_table, to_table, write_table


class ImmutableTaskSetError(ValueError):
    pass


@dataclass(frozen=True)
class IngestSummary:
    task_set: str
    n_records: int
    n_tasks: int
    n_failed: int
    truncated: int
    source_sha256: str
    content_sha256: str
    path: Path
    reused: bool
    lengths: np.ndarray  # tokens per task, in task order
    failures: list[Failure]


def ingest_task_set(
    db: Engine,
    paths: FabricPaths,
    task_set: str,
    *,
    model_id: str,
    max_seq_len: int,
    truncate: bool = False,
    progress: bool = False,
) -> IngestSummary:
    source = submission_path(paths.inbox, task_set)
    source_sha = sha256_file(source)
    model_dir = resolve_model_dir(model_id)
    tok_sha = tokenizer_sha256(model_dir)
    with Session(db) as session:
        existing = session.scalars(select(TaskSet).where(TaskSet.name == task_set)).one_or_none()
        if existing is not None:
            _check_same(existing, source_sha, tok_sha, max_seq_len)
            table = read_table(Path(existing.path), existing.content_sha256)
            failures = [
                Failure(f.record_no, f.task_id, f.reason)
                for f in session.scalars(
                    select(TaskFailure)
                    .where(TaskFailure.task_set == task_set, TaskFailure.stage == "ingest")
                    .order_by(TaskFailure.record_no)
                )
            ]
            return IngestSummary(
                task_set,
                existing.n_records,
                existing.n_tasks,
                len(failures),
                existing.truncated,
                source_sha,
                existing.content_sha256,
                Path(existing.path),
                True,
                task_lengths(table),
                failures,
            )

    tasks = ingest(
        source,
        load_tokenizer(model_dir),
        max_seq_len=max_seq_len,
        truncate=truncate,
        progress=progress,
    )
    path = paths.task_sets / f"{task_set}.arrow"
    content_sha = write_table(
        path,
        to_table(tasks),
        {
            "fabric.task_set": task_set,
            "fabric.source_sha256": source_sha,
            "fabric.model_id": model_id,
            "fabric.tokenizer_sha256": tok_sha,
            "fabric.max_seq_len": str(max_seq_len),
        },
    )
    with db.begin() as conn:
        set_id = conn.execute(
            insert(TaskSet).returning(TaskSet.id),
            {
                "name": task_set,
                "source_sha256": source_sha,
                "content_sha256": content_sha,
                "path": str(path),
                "model_id": model_id,
                "tokenizer_sha256": tok_sha,
                "max_seq_len": max_seq_len,
                "n_records": tasks.n_records,
                "n_tasks": len(tasks.task_ids),
                "truncated": tasks.truncated,
            },
        ).scalar_one()
        write_task_ids(conn, set_id, tasks.record_no, tasks.task_ids)
        if tasks.failures:
            conn.execute(
                insert(TaskFailure),
                [
                    {
                        "task_set": task_set,
                        "record_no": f.record_no,
                        "task_id": f.task_id,
                        "stage": "ingest",
                        "reason": f.reason,
                    }
                    for f in tasks.failures
                ],
            )
    return IngestSummary(
        task_set,
        tasks.n_records,
        len(tasks.task_ids),
        len(tasks.failures),
        tasks.truncated,
        source_sha,
        content_sha,
        path,
        False,
        tasks.lengths,
        tasks.failures,
    )


def task_lengths(table: pa.Table) -> np.ndarray:
    offsets = table.column("token_ids").combine_chunks().offsets.to_numpy()
    return np.diff(offsets).astype(np.int64)


def get_task_set(db: Engine, task_set: str) -> TaskSet:
    with Session(db, expire_on_commit=False) as session:
        row = session.scalars(select(TaskSet).where(TaskSet.name == task_set)).one_or_none()
    if row is None:
        raise LookupError(
            f"task set {task_set!r} is not ingested; materialise tokenised_tasks first"
        )
    return row


def _check_same(existing: TaskSet, source_sha: str, tok_sha: str, max_seq_len: int) -> None:
    if existing.source_sha256 != source_sha:
        raise ImmutableTaskSetError(
            f"task set {existing.name!r} was ingested from a file with sha256 "
            f"{existing.source_sha256[:12]}…, but its inbox file now hashes to {source_sha[:12]}…; "
            "task sets are immutable: submit the new file under a new name"
        )
    if existing.tokenizer_sha256 != tok_sha or existing.max_seq_len != max_seq_len:
        raise ImmutableTaskSetError(
            f"task set {existing.name!r} was tokenised with another tokenizer or max_seq_len "
            f"({existing.model_id}, {existing.max_seq_len}); submit it under a new name to "
            "tokenise it for this engine"
        )


def write_task_ids(conn: Any, set_id: int, record_no: np.ndarray, task_ids: list[str]) -> None:
    """Every task's id, in bulk: PostgreSQL COPY of a CSV that Arrow writes; SQLite executemany."""
    if not task_ids:
        return
    if conn.dialect.name == "postgresql":
        table = pa.table(
            {
                "task_set_id": pa.array(np.full(len(task_ids), set_id, dtype=np.int32)),
                "record_no": pa.array(record_no, type=pa.int64()),
                "task_id": pa.array(task_ids, type=pa.string()),
            }
        )
        sink = pa.BufferOutputStream()
        pa_csv.write_csv(table, sink, pa_csv.WriteOptions(include_header=False))
        raw = conn.connection.driver_connection
        with (
            raw.cursor() as cur,
            cur.copy(
                "COPY tasks (task_set_id, record_no, task_id) FROM STDIN (FORMAT csv)"
            ) as copy,
        ):
            copy.write(sink.getvalue().to_pybytes())
        return
    cursor = conn.connection.driver_connection.cursor()
    cursor.executemany(
        "INSERT INTO tasks (task_set_id, record_no, task_id) VALUES (?, ?, ?)",
        zip([set_id] * len(task_ids), record_no.tolist(), task_ids, strict=True),
    )


def list_task_sets(db: Engine) -> list[str]:
    with Session(db) as session:
        return list(session.scalars(select(TaskSet.name).order_by(TaskSet.name)))


def forget_task_set(db: Engine, paths: FabricPaths, task_set: str) -> None:
    """Delete every trace of `task_set`: rows, stored files and its inbox file.

    Shard files are content-addressed and may be shared, so only their rows go; the files stay.
    """
    with db.begin() as conn:
        set_id = conn.execute(select(TaskSet.id).where(TaskSet.name == task_set)).scalar()
        if set_id is not None:
            conn.execute(delete(Embedding).where(Embedding.task_set_id == set_id))
            conn.execute(delete(Task).where(Task.task_set_id == set_id))
        for table in (TaskFailure, Batch, BatchPlan, HiddenStateShard):
            conn.execute(delete(table).where(table.task_set == task_set))
        conn.execute(delete(TaskSet).where(TaskSet.name == task_set))
    (paths.task_sets / f"{task_set}.arrow").unlink(missing_ok=True)
    for plan in (paths.plans / task_set).glob("*.arrow"):
        plan.unlink()
    for path in paths.inbox.glob(f"{task_set}.*"):
        path.unlink()
