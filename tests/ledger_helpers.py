"""One-batch forms of the ledger's claim and ack, for tests that step through a plan by hand
(the product claims and acks in groups: claim_many, ack_many)."""

from __future__ import annotations

from sqlalchemy import Connection, Engine, insert, select

from fabric_gpu.batching import BatchPlan
from fabric_pipelines.lib.broker.ledger import (
    Lease,
    StaleLeaseError,
    ack_many,
    claim_many,
    register_plan,
    stale_reason,
)
from fabric_pipelines.lib.store.keys import model_id
from fabric_pipelines.lib.store.models import BatchPlanRow, TaskSet


def claim(
    engine: Engine, plan_id: str, owner: str, lease_seconds: float, now: float | None = None
) -> Lease | None:
    """Lease the next batch that is queued, or whose lease expired; None when none is left."""
    leases = claim_many(engine, plan_id, owner, lease_seconds, 1, now)
    return leases[0] if leases else None


def ack(conn: Connection, lease: Lease) -> None:
    """Retire the batch inside the caller's transaction; StaleLeaseError if the lease moved on."""
    if ack_many(conn, [lease]):
        raise StaleLeaseError(stale_reason(lease))


def store_plan(conn: Connection, plan_id: str, task_set: str, plan: BatchPlan) -> int:
    """A task set (made if absent), its plan row and the plan's ledger rows, as the foreign keys
    ask: for tests that need a ledger, not a real task set. Returns the set's id."""
    set_id = conn.execute(select(TaskSet.id).where(TaskSet.name == task_set)).scalar()
    if set_id is None:
        set_id = conn.execute(
            insert(TaskSet).returning(TaskSet.id),
            {
                "name": task_set, "source_sha256": "s", "content_sha256": "c", "path": "p",
                "model_id": "m", "tokenizer_sha256": "t", "max_seq_len": 64,
                "n_records": len(plan.order), "n_tasks": len(plan.order), "truncated": 0,
                "current_plan_id": plan_id,
            },
        ).scalar_one()  # fmt: skip
    conn.execute(
        insert(BatchPlanRow).values(task_set_id=set_id, model_id=model_id(conn, "m")),
        {
            "plan_id": plan_id, "profile_json": "{}", "n_batches": plan.n_batches,
            "n_items": len(plan.order), "real_tokens": 0, "padded_tokens": 0, "path": "p",
            "sha256": "x",
        },
    )  # fmt: skip
    register_plan(conn, plan_id, task_set, plan)
    return int(set_id)


def store_set(engine: Engine, task_set: str, n_records: int = 0) -> int:
    """A bare task-set row (no file, no plan), for tests of what hangs off one; its id."""
    with engine.begin() as conn:
        return int(
            conn.execute(
                insert(TaskSet).returning(TaskSet.id),
                {
                    "name": task_set, "source_sha256": "s", "content_sha256": "c", "path": "p",
                    "model_id": "m", "tokenizer_sha256": "t", "max_seq_len": 64,
                    "n_records": n_records, "n_tasks": n_records, "truncated": 0,
                },
            ).scalar_one()
        )  # fmt: skip
