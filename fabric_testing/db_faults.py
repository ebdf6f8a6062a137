"""Database faults at named points of a run, for tests/test_phase_faults.py and bench/faults.py.

Every database call of a run is meant to sit inside a unit of work: a `retry` of
lib/core/retry.py, which names it (`current_unit()`) and runs it again after a transient error.
This module, loaded into each process of a run by `sitecustomize.py` beside it (put its folder
first on PYTHONPATH), hits those units from inside, for real:

- `FABRIC_FAULT_UNITS="ingest;planning;combining"`: at the first statement of the first unit
  whose operation contains each fragment (case-insensitive), once per run whatever process gets
  there first, PostgreSQL's backend of that connection is terminated (`pg_terminate_backend`,
  from a second connection) before the statement is sent; on SQLite another connection takes
  the write lock for `FABRIC_FAULT_LOCK_S` seconds (default 3) before the unit's transaction
  begins, so the run's BEGIN IMMEDIATE outwaits its busy timeout (set it short with
  `FABRIC_SQLITE_BUSY_TIMEOUT_MS`) and fails "database is locked". `FABRIC_FAULT_DIR` gets one
  file per fault that fired, naming the unit, the process and the statement.
- `FABRIC_FAULT_UNCOVERED=FILE`: every statement sent to the run's database outside any unit is
  appended to FILE (one JSON line: the statement and the product frame that sent it), so a test
  can require that there are none.

Nothing here is imported by the product.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.engine import make_url

from fabric_pipelines.lib.core.retry import current_unit

UNITS_ENV = "FABRIC_FAULT_UNITS"
DIR_ENV = "FABRIC_FAULT_DIR"
LOCK_ENV = "FABRIC_FAULT_LOCK_S"
UNCOVERED_ENV = "FABRIC_FAULT_UNCOVERED"
DATABASE_ENV = "FABRIC_DATABASE_URL"

_installed = False
_lock = threading.Lock()


def install() -> None:
    """Listen on every SQLAlchemy engine of this process (idempotent; a no-op without the
    environment variables above)."""
    global _installed
    fragments = [f.strip().lower() for f in os.environ.get(UNITS_ENV, "").split(";") if f.strip()]
    uncovered = os.environ.get(UNCOVERED_ENV)
    if _installed or not (fragments or uncovered):
        return
    _installed = True
    folder = Path(os.environ.get(DIR_ENV, "."))
    hold_s = float(os.environ.get(LOCK_ENV, "3"))

    def target(conn: Any) -> str | None:
        """The fragment this connection's current unit matches and that has not fired yet."""
        unit = current_unit()
        if unit is None or not _is_run_database(conn.engine):
            return None
        lowered = unit.lower()
        for fragment in fragments:
            if fragment in lowered and not _fired_path(folder, fragment).exists():
                return fragment
        return None

    @event.listens_for(Engine, "begin", insert=True)
    def _lock_sqlite(conn: Any) -> None:
        # Before the engine's own BEGIN IMMEDIATE (store/db.py): another writer holds the lock.
        if conn.engine.dialect.name != "sqlite":
            return
        fragment = target(conn)
        if fragment is None or not _claim(folder, fragment, "BEGIN IMMEDIATE"):
            return
        _hold_write_lock(str(conn.engine.url.database), hold_s)

    @event.listens_for(Engine, "before_cursor_execute")
    def _before(conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if uncovered and current_unit() is None and _is_run_database(conn.engine):
            _note_uncovered(Path(uncovered), statement)
        if conn.engine.dialect.name != "postgresql":
            return
        fragment = target(conn)
        if fragment is None or not _claim(folder, fragment, statement):
            return
        _terminate_backend(conn)


def _is_run_database(engine: Engine) -> bool:
    """The run's results database, not Dagster's own storage (which may be SQLite too)."""
    wanted = os.environ.get(DATABASE_ENV)
    if wanted:
        url = make_url(wanted)
        return (engine.url.get_backend_name(), engine.url.host, engine.url.port,
                engine.url.database) == (url.get_backend_name(), url.host, url.port, url.database)  # fmt: skip
    # The embedded default: the data root's fabric.db.
    return engine.dialect.name == "sqlite" and str(engine.url.database).endswith("fabric.db")


def _fired_path(folder: Path, fragment: str) -> Path:
    return folder / (re.sub(r"[^a-z0-9]+", "-", fragment).strip("-") + ".fired")


def _claim(folder: Path, fragment: str, statement: str) -> bool:
    """Mark `fragment` fired, once across every process of the run (O_EXCL)."""
    with _lock:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(_fired_path(folder, fragment), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        record = {"unit": current_unit(), "pid": os.getpid(), "statement": statement[:200]}
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
        os.close(fd)
        return True


def _terminate_backend(conn: Any) -> None:
    """End the server process behind `conn` from another connection, and wait until it is gone,
    so the statement about to be sent meets a dead connection."""
    import psycopg

    pid = conn.connection.dbapi_connection.info.backend_pid
    url = conn.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as side:
        side.execute("select pg_terminate_backend(%s)", (pid,))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            row = side.execute("select 1 from pg_stat_activity where pid = %s", (pid,)).fetchone()
            if row is None:
                return
            time.sleep(0.01)


def _hold_write_lock(path: str, hold_s: float) -> None:
    """Another connection takes SQLite's write lock for `hold_s` seconds; returns once it holds
    it."""
    held = threading.Event()

    def hold() -> None:
        side = sqlite3.connect(path, timeout=60, isolation_level=None)
        try:
            side.execute("BEGIN IMMEDIATE")
            held.set()
            time.sleep(hold_s)
            side.execute("ROLLBACK")
        finally:
            side.close()

    threading.Thread(target=hold, name="fault-lock-holder", daemon=True).start()
    if not held.wait(60):
        raise RuntimeError(f"could not take the write lock of {path} for a fault")


def _note_uncovered(path: Path, statement: str) -> None:
    frames = [
        f"{Path(f.filename).name}:{f.lineno} {f.name}"
        for f in traceback.extract_stack()
        if "fabric_pipelines" in f.filename or "fabric_gpu" in f.filename
    ]
    line = json.dumps(
        {"pid": os.getpid(), "statement": " ".join(statement.split())[:160], "frames": frames[-4:]}
    )
    with _lock, open(path, "a") as out:
        out.write(line + "\n")
