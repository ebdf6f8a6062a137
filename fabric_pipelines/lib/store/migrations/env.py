"""Alembic environment: migrations run on the connection `upgrade()` hands over (store/schema.py),
or on the configured sqlalchemy.url when run by the alembic command itself."""

from __future__ import annotations

from alembic import context

from fabric_pipelines.lib.store.models import Base

config = context.config
target_metadata = Base.metadata


def run() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        from fabric_pipelines.lib.store.db import make_engine

        url = config.get_main_option("sqlalchemy.url")
        if not url:
            raise SystemExit(
                "set sqlalchemy.url for the alembic command, or run `fabric db upgrade`, which "
                "finds the database from the project's settings"
            )
        engine = make_engine(url)
        with engine.begin() as conn:
            context.configure(
                connection=conn, target_metadata=target_metadata, render_as_batch=True
            )
            context.run_migrations()
        return
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


run()
