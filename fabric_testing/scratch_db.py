"""Throwaway PostgreSQL databases and schemas, for the test suite and the benchmarks: never the
user's data."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, create_engine, make_url, text

from fabric_pipelines.lib.core.retry import retry


@contextmanager
def scratch_database(server_url: str, prefix: str) -> Iterator[str]:
    """URL of a new database on the server of `server_url`, dropped (with its connections) at
    the end of the block."""
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"

    def create() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))

    # The server may be restarting (tests/test_writer.py restarts it): ride that out.
    retry(f"creating the scratch database {name}", create)
    try:
        # The database name set properly: a socket URL's `?host=/dir` holds slashes of its own.
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        admin.dispose()  # the server may have restarted meanwhile: start from fresh connections

        def drop() -> None:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

        retry(f"dropping the scratch database {name}", drop)
        admin.dispose()


def empty_public_schema(engine: Engine) -> None:
    """Drop every table, type and extension of the public schema: the database is as new."""
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
