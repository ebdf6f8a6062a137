"""Connecting to the database: PostgreSQL through psycopg 3, or the embedded SQLite file.

SQLite runs in WAL mode, and every transaction starts with BEGIN IMMEDIATE, so a transaction that
reads the ledger and then claims a batch holds the write lock from its first statement: two
workers can never claim the same batch. Threads of one process take that lock in arrival order
(store/write_turns.py), not by SQLite's sleep-and-retry.
"""

from __future__ import annotations

import functools
import os
import sqlite3
from contextlib import closing
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.dml import Insert

from fabric_pipelines.lib.store.models import Base
from fabric_pipelines.lib.store.write_turns import TurnConnection

# How long a writer waits for SQLite's write lock before "database is locked" (then the unit of
# work is retried, lib/core/retry.py); FABRIC_SQLITE_BUSY_TIMEOUT_MS overrides it.
SQLITE_BUSY_TIMEOUT_MS = 60_000
# Page size of a new SQLite file. An embedding row is 1.5 KB (384-d) to 3 KB (768-d): at the
# default 4 KiB one or two rows fill a page and the single writer spends its time splitting
# pages; at 32 KiB it inserts 1.6-1.8x the rows a second (measured, 384-d and 768-d). It only
# takes effect before the file's first table: an existing database keeps its size.
SQLITE_PAGE_BYTES = 32 * 1024
# Each connection's page cache, in KiB (the default is 2 MiB: 64 pages of 32 KiB).
SQLITE_CACHE_KIB = 32 * 1024
IDLE_IN_TRANSACTION_MS = 60_000


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        busy_ms = sqlite_busy_timeout_ms()
        engine = create_engine(
            url, connect_args={"timeout": busy_ms / 1000, "factory": TurnConnection}
        )

        @event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
            # Let SQLAlchemy's "begin" event issue BEGIN itself (pysqlite's own is deferred).
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            cursor.execute(f"PRAGMA page_size={SQLITE_PAGE_BYTES}")  # before WAL fixes it
            cursor.execute(f"PRAGMA cache_size={-SQLITE_CACHE_KIB}")
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
            # SQLite checks foreign keys (store/models.py) only when each connection asks.
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Any) -> None:
            # Threads of this process take the write lock in turn (store/write_turns.py).
            conn.connection.dbapi_connection.begin_immediate()

        return engine
    # A worker that stalls inside a transaction (stopped, swapped out) would keep its row locks,
    # and with them the batch it holds, forever: the server ends such sessions.
    return create_engine(
        url,
        pool_pre_ping=True,
        connect_args={
            "options": f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_MS}",
            "application_name": "fabric",
        },
    )


def sqlite_busy_timeout_ms() -> int:
    raw = os.environ.get("FABRIC_SQLITE_BUSY_TIMEOUT_MS", "")
    if not raw:
        return SQLITE_BUSY_TIMEOUT_MS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"FABRIC_SQLITE_BUSY_TIMEOUT_MS={raw!r} is not a number of milliseconds (>= 0): "
            f"unset it for the default, {SQLITE_BUSY_TIMEOUT_MS}"
        )
    return value


def create_schema(engine: Engine) -> None:
    """Bring the database to the newest schema revision (Alembic; a no-op when it is)."""
    from fabric_pipelines.lib.store.schema import upgrade

    upgrade(engine)


def insert_ignoring_duplicates(engine: Engine | Any, model: type[Base]) -> Insert:
    """INSERT ... ON CONFLICT DO NOTHING for this engine's dialect: the idempotent write."""
    if engine.dialect.name == "postgresql":
        return postgresql.insert(model).on_conflict_do_nothing()
    if engine.dialect.name == "sqlite":
        return sqlite.insert(model).on_conflict_do_nothing()
    raise NotImplementedError(f"database dialect {engine.dialect.name!r} is not supported")


@functools.cache
def sqlite_has_json() -> bool:
    """Whether the SQLite library Python links has its JSON functions (built in since 3.38; an
    option before): the bulk inserts read a statement's rows out of one JSON array. Asked once
    per process, of a database in memory."""
    with closing(sqlite3.connect(":memory:")) as probe:
        try:
            probe.execute("SELECT json_valid('[]')").fetchone()
        except sqlite3.OperationalError:
            return False
    return True
