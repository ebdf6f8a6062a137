"""Alembic migrations on both databases: upgrade from empty, downgrade one step, and the
migrated schema matches the models exactly."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from fabric_pipelines.lib.store.db import make_engine
from fabric_pipelines.lib.store.models import Base
from fabric_pipelines.lib.store.schema import current_revision, downgrade, stores_pgvector, upgrade

TABLES = {
    "task_sets", "tasks", "models", "task_failures", "batch_plans", "batches", "embeddings",
    "hidden_state_shards", "index_receipts",
}  # fmt: skip


def test_upgrade_from_empty_then_downgrade_one_step(db_url: str) -> None:
    engine = make_engine(db_url)
    assert current_revision(engine) is None
    upgrade(engine)
    assert current_revision(engine) == "0003"
    assert set(inspect(engine).get_table_names()) >= TABLES
    downgrade(engine, "-1")
    assert current_revision(engine) == "0002"
    assert set(inspect(engine).get_table_names()) >= TABLES
    upgrade(engine)
    assert current_revision(engine) == "0003"
    downgrade(engine, "base")
    assert not TABLES & set(inspect(create_engine(db_url)).get_table_names())
    engine.dispose()


def test_migrated_schema_matches_the_models(db_url: str) -> None:
    engine = make_engine(db_url)
    upgrade(engine)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    if stores_pgvector(engine):  # the pgvector column is not in the models (chosen at run time)
        diff = [d for d in diff if "embedding" not in str(d)]
    assert diff == [], diff
    engine.dispose()


def test_embeddings_are_float32_bytes_without_pgvector(db_url: str) -> None:
    engine = make_engine(db_url)
    upgrade(engine)
    with engine.connect() as conn:
        available = (
            engine.dialect.name == "postgresql"
            and conn.exec_driver_sql(
                "select 1 from pg_available_extensions where name = 'vector'"
            ).first()
            is not None
        )
    assert stores_pgvector(engine) == available
    engine.dispose()
