"""Per-shard watermarks for index staleness, maintained by triggers on embeddings.

A model's index may be split into N shards by a fixed hash of (task set, task). For each
(model, N, shard) registered in shard_watermarks, every insert, update or delete of an embedding
of that shard raises `version`. An index receipt records the versions it was built from; a shard
whose version moved is stale, and only stale shards are rebuilt. The shard of a row is
(task_set_id * 7919 + record_no) mod N, the same expression in SQL and in NumPy (index/shards.py).

PostgreSQL: statement-level triggers over transition tables (one UPDATE per COPY, not per row).
SQLite: row-level triggers.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

SHARD = "(({t}.task_set_id * 7919 + {t}.record_no) % w.n_shards)"

PG_FUNCTION = """
CREATE OR REPLACE FUNCTION fabric_bump_watermarks() RETURNS trigger AS $$
BEGIN
  IF TG_OP IN ('INSERT', 'UPDATE') THEN
    UPDATE shard_watermarks w SET version = w.version + 1
    WHERE EXISTS (SELECT 1 FROM changed_new r
                  WHERE r.model_id = w.model_id AND {new} = w.shard);
  END IF;
  IF TG_OP IN ('DELETE', 'UPDATE') THEN
    UPDATE shard_watermarks w SET version = w.version + 1
    WHERE EXISTS (SELECT 1 FROM changed_old r
                  WHERE r.model_id = w.model_id AND {old} = w.shard);
  END IF;
  RETURN NULL;
END $$ LANGUAGE plpgsql
""".format(new=SHARD.format(t="r"), old=SHARD.format(t="r"))


def upgrade() -> None:
    op.create_table(
        "shard_watermarks",
        sa.Column("model_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("n_shards", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("shard", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(PG_FUNCTION)
        op.execute(
            "CREATE TRIGGER embeddings_watermark_insert AFTER INSERT ON embeddings "
            "REFERENCING NEW TABLE AS changed_new FOR EACH STATEMENT "
            "EXECUTE FUNCTION fabric_bump_watermarks()"
        )
        op.execute(
            "CREATE TRIGGER embeddings_watermark_update AFTER UPDATE ON embeddings "
            "REFERENCING OLD TABLE AS changed_old NEW TABLE AS changed_new FOR EACH STATEMENT "
            "EXECUTE FUNCTION fabric_bump_watermarks()"
        )
        op.execute(
            "CREATE TRIGGER embeddings_watermark_delete AFTER DELETE ON embeddings "
            "REFERENCING OLD TABLE AS changed_old FOR EACH STATEMENT "
            "EXECUTE FUNCTION fabric_bump_watermarks()"
        )
        return
    for event, rows in (("INSERT", ("NEW",)), ("UPDATE", ("OLD", "NEW")), ("DELETE", ("OLD",))):
        body = "\n".join(
            "UPDATE shard_watermarks SET version = version + 1 "
            f"WHERE model_id = {r}.model_id "
            f"AND shard = (({r}.task_set_id * 7919 + {r}.record_no) % n_shards);"
            for r in rows
        )
        op.execute(
            f"CREATE TRIGGER embeddings_watermark_{event.lower()} AFTER {event} ON embeddings "
            f"BEGIN {body} END"
        )


def downgrade() -> None:
    for event in ("insert", "update", "delete"):
        op.execute(f"DROP TRIGGER IF EXISTS embeddings_watermark_{event} ON embeddings"
                   if op.get_bind().dialect.name == "postgresql"
                   else f"DROP TRIGGER IF EXISTS embeddings_watermark_{event}")  # fmt: skip
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS fabric_bump_watermarks()")
    op.drop_table("shard_watermarks")
