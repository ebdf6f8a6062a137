"""The batch ledger: claims under leases fenced by an epoch, acks, failures, accounting.

A worker claims one batch at a time (PostgreSQL: FOR UPDATE SKIP LOCKED; SQLite: the whole
transaction holds the write lock from BEGIN IMMEDIATE). Each claim raises the batch's lease epoch;
an ack is accepted only with the current epoch while the batch is still leased, so a worker whose
lease expired and was taken over cannot retire the batch a second time. An ack is part of the
transaction that writes the batch's results, so results and ack land together or not at all.

Leases are short (DEFAULT_LEASE_SECONDS) and renewed by their holder's heartbeat
(`renew_leases`, fenced by the epoch like an ack), so a dead worker's batch is taken over within
a lease, however long a live worker's batches take.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, Engine, Select, func, insert, select, tuple_, update

from fabric_gpu.batching import BatchPlan
from fabric_pipelines.lib.store.keys import model_id_of, set_id_of, task_set_id
from fabric_pipelines.lib.store.models import (
    WINDOW_BASE,
    AwaitedResult,
    Batch,
    BatchPlanRow,
    DocumentWindow,
    Embedding,
    Model,
    ReusedResult,
    TaskFailure,
    TaskSet,
)

QUEUED, LEASED, COMPLETED, FAILED, SUPERSEDED = (
    "queued",
    "leased",
    "completed",
    "failed",
    "superseded",
)


DEFAULT_LEASE_SECONDS = 30.0


def heartbeat_interval(lease_seconds: float, heartbeat_seconds: float | None = None) -> float:
    """The heartbeat period for `lease_seconds` (default: a third of it), checked."""
    if not lease_seconds > 0:
        raise ValueError(f"lease_seconds must be positive, got {lease_seconds}")
    if heartbeat_seconds is None:
        return lease_seconds / 3
    if not 0 < heartbeat_seconds < lease_seconds:
        raise ValueError(
            f"heartbeat_seconds={heartbeat_seconds} must be positive and shorter than "
            f"lease_seconds={lease_seconds} (a third of it is usual): a lease is only renewed "
            "once per heartbeat, so a longer one lets live workers' leases expire"
        )
    return heartbeat_seconds


class StaleLeaseError(RuntimeError):
    """An ack or failure report whose lease is no longer current; its writes are rolled back."""


@dataclass(frozen=True)
class Lease:
    plan_id: str
    batch_no: int
    epoch: int
    owner: str
    seq_len: int
    item_start: int
    item_count: int
    real_tokens: int
    padded_tokens: int
    attempts: int


@dataclass(frozen=True)
class DocumentAccounting:
    """A set with chunked documents (tasks/windows.py), counted by document: every submitted
    record is stored (its own row, combined from its windows if chunked), failed (at ingest, or
    a window of it failed) or waiting; and its windows, which are tasks."""

    documents: int
    stored: int
    failed: int
    chunked: int
    windows: int
    windows_stored: int

    @property
    def waiting(self) -> int:
        return self.documents - self.stored - self.failed

    def to_mapping(self) -> dict[str, int]:
        return {
            "documents": self.documents, "stored": self.stored, "failed": self.failed,
            "waiting": self.waiting, "chunked": self.chunked, "windows": self.windows,
            "windows_stored": self.windows_stored,
        }  # fmt: skip


@dataclass(frozen=True)
class Accounting:
    """tasks = completed + reused + failed + in_flight + queued. `completed`: results the engine
    computed; `reused`: tasks linked to a stored result of the same content key
    (lib/broker/reuse.py); a task waiting for its source's row is `queued`. A chunked document's
    tasks are its windows: `tasks` counts them in its place, and `completed` counts windows, not
    the document row combined from them; `documents` then counts by document.
    `stored_results`: the distinct stored results the tasks point at (completed, plus the other
    sets' rows the reused ones read, each once)."""

    tasks: int
    completed: int
    failed: int
    in_flight: int
    queued: int
    documents: DocumentAccounting | None = None
    reused: int = 0
    stored_results: int = 0

    @property
    def balanced(self) -> bool:
        accounted = self.completed + self.reused + self.failed + self.in_flight + self.queued
        return self.tasks == accounted

    def to_mapping(self) -> dict[str, Any]:
        return {
            "tasks": self.tasks, "completed": self.completed, "reused": self.reused,
            "stored_results": self.stored_results, "failed": self.failed, "in_flight": self.in_flight, "queued": self.queued,
            "balanced": self.balanced, "finished": self.finished,
            **({"documents": self.documents.to_mapping()} if self.documents else {}),
        }  # fmt: skip

    @property
    def finished(self) -> bool:
        done = self.balanced and self.in_flight == 0 and self.queued == 0
        # Every window stored or failed, yet a document neither: it was never combined.
        return done and (self.documents is None or self.documents.waiting == 0)


def supersede_open_batches(conn: Connection, task_set: str, keep_plan: str | None) -> None:
    """Mark the set's queued and leased batches superseded, but `keep_plan`'s: none of them can be
    acked after this (an ack needs its batch leased), so they finish nothing more."""
    open_batches = update(Batch).where(Batch.task_set_id == set_id_of(task_set))
    if keep_plan is not None:
        open_batches = open_batches.where(Batch.plan_id != keep_plan)
    conn.execute(open_batches.where(Batch.state.in_((QUEUED, LEASED))).values(state=SUPERSEDED))


def register_plan(conn: Connection, plan_id: str, task_set: str, plan: BatchPlan) -> int:
    """Insert one queued ledger row per batch; returns how many were inserted.

    Ledger rows of the task set's older plans that were not finished are superseded. A plan
    registered before (the same outstanding items again) keeps its rows, and those a later plan
    superseded are queued again: its items are outstanding, so its open batches are the work.
    """
    supersede_open_batches(conn, task_set, keep_plan=plan_id)
    existing = conn.execute(
        select(func.count()).select_from(Batch).where(Batch.plan_id == plan_id)
    ).scalar_one()
    if existing:
        conn.execute(
            update(Batch)
            .where(Batch.plan_id == plan_id, Batch.state == SUPERSEDED)
            # A lease taken before stays stale: acks need the batch leased, claims raise its epoch.
            .values(state=QUEUED, lease_owner=None, lease_deadline=None)
        )
        return 0
    set_id = task_set_id(conn, task_set)
    rows = [
        {
            "plan_id": plan_id,
            "batch_no": i,
            "task_set_id": set_id,
            "state": QUEUED,
            "seq_len": int(plan.seq_len[i]),
            "item_start": int(plan.item_start[i]),
            "item_count": int(plan.item_count[i]),
            "real_tokens": int(plan.real_tokens[i]),
            "padded_tokens": int(plan.padded_tokens[i]),
            "lease_epoch": 0,
            "attempts": 0,
        }
        for i in range(plan.n_batches)
    ]
    if rows:
        conn.execute(insert(Batch), rows)
    return len(rows)


def claim_many(
    engine: Engine,
    plan_id: str,
    owner: str,
    lease_seconds: float,
    limit: int,
    now: float | None = None,
) -> list[Lease]:
    """Lease up to `limit` batches in one transaction: expired leases first (their holder died
    or stalled, and they are the oldest work), then queued ones in plan order."""
    now = time.time() if now is None else now

    def first(count: int, *conditions: Any) -> Select[str, int]:
        # The (plan, state, batch_no) index answers this without scanning finished batches.
        return (
            select(Batch.plan_id, Batch.batch_no)
            .where(Batch.plan_id == plan_id, *conditions)
            .order_by(Batch.batch_no)
            .limit(count)
            .with_for_update(skip_locked=True)  # PostgreSQL; SQLite holds the write lock already
        )

    leases = []
    with engine.begin() as conn:
        targets = list(
            conn.execute(first(limit, Batch.state == LEASED, Batch.lease_deadline < now)).all()
        )
        if len(targets) < limit:
            targets += conn.execute(first(limit - len(targets), Batch.state == QUEUED)).all()
        for target in targets:
            row = conn.execute(
                update(Batch)
                .where(Batch.plan_id == target.plan_id, Batch.batch_no == target.batch_no)
                .values(
                    state=LEASED,
                    lease_owner=owner,
                    lease_epoch=Batch.lease_epoch + 1,
                    lease_deadline=now + lease_seconds,
                    attempts=Batch.attempts + 1,
                )
                .returning(
                    Batch.lease_epoch,
                    Batch.seq_len,
                    Batch.item_start,
                    Batch.item_count,
                    Batch.real_tokens,
                    Batch.padded_tokens,
                    Batch.attempts,
                )
            ).one()
            leases.append(
                Lease(
                    plan_id=target.plan_id,
                    batch_no=target.batch_no,
                    epoch=row.lease_epoch,
                    owner=owner,
                    seq_len=row.seq_len,
                    item_start=row.item_start,
                    item_count=row.item_count,
                    real_tokens=row.real_tokens,
                    padded_tokens=row.padded_tokens,
                    attempts=row.attempts,
                )
            )
    return leases


def _fence(lease: Lease):
    return update(Batch).where(
        Batch.plan_id == lease.plan_id,
        Batch.batch_no == lease.batch_no,
        Batch.lease_epoch == lease.epoch,
        Batch.state == LEASED,
    )


def _fence_many(leases: list[Lease]):
    """`_fence` for several leases in one statement."""
    return update(Batch).where(
        tuple_(Batch.plan_id, Batch.batch_no, Batch.lease_epoch).in_(
            [(lease.plan_id, lease.batch_no, lease.epoch) for lease in leases]
        ),
        Batch.state == LEASED,
    )


def ack_many(conn: Connection, leases: list[Lease], engine: str | None = None) -> list[Lease]:
    """Retire the leases' batches in one statement, inside the caller's transaction, recording
    the `engine` identity that computed them; returns the leases that were stale (their epoch
    moved on). Idempotent for a holder: a batch its lease already completed (a replay after a
    lost reply) acks again."""
    if not leases:
        return []
    retired = conn.execute(
        update(Batch)
        .where(
            tuple_(Batch.plan_id, Batch.batch_no, Batch.lease_epoch).in_(
                [(lease.plan_id, lease.batch_no, lease.epoch) for lease in leases]
            ),
            Batch.state.in_((LEASED, COMPLETED)),
        )
        .values(
            state=COMPLETED,
            lease_deadline=None,
            error=None,
            **({"engine": engine} if engine else {}),
        )
        .returning(Batch.plan_id, Batch.batch_no, Batch.lease_epoch)
    ).all()
    # Keyed with the epoch: a group can hold an expired lease and its retake of the same batch.
    done = {tuple(row) for row in retired}
    return [lease for lease in leases if (lease.plan_id, lease.batch_no, lease.epoch) not in done]


def renew_leases(
    engine: Engine, leases: list[Lease], lease_seconds: float, now: float | None = None
) -> list[Lease]:
    """Push back the deadline of `leases` in one statement; returns those renewed. A lease whose
    epoch moved on (taken over after it expired) or whose batch is no longer leased (acked,
    re-queued, superseded) is left alone, like a stale ack."""
    if not leases:
        return []
    now = time.time() if now is None else now
    with engine.begin() as conn:
        renewed = conn.execute(
            _fence_many(leases)
            .values(lease_deadline=now + lease_seconds)
            .returning(Batch.plan_id, Batch.batch_no, Batch.lease_epoch)
        ).all()
    current = {tuple(row) for row in renewed}
    return [lease for lease in leases if (lease.plan_id, lease.batch_no, lease.epoch) in current]


def hand_back(engine: Engine, leases: list[Lease]) -> int:
    """Put leased batches that never ran back in the queue, as if they had not been claimed
    (the claim's attempt is taken back). Only where the lease is still this one: a batch taken
    over meanwhile is left to its new holder. Returns how many went back."""
    if not leases:
        return 0
    with engine.begin() as conn:
        result = conn.execute(
            _fence_many(leases).values(
                state=QUEUED,
                lease_owner=None,
                lease_deadline=None,
                attempts=func.max(Batch.attempts - 1, 0)
                if engine.dialect.name == "sqlite"
                else func.greatest(Batch.attempts - 1, 0),
            )
        )
    return int(result.rowcount)


def stale_reason(lease: Lease) -> str:
    return (
        f"batch {lease.batch_no} of plan {lease.plan_id}: lease epoch {lease.epoch} is no longer "
        "current (it expired and was taken over, or the plan was superseded); results discarded"
    )


def report_failure(
    engine: Engine,
    lease: Lease,
    error: str,
    max_attempts: int,
    failed_items: list[tuple[int, str]],
    task_set: str,
) -> str:
    """Re-queue the batch, or after `max_attempts` fail it and its items (with the reason).

    `failed_items` are the (record_no, task_id) of the batch's items. Returns the new state.
    Safe to run again after a lost reply: a report that already landed is recognised (same
    epoch, the state and error it set) and not applied twice.
    """
    final = lease.attempts >= max_attempts
    state, message = (FAILED if final else QUEUED), error[:4000]
    with engine.begin() as conn:
        result = conn.execute(_fence(lease).values(state=state, lease_deadline=None, error=message))
        if result.rowcount != 1:
            now = conn.execute(
                select(Batch.state, Batch.lease_epoch, Batch.error).where(
                    Batch.plan_id == lease.plan_id, Batch.batch_no == lease.batch_no
                )
            ).first()
            if now is not None and tuple(now) == (state, lease.epoch, message):
                return state  # this very report committed before its reply was lost
            raise StaleLeaseError(f"batch {lease.batch_no}: lease epoch {lease.epoch} is stale")
        if final and failed_items:
            reason = f"extraction failed after {lease.attempts} attempts: {error}"[:4000]
            conn.execute(
                insert(TaskFailure).values(task_set_id=set_id_of(task_set)),
                [
                    {
                        "record_no": record_no,
                        "task_id": task_id,
                        "stage": "extract",
                        "reason": reason,
                    }
                    for record_no, task_id in failed_items
                ],
            )
    return FAILED if final else QUEUED


def superseded_by(conn: Connection, task_set: str, plan_id: str) -> str | None:
    """The plan that took over `plan_id`'s unfinished batches (another run re-planned the set),
    or None while `plan_id` is not superseded."""
    handed_over = conn.execute(
        select(func.count())
        .select_from(Batch)
        .where(Batch.plan_id == plan_id, Batch.state == SUPERSEDED)
    ).scalar_one()
    if not handed_over:
        return None
    current = conn.execute(
        select(TaskSet.current_plan_id).where(TaskSet.name == task_set)
    ).scalar_one_or_none()
    return current if current and current != plan_id else "a newer plan"


def superseded_message(plan_id: str, by: str) -> str:
    return (
        f"plan {plan_id} was superseded by plan {by} (another run of this task set re-planned "
        "it); this run's remaining batches are left to that run"
    )


def accounting(conn: Connection, task_set: str, model_key: str | None = None) -> Accounting:
    """tasks = completed + reused + failed + in_flight + queued, for one task set, in one query.

    `completed` counts result rows of `model_key` (by default the model of the set's current
    plan) that are not copies; `reused` the copies.
    """
    current_plan = select(TaskSet.current_plan_id).where(TaskSet.name == task_set).scalar_subquery()
    model: Any = (
        select(BatchPlanRow.model_id).where(BatchPlanRow.plan_id == current_plan).scalar_subquery()
        if model_key is None
        else select(Model.id).where(Model.model_key == model_key).scalar_subquery()
    )

    def batch_items(state: str):
        return (
            select(func.coalesce(func.sum(Batch.item_count), 0))
            .where(Batch.plan_id == current_plan, Batch.state == state)
            .scalar_subquery()
        )

    # A chunked document's own row is not a task's: its windows are.
    document_rows = (
        select(func.count())
        .select_from(DocumentWindow)
        .join(
            Embedding,
            (Embedding.task_set_id == DocumentWindow.task_set_id)
            & (Embedding.record_no == DocumentWindow.record_no),
        )
        .where(DocumentWindow.task_set_id == TaskSet.id, Embedding.model_id == model)
        .scalar_subquery()
    )

    def stored_at(set_id: Any, record: Any) -> Any:
        return (
            select(Embedding.record_no)
            .where(
                Embedding.model_id == ReusedResult.model_id,
                Embedding.task_set_id == set_id,
                Embedding.record_no == record,
            )
            .exists()
        )

    # A link is its task's result once its source is stored (a task with a row of its own
    # counts as completed, never through a link).
    own_row = stored_at(ReusedResult.task_set_id, ReusedResult.record_no)
    source_stored = stored_at(ReusedResult.from_task_set_id, ReusedResult.from_record_no)
    link_failed = (
        select(TaskFailure.id)
        .where(
            TaskFailure.task_set_id == ReusedResult.task_set_id,
            TaskFailure.record_no == ReusedResult.record_no,
        )
        .exists()
    )

    def links(*conditions: Any) -> Any:
        return (
            select(func.count())
            .select_from(ReusedResult)
            .where(ReusedResult.task_set_id == TaskSet.id, ReusedResult.model_id == model,
                   *conditions)
            .scalar_subquery()
        )  # fmt: skip

    # Other sets' rows the set's reused tasks read, each once (a derived table is not
    # correlated: the set is named by its id's subquery).
    read_elsewhere = (
        select(ReusedResult.from_task_set_id, ReusedResult.from_record_no)
        .where(
            ReusedResult.task_set_id == set_id_of(task_set),
            ReusedResult.model_id == model,
            ReusedResult.from_task_set_id != ReusedResult.task_set_id,
            source_stored,
            ~own_row,
        )
        .distinct()
        .subquery()
    )
    elsewhere = select(func.count()).select_from(read_elsewhere).scalar_subquery()
    query = select(
        TaskSet.n_records - TaskSet.n_chunked + TaskSet.n_windows,
        select(func.count())
        .select_from(Embedding)
        .where(Embedding.task_set_id == TaskSet.id, Embedding.model_id == model)
        .scalar_subquery()
        - document_rows,
        select(func.count())
        .select_from(TaskFailure)
        .where(TaskFailure.task_set_id == TaskSet.id)
        .scalar_subquery(),
        batch_items(LEASED),
        batch_items(QUEUED),
        TaskSet.n_chunked,
        links(source_stored, ~own_row),
        links(~source_stored, ~own_row, ~link_failed),  # waiting for their source's row: queued
        elsewhere,
        # Waiting for a result another running set computes: queued too.
        select(func.count())
        .select_from(AwaitedResult)
        .where(AwaitedResult.task_set_id == TaskSet.id, AwaitedResult.model_id == model)
        .scalar_subquery(),
    ).where(TaskSet.name == task_set)
    row = conn.execute(query).first()
    if row is None:
        raise LookupError(f"no task set named {task_set!r}")
    (
        tasks,
        stored,
        failed,
        in_flight,
        queued,
        n_chunked,
        reused,
        waiting,
        elsewhere_rows,
        awaited,
    ) = (int(v) for v in row)
    # A reused task is a whole document (windows are never reused): stored through its link.
    documents = _document_accounting(conn, task_set, model, reused) if n_chunked else None
    return Accounting(
        tasks, stored, failed, in_flight, queued + waiting + awaited, documents, reused=reused,
        stored_results=stored + elsewhere_rows,
    )  # fmt: skip


def _document_accounting(
    conn: Connection, task_set: str, model: Any, reused: int
) -> DocumentAccounting:
    set_id = set_id_of(task_set)
    windows_of = (
        (TaskFailure.task_set_id == DocumentWindow.task_set_id)
        & (TaskFailure.record_no >= DocumentWindow.first_window)
        & (TaskFailure.record_no < DocumentWindow.first_window + DocumentWindow.n_windows)
    )
    stored_document = (
        select(Embedding.record_no)
        .where(
            Embedding.task_set_id == DocumentWindow.task_set_id,
            Embedding.model_id == model,
            Embedding.record_no == DocumentWindow.record_no,
        )
        .exists()
    )

    def rows(*conditions: Any) -> Any:
        return (
            select(func.count())
            .select_from(Embedding)
            .where(Embedding.task_set_id == set_id, Embedding.model_id == model, *conditions)
            .scalar_subquery()
        )

    row = conn.execute(
        select(
            TaskSet.n_records,
            rows(Embedding.record_no < WINDOW_BASE),
            select(func.count())
            .select_from(TaskFailure)
            .where(TaskFailure.task_set_id == set_id, TaskFailure.record_no < WINDOW_BASE)
            .scalar_subquery(),
            select(func.count(func.distinct(DocumentWindow.record_no)))
            .select_from(DocumentWindow)
            .join(TaskFailure, windows_of)
            .where(DocumentWindow.task_set_id == set_id, ~stored_document)
            .scalar_subquery(),
            TaskSet.n_chunked,
            TaskSet.n_windows,
            rows(Embedding.record_no >= WINDOW_BASE),
        ).where(TaskSet.name == task_set)
    ).one()
    documents, stored, failed_plain, failed_chunked, chunked, windows, windows_stored = (
        int(v) for v in row
    )
    return DocumentAccounting(
        documents, stored + reused, failed_plain + failed_chunked, chunked, windows, windows_stored
    )


def plan_shapes(conn: Connection, plan_id: str) -> list[tuple[int, int]]:
    """(shape, most items) of every shape the plan's unfinished batches use."""
    rows = conn.execute(
        select(Batch.seq_len, func.max(Batch.item_count))
        .where(Batch.plan_id == plan_id, Batch.state.in_((QUEUED, LEASED)))
        .group_by(Batch.seq_len)
    ).all()
    return sorted((int(a), int(b)) for a, b in rows)


def outstanding_rows(
    conn: Connection, task_set: str, model_key: str, record_no: np.ndarray
) -> np.ndarray:
    """Task rows (indices into the task set) with neither a result, nor a link to another
    task's result, nor a wait for one another set is computing (broker/reuse.py), nor a
    failure yet."""
    ids = conn.execute(select(set_id_of(task_set), model_id_of(model_key))).one()
    set_id, model = int(ids[0]), -1 if ids[1] is None else int(ids[1])
    done = record_nos_of(conn, "embeddings", set_id, model)
    linked = record_nos_of(conn, "reused_results", set_id, model)
    awaited = record_nos_of(conn, "awaited_results", set_id, model)
    failed = record_nos_of(conn, "task_failures", set_id)
    keep = ~np.isin(record_no, np.concatenate([done, linked, awaited, failed]))
    return np.flatnonzero(keep).astype(np.int64)


def record_nos_of(
    conn: Connection, table: str, set_id: int, model: int | None = None
) -> np.ndarray:
    """The record numbers of `table`'s rows of one set (and model), read through the driver's
    cursor straight into an array: a million of them through SQLAlchemy's rows took 0.5 s.
    The database hands them over as one comma-separated string, parsed by NumPy: on SQLite
    900,000 in 0.14 s against 0.56 s as a row each."""
    sqlite = conn.dialect.name == "sqlite"
    mark = "?" if sqlite else "%s"
    where = f"task_set_id = {mark}" + ("" if model is None else f" AND model_id = {mark}")
    params = (set_id,) if model is None else (set_id, model)
    joined = "group_concat(record_no)" if sqlite else "string_agg(record_no::text, ',')"
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.execute(f"SELECT {joined} FROM {table} WHERE {where}", params)
        (numbers,) = cursor.fetchone()
        if not numbers:
            return np.zeros(0, dtype=np.int64)
        return np.fromstring(numbers, dtype=np.int64, sep=",")
    finally:
        cursor.close()


UNRECORDED = "unrecorded"  # batches acked before their engine was recorded (migration 0016)


def set_engines(conn: Connection, task_set: str, model_key: str) -> dict[str, int]:
    """Rows the set's completed batches of `model_key` hold, by the engine identity that
    computed them (fabric_gpu/engines/identity.py); reused tasks are not rows of the set."""
    rows = conn.execute(
        select(Batch.engine, func.sum(Batch.item_count))
        .join(BatchPlanRow, BatchPlanRow.plan_id == Batch.plan_id)
        .where(
            Batch.task_set_id == set_id_of(task_set),
            BatchPlanRow.model_id == model_id_of(model_key),
            Batch.state == COMPLETED,
        )
        .group_by(Batch.engine)
    ).all()
    return {engine or UNRECORDED: int(n) for engine, n in sorted(rows, key=lambda r: r[0] or "")}


def model_engines(conn: Connection, model: int) -> list[str]:
    """Every engine identity that computed a completed batch of the model, in any set."""
    rows = conn.execute(
        select(Batch.engine)
        .join(BatchPlanRow, BatchPlanRow.plan_id == Batch.plan_id)
        .where(BatchPlanRow.model_id == model, Batch.state == COMPLETED)
        .distinct()
    ).scalars()
    return sorted({engine or UNRECORDED for engine in rows})


def current_model_key(conn: Connection, task_set: str) -> str | None:
    """The model key of the set's current plan; None where it has none."""
    return conn.execute(
        select(Model.model_key)
        .join(BatchPlanRow, BatchPlanRow.model_id == Model.id)
        .join(TaskSet, TaskSet.current_plan_id == BatchPlanRow.plan_id)
        .where(TaskSet.name == task_set)
    ).scalar_one_or_none()
