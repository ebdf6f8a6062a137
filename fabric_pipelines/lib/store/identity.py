"""Which database this is: the id migration 0015 made with the schema, for the warm pool.

A pool worker keeps its database engine between runs. After a fresh start (the data root, and
with it the SQLite file, deleted and made again) its pooled connections still read the old file;
the run's job names the identity of the database it means, and a worker that reads another one
refuses the job (lib/worker/pool/server.py).
"""

from __future__ import annotations

from sqlalchemy import Connection, Engine, select
from sqlalchemy.exc import DBAPIError

from fabric_pipelines.lib.store.db import create_schema, make_engine
from fabric_pipelines.lib.store.models import DatabaseIdentity


def database_identity(db: Engine | Connection) -> str:
    """The identity of the database `db` is connected to (its connections' own file or server)."""
    query = select(DatabaseIdentity.id)
    if isinstance(db, Connection):
        return str(db.execute(query).scalar_one())
    with db.connect() as conn:
        return str(conn.execute(query).scalar_one())


def database_identity_at(url: str) -> str:
    """The identity of the database at `url`, read on a connection of its own; a database with
    no identity yet (new, or at an older revision) is brought to the newest schema first: a run
    hands the pool its job before it opens the database (`fabric submit --run` on a new root)."""
    engine = make_engine(url)
    try:
        try:
            return database_identity(engine)
        except DBAPIError:  # no such table
            create_schema(engine)
            return database_identity(engine)
    finally:
        engine.dispose()
