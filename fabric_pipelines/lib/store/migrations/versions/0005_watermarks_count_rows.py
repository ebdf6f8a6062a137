"""PostgreSQL's shard watermarks move by the number of rows changed, as SQLite's do.

0003's statement-level trigger raised each touched shard's version by one per statement (one
COPY of thousands of rows: +1). Staleness only needs "moved", but a version that counts rows
also proves a complete read: the index step may take vectors followed during extraction only
when the versions moved by exactly the rows it saw arrive (index/vector_tail.py). Now each
statement adds, per shard, the rows it inserted or deleted (an update counts its old and its new
row), the same numbers SQLite's row-level triggers add. One grouped pass over the transition
table per statement.

Downgrade: 0003's function again.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

SHARD = "((r.task_set_id * 7919 + r.record_no) % w.n_shards)"


def _bump(table: str) -> str:
    return f"""
    UPDATE shard_watermarks w SET version = w.version + c.n
    FROM (SELECT w.model_id, w.n_shards, w.shard, count(*) AS n
          FROM {table} r JOIN shard_watermarks w
            ON r.model_id = w.model_id AND {SHARD} = w.shard
          GROUP BY w.model_id, w.n_shards, w.shard) c
    WHERE w.model_id = c.model_id AND w.n_shards = c.n_shards AND w.shard = c.shard;"""


COUNTING_FUNCTION = f"""
CREATE OR REPLACE FUNCTION fabric_bump_watermarks() RETURNS trigger AS $$
BEGIN
  IF TG_OP IN ('INSERT', 'UPDATE') THEN{_bump("changed_new")}
  END IF;
  IF TG_OP IN ('DELETE', 'UPDATE') THEN{_bump("changed_old")}
  END IF;
  RETURN NULL;
END $$ LANGUAGE plpgsql
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(COUNTING_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_revision_0003().PG_FUNCTION)


def _revision_0003() -> ModuleType:
    """0003's module, whose function this one replaced (loaded by path: Alembic does not import
    revisions as a package)."""
    path = Path(__file__).with_name("0003_shard_watermarks.py")
    spec = importlib.util.spec_from_file_location("fabric_migration_0003", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
