"""The batch ledger on both databases: claims, epoch-fenced acks, retries, accounting."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from sqlalchemy import Engine, func, insert, select, update

from fabric_gpu.batching import plan_batches
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.broker.ledger import (
    COMPLETED,
    FAILED,
    QUEUED,
    SUPERSEDED,
    StaleLeaseError,
    accounting,
    ack_many,
    claim_many,
    hand_back,
    heartbeat_interval,
    register_plan,
    renew_leases,
    report_failure,
    superseded_by,
)
from fabric_pipelines.lib.store.keys import model_id, set_id_of
from fabric_pipelines.lib.store.models import Batch, BatchPlanRow, TaskFailure, TaskSet
from tests.ledger_helpers import ack, claim

PROFILE = ConsumerProfile(256, 8, 64, 8)


def _setup(db: Engine, n_items: int = 40, name: str = "set") -> tuple[str, int]:
    lengths = np.random.default_rng(1).integers(1, 65, n_items)
    plan = plan_batches(lengths, PROFILE)
    with db.begin() as conn:
        conn.execute(
            insert(TaskSet),
            {
                "name": name, "source_sha256": "s", "content_sha256": "c", "path": "p",
                "model_id": "m", "tokenizer_sha256": "t", "max_seq_len": 64,
                "n_records": n_items, "n_tasks": n_items, "truncated": 0,
                "current_plan_id": "plan-1",
            },
        )  # fmt: skip
        conn.execute(
            insert(BatchPlanRow).values(
                task_set_id=set_id_of(name), model_id=model_id(conn, "m")
            ),
            {
                "plan_id": "plan-1", "profile_json": "{}",
                "n_batches": plan.n_batches, "n_items": n_items, "real_tokens": 0,
                "padded_tokens": 0, "path": "p", "sha256": "x",
            },
        )  # fmt: skip
        assert register_plan(conn, "plan-1", name, plan) == plan.n_batches
        assert register_plan(conn, "plan-1", name, plan) == 0  # idempotent
    return "plan-1", plan.n_batches


def test_claim_ack_until_drained_and_accounting_follows(db: Engine) -> None:
    plan, n = _setup(db)
    with db.connect() as conn:
        a = accounting(conn, "set", "m")
    assert (a.tasks, a.queued, a.in_flight, a.completed) == (40, 40, 0, 0)
    seen = []
    while (lease := claim(db, plan, "w1", 60)) is not None:
        with db.connect() as conn:
            a = accounting(conn, "set", "m")
            assert a.in_flight == lease.item_count
        with db.begin() as conn:
            ack(conn, lease)
        seen.append(lease.batch_no)
    assert sorted(seen) == list(range(n))
    with db.connect() as conn:
        states = conn.execute(select(Batch.state, func.count()).group_by(Batch.state)).all()
    assert dict(states) == {COMPLETED: n}


def test_an_expired_lease_is_taken_over_and_the_late_ack_refused(db: Engine) -> None:
    plan, _ = _setup(db)
    first = claim(db, plan, "slow-worker", lease_seconds=10, now=1000.0)
    assert first is not None and first.epoch == 1
    # Before expiry nobody else gets that batch.
    other = claim(db, plan, "w2", 10, now=1005.0)
    assert other is not None and other.batch_no != first.batch_no
    # After expiry the batch is claimed again with a higher epoch.
    taken = claim(db, plan, "w3", 10, now=1011.0)
    assert taken is not None and taken.batch_no == first.batch_no and taken.epoch == 2
    with pytest.raises(StaleLeaseError, match="epoch 1 is no longer current"), db.begin() as conn:
        ack(conn, first)
    with db.begin() as conn:
        ack(conn, taken)
    with db.begin() as conn:
        ack(conn, taken)  # the holder's ack again (a replay after a lost reply) is accepted
    with pytest.raises(StaleLeaseError), db.begin() as conn:
        ack(conn, first)  # the old epoch stays refused after completion


def test_unused_leases_handed_back_are_queued_again_without_spending_an_attempt(
    db: Engine,
) -> None:
    """A worker that stops with leases claimed ahead hands them back; one taken over after it
    expired stays with its new holder."""
    plan, _ = _setup(db)
    leases = claim_many(db, plan, "w1", lease_seconds=10, limit=3, now=1000.0)
    assert len(leases) == 3
    taken = claim(db, plan, "w2", 10, now=1011.0)  # w1's leases expired: the first is taken
    assert taken is not None and taken.batch_no == leases[0].batch_no and taken.epoch == 2
    assert hand_back(db, leases) == 2
    with db.connect() as conn:
        rows = {
            r.batch_no: (r.state, r.lease_owner, r.attempts)
            for r in conn.execute(
                select(Batch.batch_no, Batch.state, Batch.lease_owner, Batch.attempts)
            )
        }
    assert rows[leases[0].batch_no] == ("leased", "w2", 2)
    assert rows[leases[1].batch_no] == (QUEUED, None, 0)
    assert rows[leases[2].batch_no] == (QUEUED, None, 0)
    again = claim_many(db, plan, "w3", 10, 2, now=1012.0)
    assert {lease.batch_no for lease in again} == {leases[1].batch_no, leases[2].batch_no}
    assert all(lease.epoch == 2 and lease.attempts == 1 for lease in again)
    assert hand_back(db, []) == 0


def test_one_statement_acks_a_group_and_names_only_its_stale_leases(db: Engine) -> None:
    plan, _ = _setup(db)
    stale = claim(db, plan, "slow-worker", lease_seconds=10, now=1000.0)
    current = claim(db, plan, "w2", 10, now=1001.0)
    assert stale is not None and current is not None
    taken = claim(db, plan, "w3", 10, now=1011.0)  # takes over the expired first lease
    assert taken is not None and taken.batch_no == stale.batch_no
    with db.begin() as conn:
        assert ack_many(conn, [stale, current]) == [stale]
    with db.connect() as conn:
        state = conn.execute(
            select(Batch.batch_no, Batch.state).where(
                Batch.batch_no.in_([stale.batch_no, current.batch_no])
            )
        ).all()
    assert dict(state) == {stale.batch_no: "leased", current.batch_no: COMPLETED}
    with db.begin() as conn:
        assert ack_many(conn, [taken, current]) == []  # a replay of current's ack is accepted
    with db.begin() as conn:  # an expired lease and its retake of the same batch, in one group
        assert ack_many(conn, [stale, taken]) == [stale]


def test_failures_are_retried_then_failed_with_the_items(db: Engine) -> None:
    plan, _ = _setup(db)
    items = [(i, f"id-{i}") for i in range(3)]
    lease = claim(db, plan, "w", 60)
    assert lease is not None
    assert report_failure(db, lease, "boom", 2, items, "set") == QUEUED
    again = claim(db, plan, "w", 60)
    assert again is not None and again.batch_no == lease.batch_no and again.attempts == 2
    assert report_failure(db, again, "boom", 2, items, "set") == FAILED
    with db.connect() as conn:
        a = accounting(conn, "set", "m")
        state = conn.execute(select(Batch.state).where(Batch.batch_no == lease.batch_no)).scalar()
    assert state == FAILED
    assert a.failed == 3


def test_concurrent_claimers_never_share_a_batch(db: Engine) -> None:
    plan, n = _setup(db, n_items=200)
    claimed: list[list[int]] = [[] for _ in range(4)]

    def worker(k: int) -> None:
        while (lease := claim(db, plan, f"w{k}", 60)) is not None:
            with db.begin() as conn:
                ack(conn, lease)
            claimed[k].append(lease.batch_no)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    everything = sorted(b for c in claimed for b in c)
    assert everything == list(range(n))


def test_accounting_of_an_unknown_set_is_an_error(db: Engine) -> None:
    with db.connect() as conn, pytest.raises(LookupError, match="no task set named 'nope'"):
        accounting(conn, "nope")


def _deadline(db: Engine, batch_no: int) -> float | None:
    with db.connect() as conn:
        return conn.execute(
            select(Batch.lease_deadline).where(Batch.batch_no == batch_no)
        ).scalar_one()


def test_a_heartbeat_renews_only_leases_still_current(db: Engine) -> None:
    plan, _ = _setup(db)
    lost = claim(db, plan, "w1", 10, now=1000.0)  # the lowest batch: taken over first
    mine = claim(db, plan, "w1", 10, now=1000.0)
    done = claim(db, plan, "w1", 10, now=1000.0)
    assert mine is not None and done is not None and lost is not None
    with db.begin() as conn:
        ack(conn, done)
    taken = claim(db, plan, "w2", 10, now=1011.0)  # lost's lease expired: w2 took it over
    assert taken is not None and taken.batch_no == lost.batch_no
    # `mine` expired too but nobody took it yet: its holder, still alive, keeps it.
    assert renew_leases(db, [mine, done, lost], 10, now=1012.0) == [mine]
    assert _deadline(db, mine.batch_no) == 1022.0
    assert _deadline(db, lost.batch_no) == 1021.0  # w2's deadline, untouched
    assert _deadline(db, done.batch_no) is None
    other = claim(db, plan, "w3", 10, now=1015.0)
    assert other is not None and other.batch_no != mine.batch_no, "a renewed lease is not free"


def test_a_failure_report_replayed_after_a_lost_reply_lands_once(db: Engine) -> None:
    plan, _ = _setup(db)
    items = [(i, f"id-{i}") for i in range(3)]
    lease = claim(db, plan, "w", 60)
    assert lease is not None
    assert report_failure(db, lease, "boom", 1, items, "set") == FAILED
    assert report_failure(db, lease, "boom", 1, items, "set") == FAILED  # the retry
    with db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(TaskFailure)).scalar_one() == 3
    again = claim(db, plan, "w", 60)
    assert again is not None
    assert report_failure(db, again, "oops", 3, items, "set") == QUEUED
    taken = claim(db, plan, "w2", 60)
    assert taken is not None and taken.batch_no == again.batch_no
    with pytest.raises(StaleLeaseError, match="is stale"):
        report_failure(db, again, "oops", 3, items, "set")  # the batch moved on: refused


def test_a_replanned_set_names_the_plan_that_superseded_the_old_one(db: Engine) -> None:
    plan, _ = _setup(db)
    with db.connect() as conn:
        assert superseded_by(conn, "set", plan) is None
    lease = claim(db, plan, "w", 60)
    assert lease is not None
    with db.begin() as conn:
        conn.execute(
            insert(BatchPlanRow).values(
                task_set_id=set_id_of("set"), model_id=model_id(conn, "m")
            ),
            {
                "plan_id": "plan-2", "profile_json": "{}",
                "n_batches": 1, "n_items": 40, "real_tokens": 0, "padded_tokens": 0,
                "path": "p", "sha256": "y",
            },
        )  # fmt: skip
        register_plan(conn, "plan-2", "set", plan_batches(np.full(40, 8), PROFILE))
        conn.execute(update(TaskSet).values(current_plan_id="plan-2"))
        assert superseded_by(conn, "set", plan) == "plan-2"
        assert superseded_by(conn, "set", "plan-2") is None
        assert (
            conn.execute(
                select(Batch.state).where(Batch.plan_id == plan, Batch.batch_no == lease.batch_no)
            ).scalar_one()
            == SUPERSEDED
        )
    with pytest.raises(StaleLeaseError), db.begin() as conn:
        ack(conn, lease)  # the superseded plan's late ack is refused


def test_a_plan_registered_again_queues_the_batches_a_later_plan_superseded(db: Engine) -> None:
    plan, n_batches = _setup(db)
    old_lease = claim(db, plan, "w", 60)
    assert old_lease is not None
    with db.begin() as conn:  # another engine's plan for the same items supersedes plan-1
        conn.execute(
            insert(BatchPlanRow).values(
                task_set_id=set_id_of("set"), model_id=model_id(conn, "m2")
            ),
            {
                "plan_id": "plan-2", "profile_json": "{}",
                "n_batches": 1, "n_items": 40, "real_tokens": 0, "padded_tokens": 0,
                "path": "p", "sha256": "y",
            },
        )  # fmt: skip
        register_plan(conn, "plan-2", "set", plan_batches(np.full(40, 8), PROFILE))
        # plan-1 again (nothing finished, so the same id): its batches are the work once more
        assert register_plan(conn, "plan-1", "set", plan_batches(np.full(40, 8), PROFILE)) == 0
        states = dict(
            conn.execute(
                select(Batch.plan_id, func.count())
                .where(Batch.state == QUEUED)
                .group_by(Batch.plan_id)
            ).all()
        )
    assert states == {plan: n_batches}
    with pytest.raises(StaleLeaseError), db.begin() as conn:
        ack(conn, old_lease)  # taken before plan-2 superseded it: still refused
    while (lease := claim(db, plan, "w2", 60)) is not None:
        with db.begin() as conn:
            ack(conn, lease)
    with db.connect() as conn:
        assert accounting(conn, "set").in_flight == 0


def test_heartbeat_timing_is_checked_against_the_lease() -> None:
    assert heartbeat_interval(30.0) == 10.0
    assert heartbeat_interval(30.0, 5.0) == 5.0
    with pytest.raises(ValueError, match=r"heartbeat_seconds=30\.0 must be positive and shorter"):
        heartbeat_interval(30.0, 30.0)
    with pytest.raises(ValueError, match="lease_seconds must be positive"):
        heartbeat_interval(0.0)
