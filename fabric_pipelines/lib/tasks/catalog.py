"""The ingest stage: inbox file -> tokenised Arrow task set + its database row and failures.

Task sets are immutable. Ingesting a set again with the same file and settings reuses what is
stored (after checking its hash); with a different file or settings it is refused. The inbox file
must still be the one submitted (its sha256 was recorded then). The stored file is named by its
own sha256 (`task_sets/<set>/<sha256>.arrow`), so two ingests racing on one set never overwrite
each other's file; the database row decides which one counts. A stored file that no longer
verifies is rebuilt from the inbox file when that still hashes to what was ingested.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
from sqlalchemy import Engine, delete, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fabric_gpu.model import load_tokenizer, resolve_model_dir, tokenizer_sha256
from fabric_pipelines.lib.files import (
    CorruptFileError,
    StoredFile,
    sha256_file,
    write_content_addressed,
)
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
from fabric_pipelines.lib.tasks.inbox import (
    forget_submitted,
    record_submitted,
    submission_path,
    submitted_sha256,
)
from fabric_pipelines.lib.tasks.ingest import (
    SUPPORTED_SUFFIXES,
    Failure,
    SubmissionError,
    TokenisedTasks,
    ingest,
    storable_failure,
)
from fabric_pipelines.lib.tasks.store import read_table, to_table

# SQLite page cache while task ids are inserted, in KiB (the default is 2 MiB).
SQLITE_INSERT_CACHE_KIB = 256 * 1024


class ImmutableTaskSetError(ValueError):
    pass


class UnrecoverableTaskSetError(ValueError):
    """A stored task-set file is damaged and cannot be rebuilt from what is left."""


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
    existing = _find(db, task_set)
    _check_as_submitted(paths, task_set, source, source_sha, existing)
    model_dir = resolve_model_dir(model_id)
    tok_sha = tokenizer_sha256(model_dir)
    if existing is not None:
        return _reuse(db, paths, existing, source, source_sha, tok_sha, max_seq_len)

    tasks = ingest(
        source,
        load_tokenizer(model_dir),
        max_seq_len=max_seq_len,
        truncate=truncate,
        progress=progress,
    )
    after = sha256_file(source)
    if after != source_sha:
        raise SubmissionError(
            f"inbox file {source.name} changed while it was read (sha256 {source_sha} before, "
            f"{after} after); nothing was ingested: leave the file alone and run again"
        )
    stored = _store(paths, task_set, tasks, source_sha, model_id, tok_sha, max_seq_len)
    try:
        _register(db, task_set, tasks, stored, source_sha, model_id, tok_sha, max_seq_len)
    except IntegrityError:
        # Another run ingested the set first: it counts; this one's file goes unless identical.
        winner = _find(db, task_set)
        if winner is None:
            raise
        if Path(winner.path) != stored.path:
            stored.path.unlink(missing_ok=True)
        return _reuse(db, paths, winner, source, source_sha, tok_sha, max_seq_len)
    return IngestSummary(
        task_set,
        tasks.n_records,
        len(tasks.task_ids),
        len(tasks.failures),
        tasks.truncated,
        source_sha,
        stored.sha256,
        stored.path,
        False,
        tasks.lengths,
        tasks.failures,
    )


def is_ingested(db: Engine, task_set: str) -> bool:
    """Whether `task_set` has a task-set row (what `submit(..., ingested=...)` asks)."""
    with db.connect() as conn:
        found = conn.execute(select(TaskSet.id).where(TaskSet.name == task_set)).first()
    return found is not None


def _find(db: Engine, task_set: str) -> TaskSet | None:
    with Session(db, expire_on_commit=False) as session:
        return session.scalars(select(TaskSet).where(TaskSet.name == task_set)).one_or_none()


def _check_as_submitted(
    paths: FabricPaths, task_set: str, source: Path, source_sha: str, existing: TaskSet | None
) -> None:
    """Refuse an inbox file that is not the one submitted. A set without a record (submitted
    before submissions were recorded) gets one now: the file ingested, else the file as it is."""
    recorded = submitted_sha256(paths.inbox, task_set)
    if recorded is None:
        recorded = existing.source_sha256 if existing is not None else source_sha
        record_submitted(paths.inbox, task_set, recorded)
    if recorded == source_sha:
        return
    remedy = (
        "task sets are immutable: put the submitted file back, or submit the new one under a new name"
        if existing is not None
        else f"put the submitted file back, or submit the new one with `fabric submit FILE "
        f"--task-set {task_set}` (it replaces the old one, since the set was never ingested)"
    )
    raise SubmissionError(
        f"inbox file {source.name} of task set {task_set!r} changed after it was submitted: "
        f"sha256 {recorded} when submitted, {source_sha} now; nothing was ingested; {remedy}"
    )


def _store(
    paths: FabricPaths,
    task_set: str,
    tasks: TokenisedTasks,
    source_sha: str,
    model_id: str,
    tok_sha: str,
    max_seq_len: int,
) -> StoredFile:
    metadata = {
        "fabric.task_set": task_set,
        "fabric.source_sha256": source_sha,
        "fabric.model_id": model_id,
        "fabric.tokenizer_sha256": tok_sha,
        "fabric.max_seq_len": str(max_seq_len),
    }
    table = to_table(tasks)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})

    def write(tmp: Path) -> None:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)

    return write_content_addressed(paths.task_sets / task_set, ".arrow", write)


def _register(
    db: Engine,
    task_set: str,
    tasks: TokenisedTasks,
    stored: StoredFile,
    source_sha: str,
    model_id: str,
    tok_sha: str,
    max_seq_len: int,
) -> None:
    """The task-set row, every task id and every failure, in one transaction."""
    with db.begin() as conn:
        set_id = conn.execute(
            insert(TaskSet).returning(TaskSet.id),
            {
                "name": task_set,
                "source_sha256": source_sha,
                "content_sha256": stored.sha256,
                "path": str(stored.path),
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
                    for f in map(storable_failure, tasks.failures)
                ],
            )


def _reuse(
    db: Engine,
    paths: FabricPaths,
    existing: TaskSet,
    source: Path,
    source_sha: str,
    tok_sha: str,
    max_seq_len: int,
) -> IngestSummary:
    """The summary of a set ingested before, from its row, stored file and failure rows."""
    table = _read_or_rebuild(db, paths, existing, source, source_sha)
    _check_same(existing, source_sha, tok_sha, max_seq_len)
    with Session(db) as session:
        failures = [
            Failure(f.record_no, f.task_id, f.reason)
            for f in session.scalars(
                select(TaskFailure)
                .where(TaskFailure.task_set == existing.name, TaskFailure.stage == "ingest")
                .order_by(TaskFailure.record_no)
            )
        ]
    return IngestSummary(
        existing.name,
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


def _read_or_rebuild(
    db: Engine, paths: FabricPaths, existing: TaskSet, source: Path, source_sha: str
) -> pa.Table:
    """The stored table; if its file is missing or damaged, rebuilt from the inbox file with the
    set's own settings, provided the result hashes exactly to what was recorded."""
    try:
        return read_table(Path(existing.path), existing.content_sha256)
    except (CorruptFileError, FileNotFoundError) as exc:
        damage = str(exc).split(";")[0]
    name = existing.name
    if source_sha != existing.source_sha256:
        raise UnrecoverableTaskSetError(
            f"{damage}; it cannot be rebuilt because the inbox file {source.name} no longer is "
            f"the one ingested (sha256 {existing.source_sha256} then, {source_sha} now): put that "
            f"file back and run again, or resubmit the data under a new name"
        )
    model_dir = resolve_model_dir(existing.model_id)
    if tokenizer_sha256(model_dir) != existing.tokenizer_sha256:
        raise UnrecoverableTaskSetError(
            f"{damage}; it cannot be rebuilt because the tokenizer of {existing.model_id} changed "
            "since the set was ingested: resubmit the data under a new name"
        )
    # Over-long records were truncated if, and only if, any was: the count says which was asked.
    tasks = ingest(
        source,
        load_tokenizer(model_dir),
        max_seq_len=existing.max_seq_len,
        truncate=existing.truncated > 0,
    )
    rebuilt = _store(
        paths,
        name,
        tasks,
        source_sha,
        existing.model_id,
        existing.tokenizer_sha256,
        existing.max_seq_len,
    )
    if rebuilt.sha256 != existing.content_sha256:
        if rebuilt.path != Path(existing.path):
            rebuilt.path.unlink(missing_ok=True)
        raise UnrecoverableTaskSetError(
            f"{damage}; re-tokenising the inbox file gives other content (sha256 "
            f"{rebuilt.sha256}, recorded {existing.content_sha256}), so it cannot be restored: "
            "resubmit the data under a new name"
        )
    if rebuilt.path != Path(existing.path):  # a set stored before files were named by hash
        with db.begin() as conn:
            conn.execute(
                update(TaskSet).where(TaskSet.id == existing.id).values(path=str(rebuilt.path))
            )
        Path(existing.path).unlink(missing_ok=True)
        existing.path = str(rebuilt.path)
    return read_table(rebuilt.path, existing.content_sha256)


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
            f"{existing.source_sha256}, but its inbox file now hashes to {source_sha}; "
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
    # Ids in no particular order land all over the unique index on (set, id): a page cache that
    # holds the index saves re-reading its pages (a third less time for 1 M random ids). The
    # cache size belongs to the pooled connection, so it is put back after.
    (cache_size,) = cursor.execute("PRAGMA cache_size").fetchone()
    cursor.execute(f"PRAGMA cache_size = {-SQLITE_INSERT_CACHE_KIB}")
    try:
        cursor.executemany(
            "INSERT INTO tasks (task_set_id, record_no, task_id) VALUES (?, ?, ?)",
            zip([set_id] * len(task_ids), record_no.tolist(), task_ids, strict=True),
        )
    finally:
        cursor.execute(f"PRAGMA cache_size = {int(cache_size)}")


def list_task_sets(db: Engine) -> list[str]:
    with Session(db) as session:
        return list(session.scalars(select(TaskSet.name).order_by(TaskSet.name)))


def forget_task_set(db: Engine, paths: FabricPaths, task_set: str) -> None:
    """Delete every trace of `task_set`: rows, stored files and its inbox file.

    Shard files are content-addressed and may be shared, so only their rows go; the files stay.
    """
    stored = _find(db, task_set)
    with db.begin() as conn:
        set_id = conn.execute(select(TaskSet.id).where(TaskSet.name == task_set)).scalar()
        if set_id is not None:
            conn.execute(delete(Embedding).where(Embedding.task_set_id == set_id))
            conn.execute(delete(Task).where(Task.task_set_id == set_id))
        for table in (TaskFailure, Batch, BatchPlan, HiddenStateShard):
            conn.execute(delete(table).where(table.task_set == task_set))
        conn.execute(delete(TaskSet).where(TaskSet.name == task_set))
    if stored is not None:
        Path(stored.path).unlink(missing_ok=True)
    (paths.task_sets / f"{task_set}.arrow").unlink(missing_ok=True)  # stored before hash names
    for folder in (paths.task_sets / task_set, paths.plans / task_set):
        for path in folder.glob("*.arrow"):
            path.unlink()
    for suffix in SUPPORTED_SUFFIXES:  # not a glob: set "a" must not take "a.b.jsonl" with it
        (paths.inbox / f"{task_set}{suffix}").unlink(missing_ok=True)
    forget_submitted(paths.inbox, task_set)
