"""Never compute the same thing twice: results reused by content key, stored once.

A task's content key is the sha256 of what decides its result: the model key (model, weights,
pooling, normalisation, output variant), the engine identity (backend, dtype, device class,
numerics version: fabric_gpu/engines/identity.py), the hook layers, and the task's final token
ids (its prompt's tokens included). So reuse matches the engine: a vector the CPU engine made in
fp32 is never reused for a GPU run in fp16. Each key has one owner (`result_keys`): the first task planned to
compute it. When a set is planned, each outstanding task whose key's owner has a stored row, in
any set, is linked to that row (`reused_results`) instead of getting a place in a batch; the
tasks left claim their keys. Duplicates inside the set are planned once: the first (by record
number) runs, the others are linked to it and read its row once it is stored, or fail with its
reason if it failed (`fail_pending`, after the workers). Planning writes a link per reused task
and a key per computed one: the outstanding keys travel in one temporary table, and linking and
claiming are one INSERT ... SELECT each.

By reference (migration 0016): a link is the reused task's result. `embeddings` holds each result
once, under the task that computed it; readers that want a row per task read the view
`task_embeddings` or follow the links (index/vectors.py, results/export.py). A task with a row of
its own is never read through a link. Forgetting a set hands each of its rows that other sets'
tasks point at over to one of them (tasks/catalog.forget_task_set), so a link never dangles.

Accounting: tasks = completed + reused + failed + in_flight + queued, where `reused` counts
linked tasks whose source is stored and a linked task still waiting for its source counts as
queued (broker/ledger.py).

In flight (migration 0017): a task whose key's owner is a task of another set that is running
now (its workers hold a live lease) and has neither its row nor a failure waits for it
(`awaited_results`) instead of being planned. After its own batches the set's extraction
settles its waits (`wait_for_other_sets`): a landed row becomes a link, a failed source fails
the task, and a source set that stopped running (no live lease for a lease's length) hands its
keys to the waiting tasks, which the set then plans and computes. A later run of the stopped
set links to those rows.

Concurrency: links are inserted only where the task has none (PostgreSQL: ON CONFLICT DO
NOTHING; SQLite: under the write lock), and planning leaves linked and waiting tasks out of its
batches. Two sets planned at the same moment, before either's workers lease, may both compute a
key; each task still has one result.

Runs that keep hook layers are reused by reference too: the layers are part of the key, and a
reused task's hidden states are its source's, read from the source's shard file
(lib/results/export.py). A set whose hidden states other sets read that way is not forgotten
before them (tasks/catalog.forget_task_set): its shard files are what they read.

Not reused: windows of chunked documents (a document's vector is combined from its windows,
lib/results/documents.py).
FABRIC_REUSE=off (or the engine resource's `reuse_results: false`) turns reuse off.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import (
    Connection,
    Engine,
    Exists,
    and_,
    delete,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.orm import aliased

from fabric_gpu._content_keys import digest_runs
from fabric_pipelines.lib.broker.ledger import record_nos_of
from fabric_pipelines.lib.core.retry import unit_of_work
from fabric_pipelines.lib.core.settings import switched_on
from fabric_pipelines.lib.store.db import insert_ignoring_duplicates
from fabric_pipelines.lib.store.keys import model_id, task_set_id
from fabric_pipelines.lib.store.models import (
    WINDOW_BASE,
    AwaitedResult,
    Batch,
    Embedding,
    Model,
    ResultKey,
    ReusedResult,
    Task,
    TaskFailure,
    utcnow,
)
from fabric_pipelines.lib.store.pgcopy import HEADER, TRAILER
from fabric_pipelines.lib.store.watermarks import count_inserted

KEY_BYTES = 32
PLANNING_CACHE_KIB = 512 * 1024  # SQLite's page cache while a set is linked and claimed
ROWS_PER_INSERT = 1000  # SQLite: planned keys bound per statement (2,000 of its 32,766 variables)
MIN_RUN = 64  # SQLite: consecutive record numbers worth one statement of their own
MAX_POLL_S = 5.0  # the longest pause between looks at a set's waits for other sets' results
WORK_MEM = "256MB"  # PostgreSQL: for the planning transaction (the links' sort, the key joins)


def reuse_enabled(setting: bool | None = None) -> bool:
    """`setting` if given, else FABRIC_REUSE (on unless "off", "0", "false" or "no")."""
    if setting is not None:
        return setting
    return switched_on("FABRIC_REUSE")


def content_keys(
    tokens: np.ndarray,
    offsets: np.ndarray,
    model_key: str,
    layers: Sequence[int] = (),
    engine: str = "",
) -> np.ndarray:
    """Each task's content key (dtype S32; `key_bytes` for the bytes): sha256 over the JSON
    {"engine": ..., "layers": [...], "model_key": ...} (sorted keys; "engine" only where given:
    fabric_gpu/engines/identity.py) followed by the task's token ids as little-endian int32."""
    header: dict[str, Any] = {"model_key": model_key, "layers": list(layers)}
    if engine:
        header["engine"] = engine
    data = np.ascontiguousarray(tokens, dtype="<i4").view(np.uint8)
    bounds = np.asarray(offsets, dtype=np.int64) * 4
    # Every key on every core, outside the interpreter (csrc/sha256.cpp): hashlib per key held
    # the GIL, 1.4 s per million keys on one core.
    joined = digest_runs(json.dumps(header, sort_keys=True).encode(), data, bounds)
    return np.frombuffer(joined, dtype=f"S{KEY_BYTES}").copy()


def key_bytes(keys: np.ndarray) -> list[bytes]:
    """The keys as 32-byte strings (NumPy's S32 items drop trailing zero bytes: not these)."""
    data = np.ascontiguousarray(keys).tobytes()
    return [data[i : i + KEY_BYTES] for i in range(0, len(data), KEY_BYTES)]


@dataclass(frozen=True)
class Reuse:
    """What planning a set took from stored results instead of the engine."""

    linked: int  # tasks linked to a stored result of another task (this planning)
    deferred: int  # duplicates inside the set, linked to their first, which is still to run
    rows: np.ndarray  # the task rows left to plan
    awaiting: int = 0  # tasks waiting for a result another running set is computing


def link_before_planning(
    db: Engine,
    set_id: int,
    model_id: int,
    record_no: np.ndarray,
    keys: np.ndarray,
    outstanding: np.ndarray,
) -> Reuse:
    """Link the outstanding tasks whose key has a stored result to it, link the set's own
    duplicates to their first, and claim the keys the set will compute (`result_keys`); the rows
    left to plan. No vector bytes move: a link is the task's result. One transaction; what it
    writes is a row per linked task and a key per task to compute, nothing per reused one."""
    eligible = record_no < WINDOW_BASE
    with db.begin() as conn, _page_cache(conn):
        _lock_planning(conn, set_id)
        if conn.dialect.name == "postgresql":
            # Linking a million tasks sorts their links by record number: in memory, not on disk.
            conn.execute(text("SELECT set_config('work_mem', :size, true)"), {"size": WORK_MEM})
        # Waits for other sets' results start afresh: each is linked, waited for again, or
        # computed, by what holds now.
        rewait = _forget_waits(conn, set_id, model_id)
        if rewait.size:
            outstanding = np.union1d(outstanding, np.flatnonzero(np.isin(record_no, rewait)))
        # A link to another set's row that is gone (deleted, or requeued by a repair) is dropped:
        # its task is outstanding again, to be linked anew or computed.
        unlinked = _drop_broken_links(conn, set_id, model_id)
        if unlinked.size:
            outstanding = np.union1d(outstanding, np.flatnonzero(np.isin(record_no, unlinked)))
        # Tasks a run of the same set planned just before this one linked (under this lock).
        already = record_nos_of(conn, "reused_results", set_id, model_id)
        if already.size:
            outstanding = outstanding[~np.isin(record_no[outstanding], already)]
        candidates = outstanding[eligible[outstanding]]
        candidates = candidates[np.argsort(record_no[candidates], kind="stable")]
        with _planned_keys(conn, record_no[candidates], keys[candidates]):
            linked = _link_stored(conn, set_id, model_id, already)
            # Keys another running set is computing now: waited for, not computed again.
            awaiting = _await_in_flight(conn, set_id, model_id)
            taken = np.concatenate([linked, awaiting])
            rows = outstanding[~np.isin(record_no[outstanding], taken)]
            # Among what is left, the first of each key runs; the others wait for its row.
            order = candidates[~np.isin(record_no[candidates], taken)]
            _, first = np.unique(keys[order], return_index=True)
            is_first = np.zeros(order.size, dtype=bool)
            is_first[first] = True
            duplicates = order[~is_first]
            if duplicates.size:
                first_of_key = dict(
                    zip(key_bytes(keys[order[first]]), order[first].tolist(), strict=True)
                )
                sources = np.fromiter(
                    (first_of_key[k] for k in key_bytes(keys[duplicates])), np.int64,
                    duplicates.size,
                )  # fmt: skip
                _insert_links(
                    conn, set_id, model_id, record_no[duplicates], set_id, record_no[sources]
                )
                rows = rows[~np.isin(rows, duplicates)]
            firsts = order[first]
            _claim_keys(
                conn, set_id, model_id, record_no[firsts], keys[firsts], record_no[candidates]
            )
        # Repeats linked by this planning or an earlier one that still wait for their first
        # (links to other sets' rows are made only to stored ones).
        waiting = conn.execute(
            select(func.count()).select_from(ReusedResult).where(*_waiting(set_id, model_id))
        ).scalar_one()
    return Reuse(
        linked=int(linked.size), deferred=int(waiting), rows=rows, awaiting=int(awaiting.size)
    )


def fail_pending(db: Engine, set_id: int, model_id: int) -> int:
    """After the workers: each linked task of the set whose source failed fails too, naming
    it; how many."""
    with db.begin() as conn:
        return _fail_linked(conn, set_id, model_id)


def fail_pending_of(db: Engine, task_set: str, model_key: str) -> int:
    """`fail_pending` by names."""
    with db.begin() as conn:
        set_id, mid = task_set_id(conn, task_set), model_id(conn, model_key)
    return fail_pending(db, set_id, mid)


@unit_of_work("reading the duplicates of task set {task_set!r} still waiting for their first")
def waiting_duplicates_of(db: Engine, task_set: str, model_key: str) -> np.ndarray:
    """The set's linked tasks whose source has neither its row nor a failure yet: repeats
    inside the set waiting for their first (record numbers)."""
    with db.connect() as conn:
        set_id = task_set_id(conn, task_set)
        mid = conn.execute(select(Model.id).where(Model.model_key == model_key)).scalar()
        if mid is None:
            return np.zeros(0, np.int64)
        return np.fromiter(
            conn.execute(select(ReusedResult.record_no).where(*_waiting(set_id, mid))).scalars(),
            dtype=np.int64,
        )


@dataclass(frozen=True)
class Waits:
    """One look at a set's waits for other sets' results (`resolve_waits`)."""

    linked: int = 0  # the source's row landed: the wait became a link
    failed: int = 0  # the source failed: the task failed, naming it
    taken_over: int = 0  # the source's set stopped running: the task is this set's to compute
    waiting: dict[int, int] = dataclasses.field(default_factory=dict)  # source set -> tasks
    running: frozenset[int] = frozenset()  # of those sets, the ones with a live lease

    def __add__(self, other: Waits) -> Waits:
        return Waits(
            self.linked + other.linked, self.failed + other.failed,
            self.taken_over + other.taken_over, other.waiting, other.running,
        )  # fmt: skip


@unit_of_work("settling the waits of task set id {set_id} for other sets' results")
def resolve_waits(db: Engine, set_id: int, model_id: int, take_over: Collection[int] = ()) -> Waits:
    """Settle what can be of the set's waits (`awaited_results`), in one transaction: a wait
    whose source is stored becomes a link; one whose source failed fails its task; one whose
    source is a task of a set in `take_over` (seen stopped) is dropped and the key handed to the
    set's first waiting task, so the set computes it and later sets link to its row. What still
    waits, by source set, and which of those sets run now."""
    with db.begin() as conn:
        _lock_planning(conn, set_id)  # no planning of the set rewrites its waits meanwhile
        waits = conn.execute(
            select(AwaitedResult.record_no, AwaitedResult.from_task_set_id,
                   AwaitedResult.from_record_no)
            .where(AwaitedResult.task_set_id == set_id, AwaitedResult.model_id == model_id)
            .order_by(AwaitedResult.record_no)
        ).all()  # fmt: skip
        if not waits:
            return Waits()
        stored = conn.execute(
            select(AwaitedResult.record_no).where(
                AwaitedResult.task_set_id == set_id,
                AwaitedResult.model_id == model_id,
                _stored(model_id, AwaitedResult.from_task_set_id, AwaitedResult.from_record_no),
            )
        ).scalars()
        landed = {int(r) for r in stored}
        failures: dict[int, str] = dict(
            conn.execute(
                select(AwaitedResult.record_no, TaskFailure.reason).join(
                    TaskFailure,
                    and_(TaskFailure.task_set_id == AwaitedResult.from_task_set_id,
                         TaskFailure.record_no == AwaitedResult.from_record_no),
                ).where(AwaitedResult.task_set_id == set_id, AwaitedResult.model_id == model_id)
            ).all()
        )  # fmt: skip
        link: list[tuple[int, int, int]] = []
        fail: list[tuple[int, int, str]] = []
        hand: dict[tuple[int, int], int] = {}  # source task -> the first task waiting for it
        keep: list[int] = []
        for record, from_set, from_record in waits:
            if record in landed:
                link.append((record, from_set, from_record))
            elif record in failures:
                fail.append((record, from_record, failures[record]))
            elif from_set in take_over:
                hand.setdefault((from_set, from_record), record)  # the first waiting task
            else:
                keep.append(from_set)
        if link:
            records = np.array([r for r, _, _ in link], dtype=np.int64)
            _insert_links(conn, set_id, model_id, records,
                          np.array([s for _, s, _ in link], dtype=np.int64),
                          np.array([f for _, _, f in link], dtype=np.int64))  # fmt: skip
        if fail:
            failing = [r for r, _, _ in fail]
            task_ids: dict[int, str] = {}
            for start in range(0, len(failing), 500):  # bound parameters per statement
                task_ids.update(
                    conn.execute(
                        select(Task.record_no, Task.task_id).where(
                            Task.task_set_id == set_id,
                            Task.record_no.in_(failing[start : start + 500]),
                        )
                    ).all()
                )
            conn.execute(
                insert(TaskFailure),
                [
                    {"task_set_id": set_id, "record_no": record, "task_id": task_ids.get(record),
                     "stage": "extract",
                     "reason": f"same token ids as record {source} of another task set, whose "
                               f"extraction failed: {reason}"}
                    for record, source, reason in fail
                ],
            )  # fmt: skip
        for (from_set, from_record), record in hand.items():
            conn.execute(
                update(ResultKey)
                .where(ResultKey.model_id == model_id, ResultKey.task_set_id == from_set,
                       ResultKey.record_no == from_record)
                .values(task_set_id=set_id, record_no=record)
            )  # fmt: skip
        taken = [r for r, s, _ in waits if s in take_over and r not in landed and r not in failures]
        settled = [r for r, _, _ in link] + [r for r, _, _ in fail] + taken
        for start in range(0, len(settled), 500):
            conn.execute(
                delete(AwaitedResult).where(
                    AwaitedResult.task_set_id == set_id,
                    AwaitedResult.model_id == model_id,
                    AwaitedResult.record_no.in_(settled[start : start + 500]),
                )
            )
        waiting: dict[int, int] = {}
        for from_set in keep:
            waiting[from_set] = waiting.get(from_set, 0) + 1
        return Waits(len(link), len(fail), len(taken), waiting,
                     frozenset(_running_sets(conn, waiting)))  # fmt: skip


def wait_for_other_sets(
    db: Engine,
    task_set: str,
    model_key: str,
    stopped_after_s: float,
    *,
    poll_s: float = 0.5,
    on_wait: Callable[[Waits], None] | None = None,
) -> Waits:
    """After the set's own batches: wait until every task waiting for another set's result has
    it (a link), has failed with it, or is taken over because that set stopped running (no live
    lease for `stopped_after_s`, a lease's length: its workers died or its run ended). The total
    of what was settled; `on_wait` hears of each look that still waits.

    Each look is a write transaction (the other set's acks wait for it on SQLite), so the looks
    thin out while nothing settles: `poll_s`, doubled up to MAX_POLL_S, back to `poll_s` once
    something did."""
    set_id, mid = _ids_of(db, task_set, model_key)
    if mid is None:
        return Waits()
    total = Waits()
    stopped_since: dict[int, float] = {}
    pause = poll_s
    while True:
        now = time.monotonic()
        stopped = {s for s, t in stopped_since.items() if now - t >= stopped_after_s}
        look = resolve_waits(db, set_id, mid, take_over=stopped)
        total = total + look
        if not total.waiting:
            return total
        settled = look.linked + look.failed + look.taken_over
        pause = poll_s if settled else min(2 * pause, max(MAX_POLL_S, poll_s))
        for source in total.waiting:
            if source in total.running:
                stopped_since.pop(source, None)
            else:
                stopped_since.setdefault(source, now)
        if on_wait is not None:
            on_wait(total)
        # Never past the moment a stopped set's keys are due to be taken over.
        due = [t + stopped_after_s - time.monotonic() for t in stopped_since.values()]
        time.sleep(max(0.0, min([pause, *due])))


@unit_of_work("reading the ids of task set {task_set!r} and model {model_key!r}")
def _ids_of(db: Engine, task_set: str, model_key: str) -> tuple[int, int | None]:
    with db.connect() as conn:
        set_id = task_set_id(conn, task_set)
        mid = conn.execute(select(Model.id).where(Model.model_key == model_key)).scalar()
    return set_id, None if mid is None else int(mid)


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
            select(ResultKey.content_key)
            .join(
                Embedding,
                and_(
                    Embedding.model_id == ResultKey.model_id,
                    Embedding.task_set_id == ResultKey.task_set_id,
                    Embedding.record_no == ResultKey.record_no,
                ),
            )
            .where(ResultKey.model_id == model_id, ResultKey.content_key.in_(chunk))
        ).scalars()
    return np.isin(keys, np.array(found, dtype=f"S{KEY_BYTES}"))


def broken_links(conn: Connection, set_id: int, model_id: int) -> tuple[int, int, int]:
    """(links of the set, how many name a source that is neither stored, nor failed, nor a task
    of the set still to run: a result lost; how many are self-links: rows the set's tasks
    adopted from a forgotten set, store/result_links.py)."""
    total = conn.execute(
        select(func.count())
        .select_from(ReusedResult)
        .where(ReusedResult.task_set_id == set_id, ReusedResult.model_id == model_id)
    ).scalar_one()
    broken = conn.execute(
        select(func.count())
        .select_from(ReusedResult)
        .where(
            ReusedResult.task_set_id == set_id,
            ReusedResult.model_id == model_id,
            ~_source_stored(ReusedResult),
            ~_target_stored(ReusedResult),
            ~_target_failed(ReusedResult),
            ~_failed(ReusedResult.from_task_set_id, ReusedResult.from_record_no),
            # An in-set duplicate's first may still be queued: only a first that is no task of
            # the set (its set forgotten without a hand-over) breaks the link for good.
            (ReusedResult.from_task_set_id != set_id)
            | ~select(Task.record_no)
            .where(
                Task.task_set_id == ReusedResult.from_task_set_id,
                Task.record_no == ReusedResult.from_record_no,
            )
            .exists(),
        )
    ).scalar_one()
    adopted = conn.execute(
        select(func.count())
        .select_from(ReusedResult)
        .where(
            ReusedResult.task_set_id == set_id,
            ReusedResult.model_id == model_id,
            ReusedResult.from_task_set_id == ReusedResult.task_set_id,
            ReusedResult.from_record_no == ReusedResult.record_no,
            _target_stored(ReusedResult),
        )
    ).scalar_one()
    return int(total), int(broken), int(adopted)


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


@contextmanager
def _page_cache(conn: Connection) -> Iterator[None]:
    """SQLite: a page cache that holds the key and link indexes while planning looks a million
    keys up in them (random lookups otherwise re-read their pages); put back after, as it
    belongs to the pooled connection."""
    if conn.dialect.name != "sqlite":
        yield
        return
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    (cache_size,) = cursor.execute("PRAGMA cache_size").fetchone()
    cursor.execute(f"PRAGMA cache_size = {-PLANNING_CACHE_KIB}")
    try:
        yield
    finally:
        cursor.execute(f"PRAGMA cache_size = {int(cache_size)}")


@contextmanager
def _planned_keys(conn: Connection, record_no: np.ndarray, keys: np.ndarray) -> Iterator[None]:
    """The outstanding tasks' keys in a temporary table, `fabric_planned_keys` (record_no
    ascending), for the statements that link and claim by joining it; gone afterwards."""
    pg = conn.dialect.name == "postgresql"
    conn.execute(text("DROP TABLE IF EXISTS fabric_planned_keys"))
    conn.execute(
        text(
            # SQLite: INTEGER PRIMARY KEY is the rowid, scanned in order with no second index.
            "CREATE TEMPORARY TABLE fabric_planned_keys "
            f"(record_no {'BIGINT' if pg else 'INTEGER'} PRIMARY KEY, "
            f"content_key {'BYTEA' if pg else 'BLOB'} NOT NULL)"
        )
    )
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    if pg:
        # One binary COPY: both fields have a fixed width, so the rows are one structured array.
        layout = np.dtype(
            [("fields", ">i2"), ("len_record", ">i4"), ("record_no", ">i8"),
             ("len_key", ">i4"), ("content_key", f"S{KEY_BYTES}")]
        )  # fmt: skip
        rows = np.empty(record_no.size, dtype=layout)
        rows["fields"] = 2
        rows["len_record"], rows["record_no"] = 8, record_no
        rows["len_key"], rows["content_key"] = KEY_BYTES, keys
        with cursor.copy(
            "COPY fabric_planned_keys (record_no, content_key) FROM STDIN (FORMAT BINARY)"
        ) as copy:
            copy.write(HEADER + rows.tobytes() + TRAILER)
        conn.execute(text("ANALYZE fabric_planned_keys"))
    else:
        _insert_planned_keys_sqlite(cursor, record_no, keys)
    try:
        yield
    finally:
        conn.execute(text("DROP TABLE fabric_planned_keys"))


def _insert_planned_keys_sqlite(cursor: Any, record_no: np.ndarray, keys: np.ndarray) -> None:
    """SQLite: each run of at least MIN_RUN consecutive record numbers (a set planned for the
    first time is one run) as one statement that cuts its keys out of one bound blob; the
    other tasks ROWS_PER_INSERT rows per statement (a row per statement took twice as long)."""
    starts = np.flatnonzero(np.diff(record_no, prepend=record_no[:1] - 2) != 1)
    lengths = np.diff(np.append(starts, record_no.size))
    long = lengths >= MIN_RUN
    for start, length in zip(starts[long].tolist(), lengths[long].tolist(), strict=True):
        cursor.execute(
            "WITH RECURSIVE run(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM run "
            "WHERE i + 1 < :length) "
            "INSERT INTO fabric_planned_keys (record_no, content_key) "
            f"SELECT :first + i, substr(:keys, i * {KEY_BYTES} + 1, {KEY_BYTES}) FROM run",
            {"length": length, "first": int(record_no[start]),
             "keys": keys[start : start + length].tobytes()},
        )  # fmt: skip
    rest = np.repeat(~long, lengths)
    _insert_rows_sqlite(cursor, record_no[rest], keys[rest])


def _insert_rows_sqlite(cursor: Any, record_no: np.ndarray, keys: np.ndarray) -> None:
    values: list[Any] = [
        x for pair in zip(record_no.tolist(), key_bytes(keys), strict=True) for x in pair
    ]
    whole = len(record_no) // ROWS_PER_INSERT * ROWS_PER_INSERT
    statement = "INSERT INTO fabric_planned_keys (record_no, content_key) VALUES "
    cursor.executemany(
        statement + ", ".join(["(?, ?)"] * ROWS_PER_INSERT),
        (values[2 * i : 2 * (i + ROWS_PER_INSERT)] for i in range(0, whole, ROWS_PER_INSERT)),
    )
    rest = values[2 * whole :]
    cursor.executemany(statement + "(?, ?)", zip(rest[::2], rest[1::2], strict=True))


def _claim_keys(
    conn: Connection,
    set_id: int,
    model_id: int,
    record_no: np.ndarray,
    keys: np.ndarray,
    planned: np.ndarray,
) -> None:
    """The first task of each key left to compute claims it for the model (`result_keys`), so
    later sets link to its row once stored. A key another task claimed first stays that task's
    (two sets planned at once may both compute it). `planned`: the record numbers in
    `fabric_planned_keys` (ascending), of which `record_no` are the claimants."""
    if record_no.size == 0:
        return
    others = np.setdiff1d(planned, record_no, assume_unique=True)
    if conn.dialect.name == "sqlite" and others.size <= record_no.size:
        # Most planned tasks claim (a new set: all of them): the others leave the planned keys,
        # and the claims are one INSERT ... SELECT of the rest, with no row through Python, in
        # record order, so the task index appends (1 M claims on 2 cores: 1.6 s, against 3.6 s
        # through executemany in key order).
        cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        cursor.executemany(
            "DELETE FROM fabric_planned_keys WHERE record_no = ?", ((r,) for r in others.tolist())
        )
        conn.execute(
            text(
                "INSERT OR IGNORE INTO result_keys (model_id, content_key, task_set_id, record_no) "
                "SELECT :model, content_key, :set, record_no FROM fabric_planned_keys"
            ),
            {"model": model_id, "set": set_id},
        )
        return
    if conn.dialect.name == "postgresql":
        # From the planned keys' table, in one statement (a row per claim through the driver
        # took 4 s for 100,000).
        conn.execute(
            text(
                "INSERT INTO result_keys (model_id, content_key, task_set_id, record_no) "
                "SELECT :model, p.content_key, :set, p.record_no FROM fabric_planned_keys p "
                "WHERE p.record_no = ANY(:records) ORDER BY p.content_key "
                "ON CONFLICT DO NOTHING"
            ),
            {"model": model_id, "set": set_id, "records": record_no.tolist()},
        )
        return
    order = np.argsort(keys, kind="stable")
    record_no, keys = record_no[order], keys[order]
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    rows = [
        (model_id, k, set_id, r) for r, k in zip(record_no.tolist(), key_bytes(keys), strict=True)
    ]
    cursor.executemany(
        "INSERT OR IGNORE INTO result_keys (model_id, content_key, task_set_id, record_no) "
        "VALUES (?, ?, ?, ?)",
        rows,
    )


def _running_sets(
    conn: Connection, sets: Collection[int] | None = None, exclude: int | None = None
) -> set[int]:
    """The sets (of `sets`, if given; never `exclude`) whose workers hold a live lease on one of
    their batches now: sets being computed (a run's workers renew their leases as they work)."""
    if sets is not None and not sets:
        return set()
    live = select(Batch.task_set_id).where(
        Batch.state == "leased", Batch.lease_deadline > time.time()
    )
    if sets is not None:
        live = live.where(Batch.task_set_id.in_(list(sets)))
    if exclude is not None:
        live = live.where(Batch.task_set_id != exclude)
    return set(conn.execute(live.distinct()).scalars())


def _forget_waits(conn: Connection, set_id: int, model_id: int) -> np.ndarray:
    """Delete the set's waits for other sets' results; their record numbers."""
    gone = delete(AwaitedResult).where(
        AwaitedResult.task_set_id == set_id, AwaitedResult.model_id == model_id
    )
    return np.fromiter(
        conn.execute(gone.returning(AwaitedResult.record_no)).scalars(), dtype=np.int64
    )


def _await_in_flight(conn: Connection, set_id: int, model_id: int) -> np.ndarray:
    """Each planned task whose key's owner is a task of another set that is running now (a live
    lease) and has neither its row nor a failure yet waits for it (`awaited_results`); their
    record numbers. Nothing runs elsewhere (the common case): one small query, no join."""
    running = _running_sets(conn, exclude=set_id)
    if not running:
        return np.zeros(0, dtype=np.int64)
    sets = ", ".join(str(int(s)) for s in running)  # integers from the database
    statement = (
        "INSERT INTO awaited_results (model_id, task_set_id, record_no, from_task_set_id, "
        "from_record_no, created_at) "
        "SELECT :model, :set, p.record_no, r.task_set_id, r.record_no, :now "
        "FROM fabric_planned_keys p JOIN result_keys r "
        "ON r.model_id = :model AND r.content_key = p.content_key "
        f"WHERE r.task_set_id IN ({sets}) "
        "AND NOT EXISTS (SELECT 1 FROM embeddings s WHERE s.model_id = :model "
        "AND s.task_set_id = r.task_set_id AND s.record_no = r.record_no) "
        "AND NOT EXISTS (SELECT 1 FROM task_failures f WHERE f.task_set_id = r.task_set_id "
        "AND f.record_no = r.record_no) "
        "RETURNING record_no"
    )
    rows = conn.execute(text(statement), {"model": model_id, "set": set_id, "now": utcnow()})
    return np.fromiter(rows.scalars(), dtype=np.int64)


def _drop_broken_links(conn: Connection, set_id: int, model_id: int) -> np.ndarray:
    """Delete the set's links to another set's row that is not stored; their record numbers."""
    gone = delete(ReusedResult).where(
        ReusedResult.task_set_id == set_id,
        ReusedResult.model_id == model_id,
        ReusedResult.from_task_set_id != set_id,
        ~_source_stored(ReusedResult),
        ~_target_stored(ReusedResult),
    )
    return np.fromiter(
        conn.execute(gone.returning(ReusedResult.record_no)).scalars(), dtype=np.int64
    )


def _link_stored(conn: Connection, set_id: int, model_id: int, already: np.ndarray) -> np.ndarray:
    """Link each planned task whose key's owner (`result_keys`) has a stored row, in another
    task, to that row; their record numbers. One INSERT ... SELECT over the planned keys, in
    record order: the links never pass through Python. `already`: the set's links before."""
    params = {"model": model_id, "set": set_id, "now": utcnow()}
    links = (
        "INSERT INTO reused_results (model_id, task_set_id, record_no, from_task_set_id, "
        "from_record_no, created_at) "
        "SELECT :model, :set, p.record_no, r.task_set_id, r.record_no, :now "
        "FROM fabric_planned_keys p JOIN result_keys r "
        "ON r.model_id = :model AND r.content_key = p.content_key "
        "WHERE NOT (r.task_set_id = :set AND r.record_no = p.record_no) "
        "AND EXISTS (SELECT 1 FROM embeddings s WHERE s.model_id = :model "
        "AND s.task_set_id = r.task_set_id AND s.record_no = r.record_no) "
        "ORDER BY p.record_no"
    )
    if conn.dialect.name == "postgresql":
        links = links.replace(":model", "%(model)s").replace(":set", "%(set)s")
        links = links.replace(":now", "%(now)s")
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    cursor.execute(links, params)
    # Under the set's planning lock no other statement links its tasks: the new links are the
    # set's links less those before, read as one string (record_nos_of). A RETURNING row per
    # link (and ON CONFLICT) took three times as long as that read.
    linked = np.setdiff1d(
        record_nos_of(conn, "reused_results", set_id, model_id), already, assume_unique=True
    )
    _count_links(conn, set_id, model_id, linked)
    return linked


def _count_links(conn: Connection, set_id: int, model_id: int, record_no: np.ndarray) -> None:
    """A link adds its task to the model's index as a row does: SQLite's inserts are counted
    into the shard watermarks by whoever inserts (PostgreSQL's triggers count them)."""
    if conn.dialect.name == "sqlite" and record_no.size:
        cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        count_inserted(
            cursor,
            np.full(record_no.size, set_id, np.int64),
            np.full(record_no.size, model_id, np.int64),
            record_no,
        )


def _insert_links(
    conn: Connection,
    set_id: int,
    model_id: int,
    record_no: np.ndarray,
    from_set_id: np.ndarray | int,
    from_record_no: np.ndarray,
) -> None:
    from_sets = np.broadcast_to(np.asarray(from_set_id, dtype=np.int64), record_no.shape)
    inserted = conn.execute(
        insert_ignoring_duplicates(conn.engine, ReusedResult).returning(ReusedResult.record_no),
        [
            {"model_id": model_id, "task_set_id": set_id, "record_no": r,
             "from_task_set_id": s, "from_record_no": f}
            for r, s, f in zip(record_no.tolist(), from_sets.tolist(), from_record_no.tolist(),
                               strict=True)
        ],
    )  # fmt: skip
    _count_links(conn, set_id, model_id, np.fromiter(inserted.scalars(), dtype=np.int64))


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


def _waiting(set_id: int, model_id: int) -> tuple[Any, ...]:
    """The conditions of a set's repeats still waiting for their first: an in-set link (links
    to other sets' rows are made only to stored ones) whose source has neither its row nor a
    failure, and whose task has neither either."""
    return (
        ReusedResult.task_set_id == set_id,
        ReusedResult.model_id == model_id,
        ReusedResult.from_task_set_id == set_id,
        ~_source_stored(ReusedResult),
        ~_target_stored(ReusedResult),
        ~_target_failed(ReusedResult),
    )


def _source_stored(link: type[ReusedResult]) -> Exists:
    return _stored(link.model_id, link.from_task_set_id, link.from_record_no)


def _target_stored(link: type[ReusedResult]) -> Exists:
    return _stored(link.model_id, link.task_set_id, link.record_no)


def _target_failed(link: type[ReusedResult]) -> Exists:
    return _failed(link.task_set_id, link.record_no)
