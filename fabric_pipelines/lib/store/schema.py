"""The database schema's version: Alembic migrations (store/migrations), run in-process.

`upgrade` brings an empty or older database to the newest revision; every entry point calls it,
so a fresh database needs no manual step (`fabric db upgrade` does the same by hand).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Engine, inspect, text

from fabric_pipelines.lib.core.retry import unit_of_work
from fabric_pipelines.lib.store.vector_columns import VectorColumns

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def _config(connection: object) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


class UnversionedSchemaError(RuntimeError):
    pass


# Any fixed 64-bit number nothing else takes advisory locks with: the bytes of "fabricsc".
SCHEMA_LOCK_KEY = 0x6661627269637363


def lock_schema(conn: Connection) -> None:
    """Serialise schema changes for the rest of `conn`'s transaction.

    Every entry point upgrades, so processes started together on a fresh PostgreSQL database
    would each CREATE the same tables (a unique violation in pg_type): the advisory lock makes
    the others wait, then find the schema at head. The lock is per database, released at commit
    or rollback. SQLite needs none: engines of store/db.make_engine begin every transaction with
    BEGIN IMMEDIATE, so the write lock is held before the revision is read.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK_KEY})


@contextmanager
def _migrating(engine: Engine) -> Iterator[Connection]:
    """A transaction to change the schema in, under the schema lock.

    SQLite changes a table by copying it (Alembic's batch mode), and with foreign keys on,
    dropping the old copy would cascade into the tables that refer to it: they are off for the
    migration (the pragma takes effect outside a transaction only) and checked at its end.
    """
    with engine.connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        if sqlite:
            conn.connection.dbapi_connection.execute("PRAGMA foreign_keys=OFF")  # type: ignore[union-attr]
        try:
            with conn.begin():
                lock_schema(conn)
                yield conn
                if sqlite:
                    broken = conn.exec_driver_sql("PRAGMA foreign_key_check").first()
                    if broken is not None:
                        raise RuntimeError(
                            f"the migration left a broken reference: {tuple(broken)}"
                        )
        finally:
            if sqlite:
                conn.connection.dbapi_connection.execute("PRAGMA foreign_keys=ON")  # type: ignore[union-attr]


# Alembic keeps a running migration's state in module globals (alembic.context, alembic.op): two
# threads migrating at once in one process (ours, and Dagster's instance storage stamping a fresh
# DAGSTER_HOME) pull them from under each other (KeyError: 'script'). One at a time: whoever opens
# a Dagster instance while ours may run takes this lock too (cli/prepare.py).
ALEMBIC_LOCK = threading.RLock()


@unit_of_work("bringing the database schema up to {revision}")
def upgrade(engine: Engine, revision: str = "head") -> None:
    with _migrating(engine) as conn:
        # Asked under the lock: another process's upgrade has committed or not begun.
        unversioned = MigrationContext.configure(conn).get_current_revision() is None
        if unversioned and "embeddings" in inspect(conn).get_table_names():
            raise UnversionedSchemaError(
                f"{engine.url.render_as_string(hide_password=True)} holds fabric tables without "
                "a schema revision (made before migrations existed); point FABRIC_DATABASE_URL "
                "at a new database, or drop those tables"
            )
        with ALEMBIC_LOCK:
            command.upgrade(_config(conn), revision)


def downgrade(engine: Engine, revision: str = "-1") -> None:
    with _migrating(engine) as conn, ALEMBIC_LOCK:
        command.downgrade(_config(conn), revision)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def stores_pgvector(engine: Engine) -> bool:
    """Whether embeddings go into a pgvector column (decided by migration 0002 at upgrade)."""
    if engine.dialect.name != "postgresql":
        return False
    with engine.connect() as conn:
        return has_pgvector_column(conn)


def has_pgvector_column(conn: Connection) -> bool:
    """`stores_pgvector` inside an open connection."""
    return VectorColumns.of(conn).float32
