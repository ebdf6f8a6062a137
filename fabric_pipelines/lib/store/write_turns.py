"""SQLite's write lock, taken in turn by the threads of one process.

Every transaction on the embedded SQLite file begins with BEGIN IMMEDIATE (store/db.py), so it
holds the file's one write lock from its first statement. When two threads of one process want
it, SQLite's busy handler makes the loser sleep and try again (1, 2, 5, ... up to 100 ms between
tries), and a thread that commits and begins again at once (the result writer) wins nearly every
time: on one H200 a worker's batch claims waited 5.8 s of a 12 s extraction for the lock, while
the GPU ran dry.

`WriteTurns` hands the lock over in arrival order instead: a connection made by `TurnConnection`
waits for its turn before BEGIN IMMEDIATE and gives it up when its transaction ends (commit,
rollback or close). Other processes still meet SQLite's own lock and busy handler.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections import deque
from typing import Any


class WriteTurns:
    """A first-come, first-served lock with a timeout."""

    def __init__(self) -> None:
        # Re-entrant: a connection dropped unclosed is rolled back by garbage collection, which
        # may run on a thread already inside acquire or release.
        self._lock = threading.RLock()
        self._holder: threading.Event | None = None
        self._waiting: deque[threading.Event] = deque()

    def acquire(self, timeout_s: float) -> threading.Event:
        """Wait for the turn; returns the token `release` takes. Raises sqlite3.OperationalError
        (as SQLite's own busy timeout does) after `timeout_s`."""
        turn = threading.Event()
        with self._lock:
            if self._holder is None and not self._waiting:
                self._holder = turn
                return turn
            self._waiting.append(turn)
        if turn.wait(timeout_s):
            return turn
        with self._lock:
            if self._holder is turn:  # handed over just as the wait ran out
                return turn
            self._waiting.remove(turn)
        raise sqlite3.OperationalError(
            f"database is locked: another thread of this process held its write transaction "
            f"for more than {timeout_s:g} s"
        )

    def release(self, turn: threading.Event) -> None:
        with self._lock:
            if self._holder is not turn:
                raise RuntimeError("released a write turn this connection does not hold")
            self._holder = self._waiting.popleft() if self._waiting else None
            if self._holder is not None:
                self._holder.set()


_turns: dict[str, WriteTurns] = {}
_turns_lock = threading.Lock()


def turns_for(database: str) -> WriteTurns | None:
    """The process's turns for one database file; None for an in-memory database."""
    if not database or database == ":memory:" or database.startswith("file::memory:"):
        return None
    key = os.path.realpath(database)
    with _turns_lock:
        return _turns.setdefault(key, WriteTurns())


class TurnConnection(sqlite3.Connection):
    """A sqlite3 connection whose write transactions take the process's turn for its file
    (sqlite3.connect(..., factory=TurnConnection))."""

    def __init__(self, database: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(database, *args, **kwargs)
        self._turns = turns_for(os.fsdecode(database))
        self._busy_timeout_s = float(kwargs.get("timeout", 5.0))
        self._turn: threading.Event | None = None

    def begin_immediate(self) -> None:
        """BEGIN IMMEDIATE, once this thread's turn has come."""
        if self._turns is not None and self._turn is None:
            self._turn = self._turns.acquire(self._busy_timeout_s)
        try:
            self.execute("BEGIN IMMEDIATE")
        except BaseException:
            self._give_back()
            raise

    def commit(self) -> None:
        try:
            super().commit()
        finally:
            self._give_back()

    def rollback(self) -> None:
        try:
            super().rollback()
        finally:
            self._give_back()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._turn_over()

    def _give_back(self) -> None:
        """After a transaction's end: the turn goes on unless the transaction is still open
        (a COMMIT that failed stays open until its rollback)."""
        if self._turn is not None and not self.in_transaction:
            self._turn_over()

    def _turn_over(self) -> None:
        turn, self._turn = getattr(self, "_turn", None), None
        if turn is not None and self._turns is not None:
            self._turns.release(turn)

    def __del__(self) -> None:  # a connection dropped mid-transaction: SQLite rolls it back
        self._turn_over()
