"""Never compute the same thing twice: results reused by content key.

A task's content key is the sha256 of what decides its result: the model key (model, weights,
pooling, normalisation, output variant), the hook layers, and the task's final token ids (its
prompt's tokens included). When a set is planned, its keys are stored (`content_keys`), and
each outstanding task whose key already has a stored result, in any set, is linked to it
(`reused_results`) and gets a copy of that row instead of a place in a batch. Duplicates inside
the set are planned once: the first (by record number) runs, the others are linked to it and
copied from it once it is stored (`copy_pending`, after the workers; a rerun's planning copies
any left), or fail with its reason if it failed.

Accounting: tasks = completed + reused + failed + in_flight + queued, where `reused` counts
linked tasks whose copy is stored and a linked task still waiting for its source counts as
queued (broker/ledger.py).

Concurrency: a copy is inserted only where the task has no row yet (PostgreSQL: ON CONFLICT DO
NOTHING; SQLite: under the write lock), and the writer ignores rows already there, so a task
computed and copied at once still has one row. Two sets planned at once with shared content
may both compute a key (neither has a result to link yet); each task is still stored once.

Not reused: windows of chunked documents (a document's vector is combined from its windows,
lib/results/documents.py), and runs that keep hook layers (their hidden-state files are per batch).
FABRIC_REUSE=off (or the engine resource's `reuse_results: false`) turns reuse off.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import (
    BigInteger,
    Connection,
    DateTime,
    Engine,
    Exists,
    Integer,
    and_,
    cast,
    func,
    insert,
    literal,
    select,
    text,
)
from sqlalchemy.orm import aliased

from fabric_pipelines.lib.store.db import insert_ignoring_duplicates
from fabric_pipelines.lib.store.keys import model_id, task_set_id
from fabric_pipelines.lib.store.models import (
    WINDOW_BASE,
    ContentKey,
    Embedding,
    ReusedResult,
    Task,
    TaskFailure,
    utcnow,
)
from fabric_pipelines.lib.store.pgcopy import HEADER, TRAILER
from fabric_pipelines.lib.store.vector_columns import BITS, BYTES, FLOAT32, HALF, VectorColumns
from fabric_pipelines.lib.store.watermarks import count_inserted

KEY_BYTES = 32
# A (set id, record number) pair as one integer, for MIN() over sources: record numbers stay
# below WINDOW_BASE (2**39) here, so 2**40 keeps them apart.
PAIR_STRIDE = 2**40
OFF_VALUES = {"0", "off", "false", "no"}


def reuse_enabled(setting: bool | None = None) -> bool:
    """`setting` if given, else FABRIC_REUSE (on unless "off", "0", "false" or "no")."""
    if setting is not None:
        return setting
    return os.environ.get("FABRIC_REUSE", "on").strip().lower() not in OFF_VALUES


def content_keys(
    tokens: np.ndarray, offsets: np.ndarray, model_key: str, layers: Sequence[int] = ()
) -> np.ndarray:
    """Each task's content key (dtype S32; `key_bytes` for the bytes): sha256 over the JSON
    {"layers": [...], "model_key": ...} (sorted keys) followed by the task's token ids as
    little-endian int32."""
    head = hashlib.sha256(
        json.dumps({"model_key": model_key, "layers": list(layers)}, sort_keys=True).encode()
    )
    data = np.ascontiguousarray(tokens, dtype="<i4")
    view = memoryview(data.view(np.uint8).data)
    bounds = (np.asarray(offsets, dtype=np.int64) * 4).tolist()
    out = np.empty(len(bounds) - 1, dtype=f"S{KEY_BYTES}")
    copy = head.copy
    for i in range(len(out)):
        digest = copy()
        digest.update(view[bounds[i] : bounds[i + 1]])
        out[i] = digest.digest()
    return out


def key_bytes(keys: np.ndarray) -> list[bytes]:
    """The keys as 32-byte strings (NumPy's S32 items drop trailing zero bytes: not these)."""
    data = np.ascontiguousarray(keys).tobytes()
    return [data[i : i + KEY_BYTES] for i in range(0, len(data), KEY_BYTES)]


@dataclass(frozen=True)
class Reuse:
    """What planning a set took from stored results instead of the engine."""

    linked: int  # tasks linked to a stored result of another task (this planning)
    copied: int  # rows copied from their sources (this planning)
    deferred: int  # duplicates inside the set, waiting for their first copy to be stored
    rows: np.ndarray  # the task rows left to plan


def link_before_planning(
    db: Engine,
    set_id: int,
    model_id: int,
    record_no: np.ndarray,
    keys: np.ndarray,
    outstanding: np.ndarray,
) -> Reuse:
    """Store the set's keys (once), copy stored results to the outstanding tasks whose key has
    one, and defer the set's own duplicates to their first copy; the rows left to plan."""
    eligible = record_no < WINDOW_BASE
    with db.begin() as conn:
        _lock_planning(conn, set_id)
        _store_keys(conn, set_id, model_id, record_no[eligible], keys[eligible])
        linked = _link_stored(conn, set_id, model_id)
        # Also copies to links left waiting by an earlier run whose sources are stored now.
        copied = _copy_linked(conn, set_id, model_id)
    rows = outstanding[~np.isin(record_no[outstanding], np.union1d(linked, copied))]
    # Among what is left, the first of each key runs; the others wait for its row.
    candidates = rows[eligible[rows]]
    order = candidates[np.argsort(record_no[candidates], kind="stable")]
    _, first = np.unique(keys[order], return_index=True)
    is_first = np.zeros(order.size, dtype=bool)
    is_first[first] = True
    duplicates = order[~is_first]
    if duplicates.size:
        first_of_key = dict(zip(key_bytes(keys[order[first]]), order[first].tolist(), strict=True))
        sources = np.fromiter(
            (first_of_key[k] for k in key_bytes(keys[duplicates])), np.int64, duplicates.size
        )
        with db.begin() as conn:
            _insert_links(conn, set_id, model_id, record_no[duplicates], set_id, record_no[sources])
        rows = rows[~np.isin(rows, duplicates)]
    return Reuse(
        linked=int(linked.size), copied=int(copied.size), deferred=int(duplicates.size), rows=rows
    )


def pending_record_nos(conn: Connection, set_id: int, model_id: int) -> np.ndarray:
    """The set's linked tasks with neither their copy nor a failure yet."""
    return np.fromiter(
        conn.execute(
            select(ReusedResult.record_no).where(
                ReusedResult.task_set_id == set_id,
                ReusedResult.model_id == model_id,
                ~_target_stored(ReusedResult),
                ~_target_failed(ReusedResult),
            )
        ).scalars(),
        dtype=np.int64,
    )


def copy_pending(db: Engine, set_id: int, model_id: int) -> tuple[int, int]:
    """After the workers: copy each waiting linked task's row from its source, now stored, or
    fail it with its source's reason; (copied, failed)."""
    with db.begin() as conn:
        copied = _copy_linked(conn, set_id, model_id)
        failed = _fail_linked(conn, set_id, model_id)
    return int(copied.size), failed


def copy_pending_of(db: Engine, task_set: str, model_key: str) -> tuple[int, int]:
    """`copy_pending` by names."""
    with db.begin() as conn:
        set_id, mid = task_set_id(conn, task_set), model_id(conn, model_key)
    return copy_pending(db, set_id, mid)


def stored_keys(conn: Connection, model_id: int, keys: np.ndarray) -> np.ndarray:
    """Which of `keys` have a stored result of the model (for `fabric plan`, storing nothing)."""
    if keys.size == 0:
        return np.zeros(0, dtype=bool)
    wanted = np.unique(keys)
    found: list[bytes] = []
    step = 500  # bound parameters per statement
    for start in range(0, wanted.size, step):
        chunk = key_bytes(wanted[start : start + step])
        found += conn.execute(
            select(ContentKey.content_key)
            .join(
                Embedding,
                and_(
                    Embedding.model_id == ContentKey.model_id,
                    Embedding.task_set_id == ContentKey.task_set_id,
                    Embedding.record_no == ContentKey.record_no,
                ),
            )
            .where(ContentKey.model_id == model_id, ContentKey.content_key.in_(chunk))
            .distinct()
        ).scalars()
    return np.isin(keys, np.array(found, dtype=f"S{KEY_BYTES}"))


def reused_copies(conn: Connection, set_id: int, model_key: str) -> tuple[int, int]:
    """(copied rows of the set, how many of them differ from their source's row where that is
    still stored: a forgotten set takes its rows, never the copies made of them)."""
    differs = "IS DISTINCT FROM" if conn.dialect.name == "postgresql" else "IS NOT"
    changed = " OR ".join(f"s.{c} {differs} t.{c}" for c in ["n_tokens", *_vector_columns(conn)])
    row = conn.execute(
        text(
            f"SELECT count(*), sum(CASE WHEN s.record_no IS NOT NULL AND ({changed}) "
            "THEN 1 ELSE 0 END) "
            "FROM reused_results r JOIN models m ON m.id = r.model_id "
            "JOIN embeddings t ON t.model_id = r.model_id AND t.task_set_id = r.task_set_id "
            "AND t.record_no = r.record_no "
            "LEFT JOIN embeddings s ON s.model_id = r.model_id "
            "AND s.task_set_id = r.from_task_set_id AND s.record_no = r.from_record_no "
            "WHERE r.task_set_id = :set AND m.model_key = :model"
        ),
        {"set": set_id, "model": model_key},
    ).one()
    return int(row[0] or 0), int(row[1] or 0)


# ---- inside one transaction -------------------------------------------------------------------

# The first of the two 32-bit advisory lock keys planning takes (the set id is the second): the
# bytes of "fbru". Two-key locks never meet the schema's 64-bit one (store/schema.py).
PLANNING_LOCK_CLASS = 0x66627275


def _lock_planning(conn: Connection, set_id: int) -> None:
    """Serialise reuse planning of one set for the rest of `conn`'s transaction.

    Two runs of one set started together would each find no keys stored and COPY them (a
    unique violation): the second waits here, then finds them. SQLite needs no lock: the
    transaction began with BEGIN IMMEDIATE (store/db.py).
    """
    if conn.dialect.name == "postgresql":
        conn.execute(
            text("SELECT pg_advisory_xact_lock(:kind, :set)"),
            {"kind": PLANNING_LOCK_CLASS, "set": set_id},
        )


def _store_keys(
    conn: Connection, set_id: int, model_id: int, record_no: np.ndarray, keys: np.ndarray
) -> None:
    """The set's keys for the model, written the first time the set is planned for it (a set
    is immutable, so they never change)."""
    known = conn.execute(
        select(ContentKey.record_no)
        .where(ContentKey.model_id == model_id, ContentKey.task_set_id == set_id)
        .limit(1)
    ).first()
    if known is not None or record_no.size == 0:
        return
    if conn.dialect.name == "postgresql":
        _copy_keys_postgres(conn, set_id, model_id, record_no, keys)
        return
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    cursor.executemany(
        "INSERT INTO content_keys (model_id, task_set_id, record_no, content_key) "
        "VALUES (?, ?, ?, ?)",
        zip([model_id] * record_no.size, [set_id] * record_no.size, record_no.tolist(),
            key_bytes(keys), strict=True),
    )  # fmt: skip


def _copy_keys_postgres(
    conn: Connection, set_id: int, model_id: int, record_no: np.ndarray, keys: np.ndarray
) -> None:
    """One binary COPY: every field has a fixed width, so the rows are one structured array."""
    layout = np.dtype(
        [
            ("fields", ">i2"),
            ("len_model", ">i4"), ("model_id", ">i4"),
            ("len_set", ">i4"), ("task_set_id", ">i4"),
            ("len_record", ">i4"), ("record_no", ">i8"),
            ("len_key", ">i4"), ("content_key", f"S{KEY_BYTES}"),
        ]
    )  # fmt: skip
    rows = np.empty(record_no.size, dtype=layout)
    rows["fields"] = 4
    rows["len_model"], rows["model_id"] = 4, model_id
    rows["len_set"], rows["task_set_id"] = 4, set_id
    rows["len_record"], rows["record_no"] = 8, record_no
    rows["len_key"], rows["content_key"] = KEY_BYTES, keys
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    statement = (
        "COPY content_keys (model_id, task_set_id, record_no, content_key) "
        "FROM STDIN (FORMAT BINARY)"
    )
    with cursor.copy(statement) as copy:
        copy.write(HEADER + rows.tobytes() + TRAILER)


def _link_stored(conn: Connection, set_id: int, model_id: int) -> np.ndarray:
    """Link each of the set's tasks that has no row, no failure and no link yet to one stored
    row of the same key (the lowest set id, then record number); their record numbers. One
    INSERT ... SELECT: the links never pass through Python (at 1 M tasks that took most of
    planning)."""
    mine, source = aliased(ContentKey), aliased(ContentKey)
    stored_source = (
        select(Embedding.record_no)
        .where(
            Embedding.model_id == source.model_id,
            Embedding.task_set_id == source.task_set_id,
            Embedding.record_no == source.record_no,
        )
        .exists()
    )
    linked_already = (
        select(ReusedResult.record_no)
        .where(
            ReusedResult.model_id == mine.model_id,
            ReusedResult.task_set_id == mine.task_set_id,
            ReusedResult.record_no == mine.record_no,
        )
        .exists()
    )
    stride = literal(PAIR_STRIDE, BigInteger)
    pair = func.min(cast(source.task_set_id, BigInteger) * stride + source.record_no)
    links = (
        select(
            literal(model_id, Integer),
            literal(set_id, Integer),
            mine.record_no,
            cast(pair / stride, Integer),
            pair % stride,
            literal(utcnow(), DateTime(timezone=True)),
        )
        .join(
            source,
            and_(source.model_id == mine.model_id, source.content_key == mine.content_key),
        )
        .where(
            mine.model_id == model_id,
            mine.task_set_id == set_id,
            ~((source.task_set_id == mine.task_set_id) & (source.record_no == mine.record_no)),
            stored_source,
            ~_stored(mine.model_id, mine.task_set_id, mine.record_no),
            ~_failed(mine.task_set_id, mine.record_no),
            ~linked_already,
        )
        .group_by(mine.record_no)
    )
    columns = ["model_id", "task_set_id", "record_no", "from_task_set_id", "from_record_no",
               "created_at"]  # fmt: skip
    statement = (
        insert_ignoring_duplicates(conn.engine, ReusedResult)
        .from_select(columns, links)
        .returning(ReusedResult.record_no)
    )
    return np.fromiter(conn.execute(statement).scalars(), dtype=np.int64)


def _insert_links(
    conn: Connection,
    set_id: int,
    model_id: int,
    record_no: np.ndarray,
    from_set_id: np.ndarray | int,
    from_record_no: np.ndarray,
) -> None:
    from_sets = np.broadcast_to(np.asarray(from_set_id, dtype=np.int64), record_no.shape)
    conn.execute(
        insert_ignoring_duplicates(conn.engine, ReusedResult),
        [
            {"model_id": model_id, "task_set_id": set_id, "record_no": r,
             "from_task_set_id": s, "from_record_no": f}
            for r, s, f in zip(record_no.tolist(), from_sets.tolist(), from_record_no.tolist(),
                               strict=True)
        ],
    )  # fmt: skip


def _copy_linked(conn: Connection, set_id: int, model_id: int) -> np.ndarray:
    """Copy the source row to every linked task of the set without a row whose source has one;
    the record numbers of the rows inserted."""
    columns = _vector_columns(conn)
    where = (
        "r.model_id = :model AND r.task_set_id = :set AND NOT EXISTS (SELECT 1 FROM embeddings t "
        "WHERE t.model_id = r.model_id AND t.task_set_id = r.task_set_id "
        "AND t.record_no = r.record_no)"
    )
    source = (
        "FROM reused_results r JOIN embeddings e ON e.model_id = r.model_id "
        "AND e.task_set_id = r.from_task_set_id AND e.record_no = r.from_record_no"
    )
    params = {"model": model_id, "set": set_id}
    listed = ", ".join(columns)
    selected = ", ".join(f"e.{c}" for c in columns)
    head = f"INTO embeddings (model_id, task_set_id, record_no, n_tokens, {listed}) "
    body = f"SELECT e.model_id, r.task_set_id, r.record_no, e.n_tokens, {selected} {source} "
    if conn.dialect.name == "postgresql":
        # Statement-level triggers count the rows into the shard watermarks.
        inserted = conn.execute(
            text(f"INSERT {head}{body}WHERE {where} ON CONFLICT DO NOTHING RETURNING record_no"),
            params,
        ).scalars()
        return np.fromiter(inserted, dtype=np.int64)
    # SQLite: inserts are counted into the watermarks by whoever inserts (store/watermarks.py);
    # this transaction holds the write lock, so no other writer comes between.
    targets = np.fromiter(
        conn.execute(
            text(f"INSERT {head}{body}WHERE {where} RETURNING record_no"), params
        ).scalars(),
        dtype=np.int64,
    )
    if targets.size:
        cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        count_inserted(
            cursor,
            np.full(targets.size, set_id, np.int64),
            np.full(targets.size, model_id, np.int64),
            targets,
        )
    return targets


def _fail_linked(conn: Connection, set_id: int, model_id: int) -> int:
    """A linked task whose source failed fails too, naming the source and its reason."""
    source_failure = aliased(TaskFailure)
    rows = conn.execute(
        select(ReusedResult.record_no, ReusedResult.from_record_no, source_failure.reason,
               Task.task_id)
        .join(
            source_failure,
            and_(
                source_failure.task_set_id == ReusedResult.from_task_set_id,
                source_failure.record_no == ReusedResult.from_record_no,
            ),
        )
        .outerjoin(
            Task,
            and_(Task.task_set_id == ReusedResult.task_set_id,
                 Task.record_no == ReusedResult.record_no),
        )
        .where(
            ReusedResult.task_set_id == set_id,
            ReusedResult.model_id == model_id,
            ~_target_stored(ReusedResult),
            ~_target_failed(ReusedResult),
        )
    ).all()  # fmt: skip
    if rows:
        conn.execute(
            insert(TaskFailure),
            [
                {"task_set_id": set_id, "record_no": record, "task_id": task_id,
                 "stage": "extract",
                 "reason": f"same token ids as record {source}, whose extraction failed: "
                           f"{reason}"}
                for record, source, reason, task_id in rows
            ],
        )  # fmt: skip
    return len(rows)


def _vector_columns(conn: Connection) -> list[str]:
    have = VectorColumns.of(conn)
    return [BYTES] + [
        name
        for name, present in ((FLOAT32, have.float32), (HALF, have.half), (BITS, have.bits))
        if present
    ]


def _stored(model: Any, task_set: Any, record: Any) -> Exists:
    return (
        select(Embedding.record_no)
        .where(
            Embedding.model_id == model,
            Embedding.task_set_id == task_set,
            Embedding.record_no == record,
        )
        .exists()
    )


def _failed(task_set: Any, record: Any) -> Exists:
    return (
        select(TaskFailure.id)
        .where(TaskFailure.task_set_id == task_set, TaskFailure.record_no == record)
        .exists()
    )


def _target_stored(link: type[ReusedResult]) -> Exists:
    return _stored(link.model_id, link.task_set_id, link.record_no)


def _target_failed(link: type[ReusedResult]) -> Exists:
    return _failed(link.task_set_id, link.record_no)
