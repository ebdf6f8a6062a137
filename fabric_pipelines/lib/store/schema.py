"""The database schema's version: Alembic migrations (store/migrations), run in-process.

`upgrade` brings an empty or older database to the newest revision; every entry point calls it,
so a fresh database needs no manual step (`fabric db upgrade` does the same by hand).
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, inspect

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def _config(connection: object) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


class UnversionedSchemaError(RuntimeError):
    pass


def upgrade(engine: Engine, revision: str = "head") -> None:
    if current_revision(engine) is None and "embeddings" in inspect(engine).get_table_names():
        raise UnversionedSchemaError(
            f"{engine.url.render_as_string(hide_password=True)} holds fabric tables without a "
            "schema revision (made before migrations existed); point FABRIC_DATABASE_URL at a "
            "new database, or drop those tables"
        )
    with engine.begin() as conn:
        command.upgrade(_config(conn), revision)


def downgrade(engine: Engine, revision: str = "-1") -> None:
    with engine.begin() as conn:
        command.downgrade(_config(conn), revision)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def stores_pgvector(engine: Engine) -> bool:
    """Whether embeddings go into a pgvector column (decided by migration 0002 at upgrade)."""
    if engine.dialect.name != "postgresql":
        return False
    columns = {c["name"] for c in inspect(engine).get_columns("embeddings")}
    return "embedding" in columns
