"""Repairs that `fabric verify` names: requeue batches whose outputs are bad, write a lost plan
file or receipt file again from what the database holds.

Requeueing deletes a batch's results (embedding rows, hidden-state shard rows, extraction
failures) and puts it back in the ledger as queued, in one transaction, so the accounting stays
balanced; the next `fabric run` of the set plans those tasks again (they have no result) and
extracts them once. The lease epoch is kept: a late ack of an earlier lease stays refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
from sqlalchemy import Engine, delete, select, update
from sqlalchemy.orm import Session

from fabric_gpu.batching import plan_batches, prefix_keys
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.broker.ledger import COMPLETED, FAILED, LEASED, QUEUED, SUPERSEDED
from fabric_pipelines.lib.broker.plans import plan_id
from fabric_pipelines.lib.core.files import write_bytes
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.index.receipt import receipt_sha256
from fabric_pipelines.lib.store.keys import set_id_of
from fabric_pipelines.lib.store.models import (
    Batch,
    BatchPlanRow,
    Embedding,
    HiddenStateShard,
    IndexReceipt,
    Model,
    TaskFailure,
    TaskSet,
)
from fabric_pipelines.lib.tasks.arrow_files import flat_tokens, read_table, write_table
from fabric_pipelines.lib.tasks.catalog import get_task_set, ingest_task_set, task_lengths


class RepairError(ValueError):
    """A repair that cannot be done as asked; the message says why and what to do instead."""


@dataclass(frozen=True)
class Requeued:
    task_set: str
    plan_id: str
    batches: list[int]
    rows_deleted: int
    shards_deleted: int
    failures_deleted: int


def find_plan(db: Engine, task_set: str, plan: str | None) -> BatchPlanRow:
    """The set's plan whose id starts with `plan`, or its current plan (None)."""
    ts = get_task_set(db, task_set)
    if plan is None:
        if ts.current_plan_id is None:
            raise RepairError(f"task set {task_set!r} has no plan yet: `fabric run {task_set}`")
        plan = ts.current_plan_id
    with Session(db, expire_on_commit=False) as session:
        rows = session.scalars(
            select(BatchPlanRow).where(
                BatchPlanRow.task_set_id == set_id_of(task_set),
                BatchPlanRow.plan_id.startswith(plan, autoescape=True),
            )
        ).all()
    if len(rows) != 1:
        what = "no plan" if not rows else f"{len(rows)} plans"
        raise RepairError(
            f"task set {task_set!r} has {what} whose id starts with {plan!r}: give the plan id "
            "that `fabric verify` printed"
        )
    found: BatchPlanRow = rows[0]
    return found


def task_table(db: Engine, paths: FabricPaths, task_set: str) -> pa.Table:
    """The set's stored tasks; a missing or damaged file is first written again by ingest from
    the set's unchanged inbox file (with the set's own settings), as `fabric run` would."""
    ts = get_task_set(db, task_set)
    try:
        return read_table(Path(ts.path), ts.content_sha256)
    except OSError:
        pass
    try:
        ingest_task_set(
            db, paths, task_set, model_id=ts.model_id, max_seq_len=ts.max_seq_len,
            prompt=ts.prompt,
        )  # fmt: skip
    except (ValueError, OSError) as exc:
        raise RepairError(
            f"the task-set file of {task_set!r} is damaged and ingest cannot write it again: {exc}"
        ) from exc
    ts = get_task_set(db, task_set)
    return read_table(Path(ts.path), ts.content_sha256)


def requeue_batches(
    db: Engine,
    paths: FabricPaths,
    task_set: str,
    batch_numbers: list[int],
    plan: str | None = None,
) -> Requeued:
    """Put completed or failed batches of a plan back in the queue, their results deleted."""
    plan_row = find_plan(db, task_set, plan)
    ts = get_task_set(db, task_set)
    wanted = sorted(set(batch_numbers))
    with db.connect() as conn:
        batches = {
            b.batch_no: b
            for b in conn.execute(
                select(Batch).where(Batch.plan_id == plan_row.plan_id, Batch.batch_no.in_(wanted))
            ).all()
        }
    for n in wanted:
        b = batches.get(n)
        if b is None:
            raise RepairError(
                f"plan {plan_row.plan_id} of {task_set!r} has no batch {n} (batches 0.."
                f"{plan_row.n_batches - 1})"
            )
        if b.state == SUPERSEDED:
            raise RepairError(
                f"batch {n} of plan {plan_row.plan_id} was superseded: its tasks were planned "
                "again in a later plan; requeue that plan's batch instead (`fabric verify` names it)"
            )
        if b.state == LEASED:
            raise RepairError(
                f"batch {n} of plan {plan_row.plan_id} is being extracted (leased by "
                f"{b.lease_owner}); requeue it after the run ends"
            )
    try:
        order = read_table(Path(plan_row.path), plan_row.sha256).column("task_row").to_numpy()
    except OSError as exc:
        raise RepairError(
            f"{exc}. The plan file says which tasks each batch holds: "
            f"`fabric restore-plan {task_set} {plan_row.plan_id}` first"
        ) from exc
    record_no = task_table(db, paths, task_set).column("record_no").to_numpy()
    records = np.concatenate(
        [
            record_no[order[b.item_start : b.item_start + b.item_count]]
            for b in (batches[n] for n in wanted)
        ]
    ).tolist()
    with db.begin() as conn:
        model = conn.execute(select(Model.id).where(Model.model_key == plan_row.model_key)).scalar()
        rows_deleted = 0
        if model is not None:
            rows_deleted = conn.execute(
                delete(Embedding).where(
                    Embedding.model_id == model,
                    Embedding.task_set_id == ts.id,
                    Embedding.record_no.in_(records),
                )
            ).rowcount
        shards_deleted = conn.execute(
            delete(HiddenStateShard).where(
                HiddenStateShard.plan_id == plan_row.plan_id,
                HiddenStateShard.batch_no.in_(wanted),
            )
        ).rowcount
        failures_deleted = conn.execute(
            delete(TaskFailure).where(
                TaskFailure.task_set_id == set_id_of(task_set),
                TaskFailure.stage == "extract",
                TaskFailure.record_no.in_(records),
            )
        ).rowcount
        moved = conn.execute(
            update(Batch)
            .where(
                Batch.plan_id == plan_row.plan_id,
                Batch.batch_no.in_(wanted),
                Batch.state.in_((COMPLETED, FAILED, QUEUED)),
            )
            .values(state=QUEUED, attempts=0, lease_owner=None, lease_deadline=None, error=None)
        ).rowcount
        if moved != len(wanted):  # a run claimed one meanwhile: change nothing
            raise RepairError(
                f"batches {wanted} of plan {plan_row.plan_id} changed state while requeueing "
                "(a run is extracting the set?); nothing was changed, try again after it ends"
            )
    return Requeued(
        task_set, plan_row.plan_id, wanted, rows_deleted, shards_deleted, failures_deleted
    )


def restore_plan_file(db: Engine, paths: FabricPaths, task_set: str, plan: str) -> Path:
    """Write a lost or corrupt plan file again by planning the same tasks again.

    A plan's id hashes the task set, model, profile and the exact tasks planned, and planning is
    deterministic, so a candidate set of tasks is right exactly when it gives the recorded id.
    Candidates: every task (a set's first plan), the tasks left after the set's earlier plans
    (their completed and failed batches), and the tasks outstanding now."""
    plan_row = find_plan(db, task_set, plan)
    table = task_table(db, paths, task_set)
    ts = get_task_set(db, task_set)
    profile = ConsumerProfile(**json.loads(plan_row.profile_json))
    lengths = task_lengths(table)
    tokens, offsets = flat_tokens(table)
    for rows in _candidate_rows(db, ts, plan_row, table):
        if plan_id(ts.content_sha256, plan_row.model_key, profile, rows) != plan_row.plan_id:
            continue
        planned = plan_batches(lengths, profile, rows, keys=prefix_keys(tokens, offsets))
        path = paths.plans / task_set / f"{plan_row.plan_id}.arrow"
        sha = write_table(
            path,
            pa.table({"task_row": pa.array(planned.order, type=pa.int64())}),
            {"fabric.plan_id": plan_row.plan_id, "fabric.task_set": task_set},
        )
        if (str(path), sha) != (plan_row.path, plan_row.sha256):
            with db.begin() as conn:
                conn.execute(
                    update(BatchPlanRow)
                    .where(BatchPlanRow.plan_id == plan_row.plan_id)
                    .values(path=str(path), sha256=sha)
                )
        return path
    raise RepairError(
        f"plan {plan_row.plan_id} of {task_set!r} cannot be planned again: no candidate set of "
        "tasks gives its id. Its batches' tasks are unknown; requeue nothing from it, and "
        f"submit the source file again under a new name to extract it afresh"
    )


def _candidate_rows(
    db: Engine, ts: TaskSet, plan_row: BatchPlanRow, table: pa.Table
) -> list[np.ndarray]:
    n = table.num_rows
    every = np.arange(n, dtype=np.int64)
    candidates = [every]
    record_no = table.column("record_no").to_numpy()
    with db.connect() as conn:
        earlier = conn.execute(
            select(BatchPlanRow)
            .where(
                BatchPlanRow.task_set_id == ts.id,
                BatchPlanRow.model_id == plan_row.model_id,
                BatchPlanRow.created_at < plan_row.created_at,
            )
            .order_by(BatchPlanRow.created_at)
        ).all()
        done = np.zeros(n, dtype=bool)
        usable = True
        for plan in earlier:
            try:
                order = read_table(Path(plan.path), plan.sha256).column("task_row").to_numpy()
            except OSError:
                usable = False
                break
            for b in conn.execute(
                select(Batch.item_start, Batch.item_count).where(
                    Batch.plan_id == plan.plan_id, Batch.state.in_((COMPLETED, FAILED))
                )
            ).all():
                done[order[b.item_start : b.item_start + b.item_count]] = True
        if usable and earlier:
            candidates.append(np.flatnonzero(~done).astype(np.int64))
        model = select(Model.id).where(Model.model_key == plan_row.model_key).scalar_subquery()
        finished = np.fromiter(
            conn.execute(
                select(Embedding.record_no).where(
                    Embedding.task_set_id == ts.id, Embedding.model_id == model
                )
            ).scalars(),
            dtype=np.int64,
        )
        failed = np.fromiter(
            conn.execute(
                select(TaskFailure.record_no).where(TaskFailure.task_set_id == set_id_of(ts.name))
            ).scalars(),
            dtype=np.int64,
        )
    outstanding = ~np.isin(record_no, np.concatenate([finished, failed]))
    candidates.append(np.flatnonzero(outstanding).astype(np.int64))
    return candidates


def restore_receipt_file(db: Engine, paths: FabricPaths, sha256: str) -> Path:
    """Write the receipt file `<sha256>.json` again from its database row."""
    with db.connect() as conn:
        text = conn.execute(
            select(IndexReceipt.receipt_json).where(IndexReceipt.receipt_sha256 == sha256)
        ).scalar()
    if text is None:
        raise RepairError(
            f"no index receipt {sha256} in the database: only published receipts can be "
            "restored (one below its recall floor was never recorded; delete its file)"
        )
    receipt = json.loads(text)
    if receipt_sha256(receipt) != sha256:
        raise RepairError(
            f"the database's copy of receipt {sha256} no longer hashes to its key; "
            "it cannot vouch for the file"
        )
    path = paths.receipts / f"{sha256}.json"
    write_bytes(path, text.encode("utf-8"))
    return path
