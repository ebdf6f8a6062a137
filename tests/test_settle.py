"""Settling the embeddings table after a run's writes (lib/store/settle.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from sqlalchemy import Engine, insert, text

from fabric_pipelines.lib.store import settle
from fabric_pipelines.lib.store.keys import model_id
from fabric_pipelines.lib.store.models import Embedding

POSTGRES_ONLY = pytest.mark.parametrize(
    "db_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def _write(db: Engine, n: int, first: int = 0) -> None:
    """Rows `first` .. `first + n - 1` of one set and model, in one transaction."""
    vector = np.ones(8, "<f4").tobytes()
    with db.begin() as conn:
        key = model_id(conn, "m")
        conn.execute(
            insert(Embedding),
            [
                {"model_id": key, "task_set_id": 1, "record_no": r, "n_tokens": 3, "vector": vector}
                for r in range(first, first + n)
            ],
        )


def _embeddings_stat(db: Engine, sql: str) -> int:
    with db.connect() as conn:
        return int(conn.execute(text(sql)).scalar_one())


def _all_visible_pages(db: Engine) -> int:
    return _embeddings_stat(db, "SELECT relallvisible FROM pg_class WHERE relname = 'embeddings'")


@POSTGRES_ONLY
def test_settling_marks_the_pages_visible_and_counts_the_rows(db: Engine) -> None:
    with db.begin() as conn:  # the server's own vacuum must not do it first
        conn.execute(text("ALTER TABLE embeddings SET (autovacuum_enabled = false)"))
    _write(db, 2000)
    assert _all_visible_pages(db) == 0  # fresh rows: the heap must be read to count them
    assert settle.settle_embeddings(db)
    assert _all_visible_pages(db) > 0
    with db.connect() as conn:
        estimate = conn.execute(
            text("SELECT reltuples FROM pg_class WHERE relname = 'embeddings'")
        ).scalar_one()
    assert estimate == 2000  # ANALYZE refreshed the planner's estimate


@POSTGRES_ONLY
def test_a_settle_that_meets_another_sessions_vacuum_lock_gives_up_in_time(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another session holds the table's maintenance lock (as a concurrent VACUUM would): the
    settle waits LOCK_WAIT_MS, then returns False, leaving rows and session as they were."""
    monkeypatch.setattr(settle, "LOCK_WAIT_MS", 200)
    _write(db, 10)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with db.begin() as conn:
            conn.execute(text("LOCK TABLE embeddings IN SHARE UPDATE EXCLUSIVE MODE"))
            holding.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(10)
        assert settle.settle_embeddings(db) is False
    finally:
        release.set()
        holder.join()
    with db.connect() as conn:
        assert conn.execute(text("SHOW lock_timeout")).scalar_one() == "0"
        assert conn.execute(text("SELECT count(*) FROM embeddings")).scalar_one() == 10
    assert settle.settle_embeddings(db)  # once the lock is free


@SQLITE_ONLY
def test_sqlite_needs_no_settling(db: Engine) -> None:
    _write(db, 3)
    assert settle.settle_embeddings(db) is False


def _vacuums_of_embeddings(db: Engine) -> int:
    return _embeddings_stat(
        db, "SELECT vacuum_count FROM pg_stat_user_tables WHERE relname = 'embeddings'"
    )


@POSTGRES_ONLY
def test_settling_meanwhile_marks_pages_while_rows_are_written(db: Engine) -> None:
    """A writer commits batches while the settler vacuums on its own thread: pages are marked
    visible before the block ends, every row stays, and leaving the block stops the thread."""
    with db.begin() as conn:
        conn.execute(text("ALTER TABLE embeddings SET (autovacuum_enabled = false)"))
    before = _vacuums_of_embeddings(db)
    with settle.settling_meanwhile(db, every_s=0.05):
        for batch in range(20):
            _write(db, 200, first=batch * 200)
            threading.Event().wait(0.02)
        deadline = time.monotonic() + 30
        while _vacuums_of_embeddings(db) - before < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _vacuums_of_embeddings(db) - before >= 2
        assert _all_visible_pages(db) > 0  # marked while the block still runs
    assert not any(t.name == "settle-embeddings" for t in threading.enumerate())
    with db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM embeddings")).scalar_one() == 4000


@POSTGRES_ONLY
def test_settling_meanwhile_skips_a_turn_while_another_session_vacuums(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another session holds the maintenance lock for the whole block: the settler's turns give
    up at once instead of queueing behind it, and the block ends without waiting for the lock."""
    _write(db, 10)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with db.begin() as conn:
            conn.execute(text("LOCK TABLE embeddings IN SHARE UPDATE EXCLUSIVE MODE"))
            holding.set()
            release.wait(10)

    tries: list[bool] = []
    vacuum = settle._vacuum

    def counted(*args: object) -> bool:
        tries.append(vacuum(*args))  # type: ignore[arg-type]
        return tries[-1]

    monkeypatch.setattr(settle, "_vacuum", counted)
    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(10)
        with settle.settling_meanwhile(db, every_s=0.02):
            threading.Event().wait(0.3)
        assert holder.is_alive()  # the block ended while the lock was still held
        assert tries and not any(tries)  # it tried, and every try gave up at once
    finally:
        release.set()
        holder.join()


@SQLITE_ONLY
def test_sqlite_settles_nothing_meanwhile(db: Engine) -> None:
    with settle.settling_meanwhile(db, every_s=0.01):
        threading.Event().wait(0.05)
    assert not any(t.name == "settle-embeddings" for t in threading.enumerate())
    _write(db, 3)
