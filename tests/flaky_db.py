"""A real database engine that fails on purpose: transient (or other) errors injected where the
code opens a transaction or a connection, to show each call site rides them out (lib/core/retry.py)."""

from __future__ import annotations

import sqlite3
import sys
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, exc


def lost_connection() -> Exception:
    """What SQLAlchemy raises when the server drops the connection under a statement."""
    import psycopg

    return exc.OperationalError(
        "SELECT 1", {}, psycopg.OperationalError("server closed the connection unexpectedly")
    )


def database_locked() -> Exception:
    return exc.OperationalError(
        "BEGIN IMMEDIATE", {}, sqlite3.OperationalError("database is locked")
    )


def undefined_table() -> Exception:
    """A bug, not a blip: never worth another attempt."""
    from psycopg import errors

    return exc.ProgrammingError(
        "SELECT * FROM nowhere", {}, errors.UndefinedTable('relation "nowhere" does not exist')
    )


class FlakyDatabase:
    """Wraps `engine`: `begin()` and `connect()` raise `error()` the first `times` times they are
    called from each call site (the function that calls them), then work. `sites` limits the
    injection to those functions. `injected` counts the failures per site."""

    def __init__(
        self,
        engine: Engine,
        error: Callable[[], Exception],
        times: int = 2,
        sites: set[str] | None = None,
    ) -> None:
        self._engine, self._error, self._times, self._sites = engine, error, times, sites
        self._lock = threading.Lock()
        self.injected: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def _maybe_fail(self) -> None:
        site = sys._getframe(2).f_code.co_name
        if self._sites is not None and site not in self._sites:
            return
        with self._lock:
            if self.injected[site] >= self._times:
                return
            self.injected[site] += 1
        raise self._error()

    def begin(self) -> Any:
        self._maybe_fail()
        return self._engine.begin()

    def connect(self) -> Any:
        self._maybe_fail()
        return self._engine.connect()
