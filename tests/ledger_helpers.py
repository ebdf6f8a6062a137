"""One-batch forms of the ledger's claim and ack, for tests that step through a plan by hand
(the product claims and acks in groups: claim_many, ack_many)."""

from __future__ import annotations

from sqlalchemy import Connection, Engine

from fabric_pipelines.lib.broker.ledger import (
    Lease,
    StaleLeaseError,
    ack_many,
    claim_many,
    stale_reason,
)


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
