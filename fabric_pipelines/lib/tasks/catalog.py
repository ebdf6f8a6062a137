"""The ingest stage: inbox file -> tokenised Arrow task set + its database row and failures.

Task sets are immutable. Ingesting a set again with the same file and settings reuses what is
stored (after checking its hash); with a different file or settings it is refused. The inbox file
must still be the one submitted (its sha256 was recorded then). The stored file is named by its
own sha256 (`task_sets/<set>/<sha256>.arrow`), so two ingests racing on one set never overwrite
each other's file; the database row decides which one counts. A stored file that no longer
verifies is rebuilt from the inbox file when that still hashes to what was ingested.
"""

from __future__ import annotations

import contextlib
import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
from sqlalchemy import Engine, delete, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fabric_gpu.model import load_tokenizer, resolve_model_dir, tokenizer_sha256
from fabric_pipelines.lib.core.files import (
    CorruptFileError,
    StoredFile,
    sha256_file,
    stream_content_addressed,
)
from fabric_pipelines.lib.core.futures import done
from fabric_pipelines.lib.core.retry import unit_of_work
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.store import task_partitions
from fabric_pipelines.lib.store.db import sqlite_has_json
from fabric_pipelines.lib.store.keys import set_id_of
from fabric_pipelines.lib.store.models import (
    AwaitedResult,
    DocumentWindow,
    Embedding,
    ResultKey,
    ReusedResult,
    Task,
    TaskFailure,
    TaskSet,
)
from fabric_pipelines.lib.store.result_links import hand_over_results
from fabric_pipelines.lib.tasks.arrow_files import read_table, single_chunk, to_table, write_ipc
from fabric_pipelines.lib.tasks.inbox import (
    forget_submitted,
    record_submitted,
    set_aside,
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
from fabric_pipelines.lib.tasks.prompts import forget_prompt
from fabric_pipelines.lib.tasks.source_read import SourceRead, read_source, take_read_ahead
from fabric_pipelines.lib.tasks.windows import WINDOW_BASE, LongInputs

# SQLite page cache while task ids are inserted, in KiB (the default is 2 MiB).
SQLITE_INSERT_CACHE_KIB = 256 * 1024
# Task ids per INSERT statement on SQLite (one JSON array each): a few MB of text.
SQLITE_IDS_PER_STATEMENT = 1 << 18
# How often a transaction waiting for a thread's work shows its server it is alive, in seconds.
KEEPALIVE_S = 10.0


T = TypeVar("T")


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
    prompt: str = ""  # put before each text before tokenising
    n_chunked: int = 0  # documents split into windows (tasks/windows.py)
    n_windows: int = 0  # their windows, which are tasks among n_tasks


@unit_of_work("ingesting task set {task_set!r}")
def ingest_task_set(
    db: Engine,
    paths: FabricPaths,
    task_set: str,
    *,
    model_id: str,
    max_seq_len: int,
    truncate: bool = False,
    long_inputs: LongInputs | None = None,
    prompt: str = "",
    progress: bool = False,
) -> IngestSummary:
    """Ingest the inbox file of `task_set` (or reuse what is stored, see the module's doc).
    `prompt` goes before every text (a set is its file and its prompt). Over-long records follow
    `long_inputs` (default: fail, or truncate if `truncate`). Once the set is stored its file
    leaves the inbox (tasks/inbox.set_aside)."""
    policy = long_inputs or LongInputs("truncate" if truncate else "fail")

    def run() -> IngestSummary:
        return _ingest_task_set(
            db, paths, task_set, model_id=model_id, max_seq_len=max_seq_len, policy=policy,
            prompt=prompt, progress=progress,
        )  # fmt: skip

    try:
        summary = run()
    except FileNotFoundError:
        # Another run stored the set and moved its file aside while this one read it: that
        # run's set counts, and this run reads it as stored.
        if _find(db, task_set) is None:
            raise
        summary = run()
    set_aside(paths.inbox, task_set)
    return summary


def _ingest_task_set(
    db: Engine,
    paths: FabricPaths,
    task_set: str,
    *,
    model_id: str,
    max_seq_len: int,
    policy: LongInputs,
    prompt: str,
    progress: bool,
) -> IngestSummary:
    """The ingest of `ingest_task_set`.

    Independent steps overlap, in threads (hashing, Arrow, SQLite and the PostgreSQL server all
    run without the GIL): a Parquet file is read into memory once, hashed while its columns are
    parsed; and the stored file is written while the rows go into the database."""
    source = submission_path(paths.inbox, task_set)
    existing = _find(db, task_set)
    with ThreadPoolExecutor(4, thread_name_prefix="ingest") as pool:
        # Read ahead by `fabric submit --run` in this process while Dagster loaded, else now.
        read = take_read_ahead(source) or read_source(pool, source, parse=existing is None)
        source_sha = read.sha256()
        _check_as_submitted(paths, task_set, source, source_sha, existing)
        model_dir = resolve_model_dir(model_id)
        tok_sha = tokenizer_sha256(model_dir)
        if existing is not None:
            return _reuse(db, paths, existing, source, source_sha, tok_sha, max_seq_len, prompt)
        row = _SetRow(task_set, source_sha, model_id, tok_sha, max_seq_len, prompt, policy.label)
        columns = read.columns()
        tasks = ingest(
            source,
            load_tokenizer(model_dir, prompt),
            max_seq_len=max_seq_len,
            long_inputs=policy,
            progress=progress,
            columns=columns,
        )
        if columns is None:  # the file was read again after it was hashed: still the same?
            after = sha256_file(source)
            if after != source_sha:
                raise SubmissionError(
                    f"inbox file {source.name} changed while it was read (sha256 "
                    f"{source_sha} before, {after} after); nothing was ingested: leave the "
                    "file alone and run again"
                )
        del columns
        read = SourceRead(done(source_sha))  # lets go of the file's bytes and columns
        # The stored file is written, hashed and synced while the rows go into the database.
        storing = pool.submit(
            _store, paths, task_set, tasks, source_sha, model_id, tok_sha, max_seq_len, prompt
        )
        try:
            stored = _register(db, row, tasks, storing)
        except IntegrityError:
            # Another run ingested the set first: it counts; this one's file goes unless
            # identical.
            stored = storing.result()
            winner = _find(db, task_set)
            if winner is None:
                raise
            if Path(winner.path) != stored.path:
                stored.path.unlink(missing_ok=True)
            return _reuse(db, paths, winner, source, source_sha, tok_sha, max_seq_len, prompt)
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
        prompt,
        tasks.n_chunked,
        0 if tasks.windows is None else len(tasks.windows.document),
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
    prompt: str,
) -> StoredFile:
    metadata = {
        "fabric.task_set": task_set,
        "fabric.source_sha256": source_sha,
        "fabric.model_id": model_id,
        "fabric.tokenizer_sha256": tok_sha,
        "fabric.max_seq_len": str(max_seq_len),
    }
    if prompt:  # only then: a set without one stores, and rebuilds to, the same bytes as before
        metadata["fabric.prompt"] = prompt
    if tasks.windows is not None:  # likewise: only a set with windows says how they were cut
        metadata["fabric.long_inputs"] = f"chunk:{_overlap_of(tasks)}"
    table = to_table(tasks)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    # Streamed: each buffer is hashed as it is written, the file is not read back.
    return stream_content_addressed(
        paths.task_sets / task_set, ".arrow", lambda out: write_ipc(out, table)
    )


@dataclass(frozen=True)
class _SetRow:
    """What the task-set row records of the ingest itself."""

    task_set: str
    source_sha256: str
    model_id: str
    tokenizer_sha256: str
    max_seq_len: int
    prompt: str
    long_inputs: str  # LongInputs.label


def _overlap_of(tasks: TokenisedTasks) -> int:
    """The overlap the windows were cut with (kept on the windows for the file's metadata)."""
    assert tasks.windows is not None
    return tasks.windows.overlap


def _register(
    db: Engine, row: _SetRow, tasks: TokenisedTasks, storing: Future[StoredFile]
) -> StoredFile:
    """The task-set row, every task id and every failure, in one transaction. The row's hash
    and path are filled in last, before the commit, from the stored file, which is written
    meanwhile (`storing`)."""
    with db.begin() as conn:
        set_id = _insert_set_row(conn, row)
        write_task_ids(conn, set_id, *tasks.documents())
        _insert_document_windows(conn, set_id, tasks)
        stored = _complete(conn, set_id, row, tasks, storing)
        attach_task_ids(conn, set_id)
        return stored


def _insert_document_windows(conn: Any, set_id: int, tasks: TokenisedTasks) -> None:
    windows = tasks.windows
    if windows is None:
        return
    conn.execute(
        insert(DocumentWindow),
        [
            {
                "task_set_id": set_id,
                "record_no": r,
                "first_window": f,
                "n_windows": n,
                "n_tokens": t,
            }
            for r, f, n, t in zip(
                windows.doc_record_no.tolist(),
                (WINDOW_BASE + windows.first_window).tolist(),
                windows.n_windows.tolist(),
                windows.doc_tokens.tolist(),
                strict=True,
            )
        ],
    )


def attach_task_ids(conn: Any, set_id: int) -> None:
    """PostgreSQL: the set's ids, written by `write_task_ids`, become its partition of `tasks`;
    last in the ingest's transaction, as the lock it takes lasts until the commit. SQLite wrote
    them into `tasks` itself."""
    if conn.dialect.name == "postgresql":
        with conn.connection.driver_connection.cursor() as cursor:
            task_partitions.attach(cursor, set_id)


def _insert_set_row(conn: Any, row: _SetRow) -> int:
    """The task-set row; what is known only at the end is filled in by `_complete`."""
    set_id: int = conn.execute(
        insert(TaskSet).returning(TaskSet.id),
        {
            "name": row.task_set,
            "source_sha256": row.source_sha256,
            "content_sha256": "",
            "path": "",
            "model_id": row.model_id,
            "tokenizer_sha256": row.tokenizer_sha256,
            "max_seq_len": row.max_seq_len,
            "prompt": row.prompt,
            "long_inputs": row.long_inputs,
            "n_records": 0,
            "n_tasks": 0,
            "truncated": 0,
        },
    ).scalar_one()
    return set_id


def _complete(
    conn: Any, set_id: int, row: _SetRow, tasks: TokenisedTasks, storing: Future[StoredFile]
) -> StoredFile:
    """The failures, and the rest of the task-set row (once the file is stored)."""
    if tasks.failures:
        conn.execute(
            insert(TaskFailure),
            [
                {
                    "task_set_id": set_id,
                    "record_no": f.record_no,
                    "task_id": f.task_id,
                    "stage": "ingest",
                    "reason": f.reason,
                }
                for f in map(storable_failure, tasks.failures)
            ],
        )
    file = _wait(conn, storing)
    conn.execute(
        update(TaskSet)
        .where(TaskSet.id == set_id)
        .values(
            content_sha256=file.sha256,
            path=str(file.path),
            n_records=tasks.n_records,
            n_tasks=len(tasks.task_ids),
            truncated=tasks.truncated,
            n_chunked=tasks.n_chunked,
            n_windows=0 if tasks.windows is None else len(tasks.windows.document),
        )
    )
    return file


def _wait(conn: Any, future: Future[T]) -> T:
    """The result of `future`, keeping the session of the open transaction busy meanwhile (a
    PostgreSQL server ends a session idle in a transaction for a minute)."""
    while True:
        try:
            return future.result(timeout=KEEPALIVE_S)
        except TimeoutError:
            if future.done():  # the result itself is a TimeoutError
                raise
            conn.execute(select(1))


def _reuse(
    db: Engine,
    paths: FabricPaths,
    existing: TaskSet,
    source: Path,
    source_sha: str,
    tok_sha: str,
    max_seq_len: int,
    prompt: str,
) -> IngestSummary:
    """The summary of a set ingested before, from its row, stored file and failure rows."""
    table = _read_or_rebuild(db, paths, existing, source, source_sha)
    _check_same(existing, source_sha, tok_sha, max_seq_len, prompt)
    with Session(db) as session:
        failures = [
            Failure(f.record_no, f.task_id, f.reason)
            for f in session.scalars(
                select(TaskFailure)
                .where(
                    TaskFailure.task_set_id == set_id_of(existing.name),
                    TaskFailure.stage == "ingest",
                )
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
        existing.prompt,
        existing.n_chunked,
        existing.n_windows,
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
    tasks = ingest(
        source,
        load_tokenizer(model_dir, existing.prompt),
        max_seq_len=existing.max_seq_len,
        long_inputs=long_inputs_of(existing),
    )
    rebuilt = _store(
        paths,
        name,
        tasks,
        source_sha,
        existing.model_id,
        existing.tokenizer_sha256,
        existing.max_seq_len,
        existing.prompt,
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


def long_inputs_of(task_set: TaskSet) -> LongInputs:
    """How the set took its over-long records. A set stored before sets recorded it truncated
    them if, and only if, any was: its count says which was asked."""
    if task_set.long_inputs:
        return LongInputs.from_label(task_set.long_inputs)
    return LongInputs("truncate" if task_set.truncated > 0 else "fail")


def task_lengths(table: pa.Table) -> np.ndarray:
    offsets = single_chunk(table.column("token_ids")).offsets.to_numpy()
    return np.diff(offsets).astype(np.int64)


@unit_of_work("reading task set {task_set!r}")
def get_task_set(db: Engine, task_set: str) -> TaskSet:
    with Session(db, expire_on_commit=False) as session:
        row = session.scalars(select(TaskSet).where(TaskSet.name == task_set)).one_or_none()
    if row is None:
        raise LookupError(
            f"task set {task_set!r} is not ingested; materialise tokenised_tasks first"
        )
    return row


def _check_same(
    existing: TaskSet, source_sha: str, tok_sha: str, max_seq_len: int, prompt: str
) -> None:
    if existing.source_sha256 != source_sha:
        raise ImmutableTaskSetError(
            f"task set {existing.name!r} was ingested from a file with sha256 "
            f"{existing.source_sha256}, but its inbox file now hashes to {source_sha}; "
            "task sets are immutable: submit the new file under a new name"
        )
    if existing.tokenizer_sha256 != tok_sha or existing.max_seq_len != max_seq_len:
        raise ImmutableTaskSetError(
            f"task set {existing.name!r} was tokenised with another tokenizer or max_seq_len "
            f"({existing.model_id}, {existing.max_seq_len}); run it with --max-seq-len "
            f"{existing.max_seq_len} and that model, or submit it under a new name to tokenise "
            "it for this engine"
        )
    if existing.prompt != prompt:
        raise ImmutableTaskSetError(
            f"task set {existing.name!r} was tokenised with prompt {existing.prompt!r}, not "
            f"{prompt!r}; submit the data under a new name to use another prompt"
        )


def write_task_ids(conn: Any, set_id: int, record_no: np.ndarray, task_ids: list[str]) -> None:
    """Every task's id, in bulk: on PostgreSQL a COPY of a CSV that Arrow writes, into the set's
    own table (store/task_partitions.py; `attach_task_ids` makes it a partition of `tasks`);
    on SQLite an INSERT from a JSON array of ids per statement (SQLite reads it in C, no Python
    per row)."""
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
        with conn.connection.driver_connection.cursor() as cursor:
            task_partitions.copy_into_new_partition(cursor, set_id, memoryview(sink.getvalue()))
        return
    if not task_ids:
        return
    cursor = conn.connection.driver_connection.cursor()
    # Ids in no particular order land all over the unique index on (set, id): a page cache that
    # holds the index saves re-reading its pages (a third less time for 1 M random ids). The
    # cache size belongs to the pooled connection, so it is put back after.
    (cache_size,) = cursor.execute("PRAGMA cache_size").fetchone()
    cursor.execute(f"PRAGMA cache_size = {-SQLITE_INSERT_CACHE_KIB}")
    try:
        if sqlite_has_json() and bool(np.all(np.diff(record_no) > 0)):
            _insert_json_arrays(cursor, set_id, record_no, task_ids)
        else:
            _insert_rows(cursor, set_id, record_no, task_ids)
    finally:
        cursor.execute(f"PRAGMA cache_size = {int(cache_size)}")


def _insert_rows(cursor: Any, set_id: int, record_no: np.ndarray, task_ids: list[str]) -> None:
    cursor.executemany(
        "INSERT INTO tasks (task_set_id, record_no, task_id) VALUES (?, ?, ?)",
        zip([set_id] * len(task_ids), record_no.tolist(), task_ids, strict=True),
    )


def _insert_json_arrays(
    cursor: Any, set_id: int, record_no: np.ndarray, task_ids: list[str]
) -> None:
    """Per statement, a JSON array holding the ids of a run of consecutive record numbers
    (null for a record that is no task); the array index gives the record number. `record_no`
    ascends."""
    for start in range(0, len(task_ids), SQLITE_IDS_PER_STATEMENT):
        stop = min(start + SQLITE_IDS_PER_STATEMENT, len(task_ids))
        first = int(record_no[start])
        span = int(record_no[stop - 1]) - first + 1
        ids: list[Any] = task_ids[start:stop]
        if span != stop - start:
            slots = np.full(span, None, dtype=object)
            slots[record_no[start:stop] - first] = ids
            ids = slots.tolist()
        text = json.dumps(ids, ensure_ascii=False)
        if "\\u0000" in text:  # a NUL, as SQLite's JSON reader may not give it back: bind it
            _insert_rows(cursor, set_id, record_no[start:stop], task_ids[start:stop])
            continue
        cursor.execute(
            "INSERT INTO tasks (task_set_id, record_no, task_id) "
            "SELECT ?, ? + key, value FROM json_each(?) WHERE type = 'text'",
            (set_id, first, text),
        )


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
            # Rows other sets' tasks reuse stay, as one of those tasks' own (broker/reuse.py).
            hand_over_results(conn, set_id)
            conn.execute(delete(Embedding).where(Embedding.task_set_id == set_id))
            conn.execute(delete(ResultKey).where(ResultKey.task_set_id == set_id))
            conn.execute(delete(ReusedResult).where(ReusedResult.task_set_id == set_id))
            # Other sets waiting on this one's tasks see it stop running and take their keys over.
            conn.execute(delete(AwaitedResult).where(AwaitedResult.task_set_id == set_id))
            # PostgreSQL: a set's own partition goes after the commit, rows and all.
            if conn.dialect.name != "postgresql" or not task_partitions.has_own(conn, set_id):
                conn.execute(delete(Task).where(Task.task_set_id == set_id))
        # Its failures, plans, ledger rows and shard rows go with it (foreign keys, cascading).
        conn.execute(delete(TaskSet).where(TaskSet.name == task_set))
    if set_id is not None and db.dialect.name == "postgresql":
        task_partitions.drop_partition(db, set_id)
    if stored is not None:
        Path(stored.path).unlink(missing_ok=True)
    (paths.task_sets / f"{task_set}.arrow").unlink(missing_ok=True)  # stored before hash names
    for folder in (paths.task_sets / task_set, paths.plans / task_set):
        for path in folder.glob("*.arrow"):
            path.unlink()
        with contextlib.suppress(FileNotFoundError, OSError):  # absent, or holds a stray file
            folder.rmdir()
    for suffix in SUPPORTED_SUFFIXES:  # not a glob: set "a" must not take "a.b.jsonl" with it
        (paths.inbox / f"{task_set}{suffix}").unlink(missing_ok=True)
    forget_submitted(paths.inbox, task_set)
    forget_prompt(paths.inbox, task_set)


@unit_of_work("reading the prompts of task sets {task_sets}")
def task_set_prompts(db: Engine, task_sets: list[str]) -> dict[str, str]:
    """Each named set's prompt ("" for none); sets not ingested are left out."""
    with db.connect() as conn:
        rows = conn.execute(
            select(TaskSet.name, TaskSet.prompt).where(TaskSet.name.in_(task_sets))
        ).all()
    return {name: prompt for name, prompt in rows}
