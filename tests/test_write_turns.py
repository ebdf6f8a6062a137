"""SQLite's write lock taken in turn by one process's threads (store/write_turns.py)."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from fabric_pipelines.lib.store.db import make_engine
from fabric_pipelines.lib.store.write_turns import TurnConnection, WriteTurns, turns_for


def test_turns_go_in_arrival_order() -> None:
    turns = WriteTurns()
    first = turns.acquire(1)
    order: list[int] = []

    def wait_then_note(n: int) -> None:
        turn = turns.acquire(10)
        order.append(n)
        turns.release(turn)

    threads = []
    for n in range(5):
        threads.append(threading.Thread(target=wait_then_note, args=(n,)))
        threads[-1].start()
        while len(turns._waiting) < n + 1:  # each queued before the next starts
            time.sleep(0.001)
    turns.release(first)
    for thread in threads:
        thread.join()
    assert order == [0, 1, 2, 3, 4]


def test_a_wait_that_runs_out_says_so_and_leaves_the_queue() -> None:
    turns = WriteTurns()
    held = turns.acquire(1)
    with pytest.raises(sqlite3.OperationalError, match=r"database is locked.*0.05 s"):
        turns.acquire(0.05)
    assert not turns._waiting
    turns.release(held)
    turns.release(turns.acquire(0.05))  # free again


def test_releasing_a_turn_not_held_is_an_error() -> None:
    turns = WriteTurns()
    with pytest.raises(RuntimeError, match="does not hold"):
        turns.release(threading.Event())


def test_in_memory_databases_take_no_turns(tmp_path: Path) -> None:
    assert turns_for(":memory:") is None
    assert turns_for(str(tmp_path / "a.db")) is turns_for(str(tmp_path / "." / "a.db"))


@pytest.mark.parametrize("end", ["commit", "rollback", "close", "failed-begin"])
def test_a_transaction_gives_its_turn_back_however_it_ends(tmp_path: Path, end: str) -> None:
    path = tmp_path / "t.db"
    conn = sqlite3.connect(path, isolation_level=None, factory=TurnConnection, timeout=0.2)
    assert isinstance(conn, TurnConnection)
    conn.execute("CREATE TABLE t (x)")
    if end == "failed-begin":  # another process holds the write lock: BEGIN IMMEDIATE fails
        other = sqlite3.connect(path, isolation_level=None, timeout=0)
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            conn.begin_immediate()
        other.rollback()
    else:
        conn.begin_immediate()
        conn.execute("INSERT INTO t VALUES (1)")
        getattr(conn, end)()
    turns = turns_for(str(path))
    assert turns is not None
    turns.release(turns.acquire(0.05))  # nobody holds it


def test_a_waiting_thread_goes_before_a_writer_that_begins_again_at_once(tmp_path: Path) -> None:
    """A writer commits and begins again in a loop (as the result writer does); another thread's
    transactions each wait for at most the writer's transaction under way, not for a lucky gap
    (SQLite's own busy handler let the writer win for seconds on end)."""
    db = make_engine(f"sqlite:///{tmp_path / 'w.db'}")
    with db.begin() as conn:
        conn.execute(text("CREATE TABLE log (who TEXT)"))
    starts: list[str] = []
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            with db.begin() as conn:
                starts.append("writer")
                conn.execute(text("INSERT INTO log VALUES ('writer')"))
                time.sleep(0.003)

    behind: list[int] = []

    def claimer() -> None:
        for _ in range(20):
            asked = len(starts)
            with db.begin() as conn:
                behind.append(starts[asked:].count("writer"))
                starts.append("claimer")
                conn.execute(text("INSERT INTO log VALUES ('claimer')"))
            time.sleep(0.005)

    threads = [threading.Thread(target=writer), threading.Thread(target=claimer)]
    for thread in threads:
        thread.start()
    threads[1].join()
    stop.set()
    threads[0].join()
    assert len(behind) == 20 and max(behind) <= 1, behind
    with db.connect() as conn:
        counts: dict[str, int] = dict(
            conn.execute(text("SELECT who, count(*) FROM log GROUP BY who")).all()
        )
    assert counts["claimer"] == 20 and counts["writer"] == starts.count("writer")
    db.dispose()
