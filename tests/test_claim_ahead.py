"""Claiming ahead of the submit loop (broker/claim_ahead.py): every lease claimed is handed out
once and in order, a slow claim does not stop leases already claimed from being taken, errors
reach the taker, and two workers claiming ahead on one SQLite ledger share it exactly."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import select

from fabric_gpu.batching import BatchPlan
from fabric_pipelines.lib.broker.claim_ahead import ClaimAhead
from fabric_pipelines.lib.broker.ledger import Lease, claim_many
from fabric_pipelines.lib.store.db import create_schema, make_engine
from fabric_pipelines.lib.store.models import Batch
from tests.ledger_helpers import store_plan


def _lease(batch_no: int) -> Lease:
    return Lease(
        plan_id="p", batch_no=batch_no, epoch=1, owner="w", seq_len=8, item_start=0,
        item_count=1, real_tokens=8, padded_tokens=8, attempts=1,
    )  # fmt: skip


class FakeLedger:
    """Hands out `total` batches in order, `count` at a time; records each claim's size."""

    def __init__(self, total: int, delay_s: float = 0.0) -> None:
        self.left = list(range(total))
        self.sizes: list[int] = []
        self.delay_s = delay_s
        self.lock = threading.Lock()

    def claim(self, count: int) -> list[Lease]:
        time.sleep(self.delay_s)
        with self.lock:
            taken, self.left = self.left[:count], self.left[count:]
            self.sizes.append(count)
        return [_lease(n) for n in taken]


def _drain(ahead: ClaimAhead) -> list[int]:
    taken = []
    while (lease := ahead.take()) is not None:
        taken.append(lease.batch_no)
    return taken


def test_every_lease_is_taken_once_in_claim_order_then_none() -> None:
    ledger = FakeLedger(50)
    with ClaimAhead(ledger.claim, chunk=4, max_depth=12) as ahead:
        assert _drain(ahead) == list(range(50))
        assert ahead.take() is None  # stays exhausted
    assert set(ledger.sizes) == {4}
    assert len(ledger.sizes) == 14  # 13 claims with leases, then the empty one


def test_it_keeps_two_chunks_until_it_knows_the_pace_and_never_more_than_its_most() -> None:
    ledger = FakeLedger(1000)
    ahead = ClaimAhead(ledger.claim, chunk=3, max_depth=9, ahead_s=10.0)
    time.sleep(0.2)  # plenty of time to over-claim, if it would
    assert 1000 - len(ledger.left) == 6  # two chunks: no pace yet
    for _ in range(40):  # taken fast: 10 s of that pace is far more than 9
        assert ahead.take() is not None
    time.sleep(0.2)
    ready = 1000 - len(ledger.left) - 40
    assert 9 - 3 < ready <= 9  # topped up a chunk at a time, to at most 9
    assert len(ahead.close()) == ready  # claimed, never taken: handed back to the caller


def test_slow_batches_are_claimed_only_a_little_ahead() -> None:
    """Kept ready: `ahead_s` at the pace they are taken, so a worker on slow batches leaves the
    rest of the plan to the others."""
    ledger = FakeLedger(1000)
    ahead = ClaimAhead(ledger.claim, chunk=2, max_depth=40, ahead_s=0.1)
    for _ in range(20):
        assert ahead.take() is not None
        time.sleep(0.025)  # ~35 a second at most: 0.1 s of them is 4 or fewer
    time.sleep(0.1)
    with ahead._changed:
        assert ahead.depth() <= 4
    assert 1000 - len(ledger.left) - 20 <= 4
    ahead.close()


def test_a_slow_supply_does_not_shrink_itself() -> None:
    """Claims slower than the taker: it waits for each, but the pace is the taker's own (its
    waits left out), so the supply it asks for is deep, not as shallow as what it got."""
    ledger = FakeLedger(1000, delay_s=0.02)
    ahead = ClaimAhead(ledger.claim, chunk=2, max_depth=30, ahead_s=0.25)
    for _ in range(30):
        assert ahead.take() is not None  # each take waits for a claim: ~100 a second got
    with ahead._changed:
        assert ahead.depth() == 30  # the taker itself needs next to no time per lease
    ahead.close()


def test_leases_claimed_are_taken_while_the_next_claim_is_slow() -> None:
    """The point of claiming ahead: a claim stuck on the write lock does not stall the taker."""
    release = threading.Event()
    calls = 0
    claimed_on: set[str] = set()

    def claim(count: int) -> list[Lease]:
        nonlocal calls
        calls += 1
        claimed_on.add(threading.current_thread().name)
        if calls > 1:
            release.wait(30)  # every later claim waits (another transaction holds the lock)
        return [_lease(calls * 100 + n) for n in range(count)] if calls < 3 else []

    ahead = ClaimAhead(claim, chunk=4, max_depth=8)
    started = time.monotonic()
    first = [ahead.take() for _ in range(4)]
    assert all(lease is not None for lease in first)
    assert time.monotonic() - started < 5  # the stuck claim did not hold these back
    release.set()
    assert [lease.batch_no for lease in first if lease] == [100, 101, 102, 103]
    assert _drain(ahead) == [200, 201, 202, 203]
    ahead.close()
    assert claimed_on == {"fabric-claim-ahead"}  # never on the taker's thread


def test_a_failed_claim_is_raised_to_the_taker_after_the_leases_before_it() -> None:
    calls = 0

    def claim(count: int) -> list[Lease]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("the database went away")
        return [_lease(n) for n in range(count)]

    with ClaimAhead(claim, chunk=2, max_depth=2) as ahead:
        assert [ahead.take(), ahead.take()] != [None, None]
        with pytest.raises(RuntimeError, match="went away"):
            ahead.take()


def test_closing_stops_a_claim_waiting_to_retry() -> None:
    """A claim that waits between retries (the database away) watches `stopping`: closing sets
    it first, so the worker's exit does not wait out the retry budget."""
    stopping = threading.Event()
    claims: list[str] = []

    def claim(count: int) -> list[Lease]:
        claims.append("claimed")
        if len(claims) == 1:
            return [_lease(n) for n in range(count)]
        # The second claim: the database went away; it waits a long back-off to retry.
        claims[-1] = "stopped" if stopping.wait(120) else "waited it out"
        return []

    ahead = ClaimAhead(claim, chunk=2, max_depth=4, stopping=stopping)
    assert ahead.take() is not None
    while len(claims) < 2:  # the thread is now in the second claim's wait
        time.sleep(0.01)
    started = time.monotonic()
    left = ahead.close()
    assert time.monotonic() - started < 60 and claims == ["claimed", "stopped"]
    assert len(left) == 1  # the first chunk's second lease, never taken


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="chunk <= max_depth"):
        ClaimAhead(FakeLedger(1).claim, chunk=3, max_depth=2)


def test_two_workers_claiming_ahead_on_one_sqlite_ledger_take_every_batch_once(
    tmp_path: Path,
) -> None:
    """Two claimers (their own threads and connections) on the real ledger at once, each taker
    slow enough that the claimers contend: every batch is leased to exactly one of them."""
    db = make_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    create_schema(db)
    ones = np.ones(60, dtype=np.int64)
    plan = BatchPlan(
        order=np.arange(60), seq_len=8 * ones, item_start=np.arange(60), item_count=ones,
        real_tokens=8 * ones, padded_tokens=8 * ones,
    )  # fmt: skip
    with db.begin() as conn:
        store_plan(conn, "p", "s", plan)
    taken: dict[str, list[int]] = {}

    def work(owner: str) -> None:
        ahead = ClaimAhead(lambda n: claim_many(db, "p", owner, 60.0, n), chunk=2, max_depth=6)
        with ahead:
            while (lease := ahead.take()) is not None:
                taken.setdefault(owner, []).append(lease.batch_no)
                time.sleep(0.002)

    threads = [threading.Thread(target=work, args=(f"w{n}",)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = sorted(taken.get("w0", []) + taken.get("w1", []))
    assert every == list(range(60))
    assert taken.get("w0") and taken.get("w1")  # both took part
    with db.connect() as conn:
        owners = dict(conn.execute(select(Batch.batch_no, Batch.lease_owner)).all())
    assert owners == {n: owner for owner, batches in taken.items() for n in batches}
